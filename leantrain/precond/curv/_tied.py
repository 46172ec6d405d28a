r"""Tied weights: one parameter used by several linear-form modules.

A language model's token embedding ``nn.Embedding(V, d)`` and its output head
``nn.Linear(d, V, bias=False)`` commonly share one ``(V, d)`` weight. Each module is
a *site* of the shared parameter; :class:`TiedOp` makes the group one op, so every
consumer of the curvature layer sees one owner of the parameter.

Canonical layout: the parameter's own shape, ``R`` = its rows, ``U`` = its columns
(for the embedding / head pair: ``R = V`` tokens, ``U = d``). The per-example gradient
of the shared parameter is the sum of its sites' per-example gradients, so the
"full", "layer", "unit" and "diag" representations stay exact.

"kron" (the Kronecker-of-sums rule, cf. Eschenhagen et al. 2023, "Kronecker-factored
approximate curvature for modern neural network architectures"): each site gives the
two factors its untied K-FAC would, oriented to the parameter's rows and columns
(the embedding: rows ``A = diag(token counts) / N``, columns ``B = sum e e^T`` of
its output-gradients; the head: rows ``B`` of the logit gradients, columns
``A = sum a a^T / N`` of its inputs); the shared parameter's factors are the sums
over its sites, ``B_tied = sum_s rows_s`` and ``A_tied = sum_s cols_s``, so its
curvature is ``B_tied ⊗ A_tied``. For one site it is that site's K-FAC exactly.

Supported sites: ``nn.Linear`` (and subclasses), Hugging Face ``Conv1D`` and
``nn.Embedding`` sharing their weight; at most one of them, an ``nn.Linear`` (BERT's
decoder), may have a bias, which becomes a last canonical column (the embedding's
column factor is zero there). Anything else raises, naming the parameter's modules.
"""

from __future__ import annotations

import torch
from torch import nn

from ._base import ModuleOp, _acc
from ._conv1d import Conv1dOp
from ._linear_form import LinearFormOp
from .modules import EmbeddingOp, LinearOp

__all__ = ["TiedOp", "check_tieable"]


def check_tieable(ops: list[ModuleOp]) -> None:
    """Raise ValueError unless ``ops`` can form a :class:`TiedOp`."""
    names = ", ".join(repr(op.name) for op in ops)
    weight = ops[0].params[0]
    biased = 0
    for op in ops:
        own = op.params
        bias = (
            isinstance(op, LinearFormOp)
            and op.has_bias
            and not op.transposed  # a bias along the weight's rows
            and len(own) == 2
        )
        biased += bias
        ok = (
            isinstance(op, (LinearOp, Conv1dOp, EmbeddingOp))
            and (not op.has_bias or bias)
            and own[0] is weight
            and op.canon_index.shape[0] * (op.canon_index.shape[1] - bias)
            == weight.numel()
        )
        if not ok or biased > 1:
            raise ValueError(
                f"modules {names} share a parameter (tied weights) in a way no "
                "curvature rule here covers: every site must be an nn.Linear, "
                "Conv1D or nn.Embedding sharing its weight, at most one of them (an "
                f"nn.Linear) with a bias (module {op.name!r} is "
                f"{type(op.module).__name__} with {len(own)} parameter(s)); list one "
                "of them in ignore_modules"
            )
    if weight.dim() != 2:
        raise ValueError(
            f"modules {names} share a parameter of shape {tuple(weight.shape)}; "
            "tied weights must be 2-D"
        )


class TiedOp(ModuleOp):
    """Sites of one shared weight as one op (see the module docstring).

    Attributes:
        members: the sites' ops, in module order.
        modules: the sites' modules (``module`` is ``None``: there is no one module).
    """

    kron_capable = True

    def __init__(self, name: str, members: list[ModuleOp]) -> None:
        check_tieable(members)
        self.name = name
        self.members = members
        self.modules = [op.module for op in members]
        self.module = None
        weight = members[0].params[0]
        bias = [op.params[1] for op in members if len(op.params) == 2]
        self.params = [weight, *bias]
        self.numel = sum(p.numel() for p in self.params)
        self.has_bias = bool(bias)
        rows, cols = weight.shape
        r = torch.arange(rows).unsqueeze(1)
        index = r * cols + torch.arange(cols).unsqueeze(0)
        if bias:  # the head's bias: a last column along the weight's rows
            index = torch.cat([index, rows * cols + r], dim=1)
        self.canon_index = index
        self._member_of = {id(op.module): i for i, op in enumerate(members)}
        offsets = {id(weight): 0, **({id(bias[0]): weight.numel()} if bias else {})}
        # Per member: positions of its flat parameters in this op's flat vector.
        self._flat = [
            torch.cat([torch.arange(p.numel()) + offsets[id(p)] for p in op.params])
            for op in members
        ]

    @property
    def member_names(self) -> list[str]:
        return [op.name for op in self.members]

    # -- capture -----------------------------------------------------------------
    def record_module(self, module: nn.Module, args: tuple, output: object) -> tuple:
        i = self._member_of[id(module)]
        feats, tensors = self.members[i].record(args, output)
        return {"member": i, "feats": feats}, tensors

    def hooked_modules(self) -> list[nn.Module]:
        return list(self.modules)

    def record(self, args: tuple, output: object) -> tuple:
        raise RuntimeError("TiedOp records through record_module (one per site)")

    def grad_feature(self, slot: int, grad: torch.Tensor) -> torch.Tensor:
        # Every supported site has one output, (N, *, out): positions in the middle.
        return _acc(grad).reshape(grad.shape[0], -1, grad.shape[-1])

    def _by_member(self, calls: list) -> list[list]:
        groups: list[list] = [[] for _ in self.members]
        for feats, grads in calls:
            groups[feats["member"]].append((feats["feats"], grads))
        return groups

    def combine(self, calls: list) -> list:
        """``[(member index, member sites), ...]`` for the sites that saw gradient."""
        out = []
        for i, group in enumerate(self._by_member(calls)):
            sites = self.members[i].combine(group) if group else []
            if sites:
                out.append((i, sites))
        return out

    def n_examples(self, data: list) -> int:
        i, sites = data[0]
        return self.members[i].n_examples(sites)

    # -- algebra ------------------------------------------------------------------
    def per_example(self, data: list, sl: slice) -> torch.Tensor:
        """Sum over the sites of their per-example gradients, in the parameter's
        own ``(R, U)`` layout."""
        flat = None
        for i, sites in data:
            part = self.members[i].per_example_flat(sites, sl)
            if flat is None:
                flat = part.new_zeros(part.shape[0], self.numel)
            if self._flat[i].device != flat.device:  # the model moved (see index_on)
                self._flat[i] = self._flat[i].to(flat.device)
            flat[:, self._flat[i]] += part
        return flat[:, self.index_on(flat.device)]

    def _oriented(self, i: int) -> bool:
        """Whether site ``i``'s canonical rows are the parameter's rows (Linear);
        transposed sites (Embedding, Conv1D) have them as columns."""
        return not self.members[i].transposed

    def kron_a(self, calls: list) -> list[torch.Tensor]:
        """The forward-only factor parts, summed: ``[rows, cols]`` of the parameter."""
        rows, cols = self.canon_index.shape
        dtype = self.params[0].dtype
        dtype = dtype if dtype in (torch.float32, torch.float64) else torch.float32
        out = [self.params[0].new_zeros(rows, rows, dtype=dtype)]
        out.append(out[0].new_zeros(cols, cols))
        for i, group in enumerate(self._by_member(calls)):
            if group:
                a = self.members[i].kron_a(group)[0]
                side = 1 if self._oriented(i) else 0
                out[side] = out[side] + _pad(a.to(out[side].dtype), out[side].shape[0])
        return out

    def kron_b(self, data: list) -> list[torch.Tensor]:
        """This pass's output-gradient factor parts, summed: ``[rows, cols]``."""
        out: list[torch.Tensor | None] = [None, None]
        rows, cols = self.canon_index.shape
        for i, sites in data:
            b = self.members[i].kron_b(sites)[0]
            side = 0 if self._oriented(i) else 1
            b = _pad(b, (rows, cols)[side])
            out[side] = b if out[side] is None else out[side] + b
        ref = next(b for b in out if b is not None)
        return [
            ref.new_zeros(n, n) if b is None else b
            for b, n in zip(out, (rows, cols), strict=True)
        ]

    def site_rows(self, calls: list) -> list[slice]:
        return [slice(0, self.canon_index.shape[0])]

    def finish_kron(self, stats: dict) -> dict:
        """One site in the parameter's layout: ``B = rows``, ``A = cols`` (sums of
        the forward parts in ``stats["A"]`` and the accumulated ``stats["B"]``)."""
        (rows_a, cols_a), (rows_b, cols_b) = stats["A"], stats["B"]
        rows = rows_a if rows_b is None else rows_a + rows_b.to(rows_a.dtype)
        cols = cols_a if cols_b is None else cols_a + cols_b.to(cols_a.dtype)
        stats["A"], stats["B"] = [cols], [rows]
        stats["rows"] = [slice(0, rows.shape[0])]
        return stats


def _pad(factor: torch.Tensor, size: int) -> torch.Tensor:
    """A site's column factor without the bias column, zero-padded to ``size``: the
    embedding's ``B`` next to a head that has a bias (the embedding does not touch
    it)."""
    if factor.shape[0] == size:
        return factor
    out = factor.new_zeros(size, size)
    k = factor.shape[0]
    out[:k, :k] = factor
    return out
