"""Base of the per-module ops: captured sites and the generic per-example algebra.

See :mod:`.modules` for the canonical unit layout every op shares.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ModuleOp", "Site"]

_CHUNK_ELEMENTS = 1 << 22  # bound on a transient (n, R, U) per-example block


def _acc(t: torch.Tensor) -> torch.Tensor:
    """Detach; statistics of half-precision activations are accumulated in fp32."""
    t = t.detach()
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


@dataclass
class Site:
    """One weight row block applied at positions: ``y_t[rows] = W[rows] a_t (+ b)``.

    Attributes:
        rows: canonical rows (output units) this site produces.
        a: inputs ``(N, T, J)`` (for Embedding: token ids ``(N, T)``).
        e: output-gradients ``(N, T, len(rows))``.
    """

    rows: slice
    a: torch.Tensor
    e: torch.Tensor


class ModuleOp:
    """Base class: one supported module's capture and per-example algebra.

    Subclasses set ``canon_index`` and implement :meth:`record`, :meth:`grad_feature`,
    :meth:`combine` and :meth:`per_example`.
    """

    kron_capable = False

    def __init__(self, name: str, module: nn.Module) -> None:
        self.name = name
        self.module = module
        self.params = [p for _, p in module.named_parameters(recurse=False)]
        self.numel = sum(p.numel() for p in self.params)
        self.canon_index = torch.empty(0, 0, dtype=torch.long)

    # -- layout --------------------------------------------------------------------
    def index_on(self, device: torch.device) -> torch.Tensor:
        """:attr:`canon_index` on ``device``, where it then stays.

        The index is built on the CPU with the op, and the model often moves to
        the GPU afterwards; a CPU index into a CUDA tensor would be copied to the
        device (and the host synchronised) on every use."""
        if self.canon_index.device != device:
            self.canon_index = self.canon_index.to(device)
        return self.canon_index

    def to_canonical(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Tensors shaped like :attr:`params` (values, gradients) as canonical
        ``(R, U)``."""
        flat = torch.cat([t.reshape(-1) for t in tensors])
        return flat[self.index_on(flat.device)]

    def from_canonical(self, canon: torch.Tensor) -> list[torch.Tensor]:
        """A canonical ``(R, U)`` matrix as tensors shaped like :attr:`params`."""
        flat = canon.new_empty(self.numel)
        flat[self.index_on(flat.device).reshape(-1)] = canon.reshape(-1)
        return [
            piece.reshape(p.shape)
            for p, piece in zip(
                self.params, flat.split([p.numel() for p in self.params]), strict=True
            )
        ]

    # -- capture -----------------------------------------------------------------
    def record(self, args: tuple, output: object) -> tuple[dict, list[torch.Tensor]]:
        """Return the forward features and the tensors whose gradients are needed."""
        raise NotImplementedError

    def record_module(
        self, module: nn.Module, args: tuple, output: object
    ) -> tuple[dict, list[torch.Tensor]]:
        """:meth:`record` for a call of ``module`` (an op spanning several modules,
        such as tied weights, dispatches on it)."""
        return self.record(args, output)

    def hooked_modules(self) -> list[nn.Module]:
        """The modules whose forward this op records."""
        return [self.module]

    def grad_feature(self, slot: int, grad: torch.Tensor) -> torch.Tensor:
        """Reshape the gradient of hooked tensor ``slot`` to ``(N, T, ·)``."""
        raise NotImplementedError

    def combine(self, calls: list[tuple[dict, list[torch.Tensor | None]]]) -> list:
        """Merge every call of this pass (calls are extra positions) into sites."""
        raise NotImplementedError

    # -- algebra ------------------------------------------------------------------
    def per_example(self, data: list, sl: slice) -> torch.Tensor:
        """Canonical per-example gradients ``(n, R, U)`` for examples ``sl``."""
        raise NotImplementedError

    def n_examples(self, data: list) -> int:
        return int(data[0].e.shape[0])

    def chunks(self, data: list) -> list[slice]:
        n = self.n_examples(data)
        rows, units = self.canon_index.shape
        step = max(1, _CHUNK_ELEMENTS // max(1, rows * units))
        return [slice(i, min(n, i + step)) for i in range(0, n, step)]

    def per_example_flat(self, data: list, sl: slice) -> torch.Tensor:
        """Per-example gradients ``(n, P_m)`` in module parameter order."""
        canon = self.per_example(data, sl)
        flat = canon.new_zeros(canon.shape[0], self.numel)
        index = self.index_on(flat.device).reshape(-1)
        flat[:, index] = canon.reshape(canon.shape[0], -1)
        return flat

    def summed(self, data: list) -> torch.Tensor:
        """Canonical ``(R, U)`` gradient summed over examples (the batch gradient)."""
        out = None
        for sl in self.chunks(data):
            part = self.per_example(data, sl).sum(0)
            out = part if out is None else out + part
        return out

    def diag(self, data: list) -> torch.Tensor:
        """Canonical diagonal ``(R, U)``: sum over examples of squared gradients."""
        out = None
        for sl in self.chunks(data):
            part = self.per_example(data, sl).square().sum(0)
            out = part if out is None else out + part
        return out

    def unit(self, data: list) -> torch.Tensor:
        """Unit blocks ``(R, U, U)``: sum over examples of per-unit outer products."""
        out = None
        for sl in self.chunks(data):
            g = self.per_example(data, sl)
            part = torch.einsum("nru,nrv->ruv", g, g)
            out = part if out is None else out + part
        return out


def _batch(x: torch.Tensor, name: str, min_dim: int) -> None:
    if x.dim() < min_dim:
        raise ValueError(
            f"module {name!r}: curvature needs a batch dimension; got input shape "
            f"{tuple(x.shape)}"
        )
    if x.shape[0] == 0:  # factors divide by the example count; nothing to estimate
        raise ValueError(
            f"module {name!r}: the batch is empty (input shape {tuple(x.shape)}); "
            "a curvature estimate needs at least one example"
        )
