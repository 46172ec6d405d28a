r"""Embedding calls on ids shared by every example of the batch (position ids).

A GPT adds a position embedding to its ``(N, T, d)`` token embeddings. Hugging Face
calls it on ids of shape ``(1, T)`` (a ``(1, T, d)`` output), nanoGPT on
``torch.arange(T)`` (shape ``(T,)``, a ``(T, d)`` output); either is broadcast over
the batch by the addition. The embedding's weight gradient is then the sum over the
batch of each example's contribution, and the output-gradient autograd delivers is
that sum too, from which no per-example statistic can be read.

The rule: such a call is recorded as the call on the ids expanded to ``(N, T)``,
with the output expanded alike (a view: the model computes the same values, and the
gradient of example ``n`` flows through copy ``n``, the expansion's backward summing
them as the broadcast did). Every statistic is then the one of a model that looks
up the positions once per example, which is what the shared lookup computes:

* per-example gradients (the empirical Fisher, "diag"/"unit"/"layer"/"full",
  SMW-NG's and SENG's sites): ``g_n = sum_t e_{n,t} onehot(pos_t)^T`` with
  ``e_{n,t}`` example ``n``'s output-gradient at position ``t``, and
  ``sum_n g_n`` is the weight gradient;
* K-FAC's input factor ``A = sum_{n,t} a a^T / N``: every example sees the same
  positions, so ``A`` is the diagonal of the position counts of one example;
* K-FAC's output factor ``B = sum_{n,t} e_{n,t} e_{n,t}^T``, per example, never
  ``(sum_n e_n)(sum_n e_n)^T`` (which would add the cross-example terms).

Which calls are shared (:func:`broadcast_embedding`): ids of shape ``(1, T)`` once a
batch ``N > 1`` was seen earlier in the forward; ids of shape ``(T,)`` once a batch
of sequences ``(N, T, ...)`` of that length ``T`` was seen (token ids or a linear
layer's input), and, when ``T == N`` (a batch of single ids would look alike), only
when the ids are ``0 .. T-1``, nanoGPT's ``torch.arange(T)``.
"""

from __future__ import annotations

import torch
from torch import nn

from ._conv1d import is_conv1d

__all__ = ["ForwardShapes", "broadcast_embedding"]


class ForwardShapes:
    """The batch and sequence lengths tracked modules saw in one model call."""

    def __init__(self) -> None:
        self.batch = 0  # the largest leading dimension of a tracked input
        self.lengths: set[int] = set()  # T of the (N, T, ...) sequences seen

    def see(self, module: nn.Module, args: tuple) -> None:
        """Note the input of a tracked module's call (one not expanded)."""
        if not args or not isinstance(args[0], torch.Tensor) or args[0].dim() == 0:
            return
        x = args[0]
        self.batch = max(self.batch, int(x.shape[0]))
        is_ids = isinstance(module, nn.Embedding) and x.dim() >= 2
        is_linear = isinstance(module, nn.Linear) or is_conv1d(module)
        is_tokens = is_linear and x.dim() >= 3
        if is_ids or is_tokens:
            self.lengths.add(int(x.shape[1]))


def _shared_positions(ids: torch.Tensor, seen: ForwardShapes) -> bool:
    """Whether 1-D ``ids`` are positions shared by the batch (see the module doc)."""
    length = int(ids.shape[0])
    if length not in seen.lengths:
        return False
    if length != seen.batch:
        return True
    # T == N: a batch of N single ids has this shape too. The host reads the ids
    # here, on curvature steps only (the hooks are attached then).
    positions = torch.arange(length, device=ids.device, dtype=ids.dtype)
    return torch.equal(ids, positions)


def broadcast_embedding(
    module: nn.Module, args: tuple, output: object, seen: ForwardShapes
) -> tuple[tuple, torch.Tensor] | None:
    """The expanded ``(args, output)`` of an ``nn.Embedding`` call on shared ids,
    or ``None`` for any other call (see the module doc for the rule)."""
    if not isinstance(module, nn.Embedding) or seen.batch <= 1 or not args:
        return None
    ids = args[0]
    if not isinstance(ids, torch.Tensor) or not isinstance(output, torch.Tensor):
        return None
    n = seen.batch
    if ids.dim() >= 2 and ids.shape[0] == 1:  # Hugging Face: (1, T)
        ids, output = ids.expand(n, *ids.shape[1:]), output.expand(n, *output.shape[1:])
    elif ids.dim() == 1 and _shared_positions(ids, seen):  # nanoGPT: (T,)
        ids = ids.unsqueeze(0).expand(n, -1)
        if output.dim() == 2:  # (T, d), unless another recorder's hook expanded it
            output = output.unsqueeze(0).expand(n, *output.shape)
    else:
        return None
    return (ids, *args[1:]), output
