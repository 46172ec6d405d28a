r"""Curvature results in five representations: full, layer, kron, unit, diag.

A :class:`Curvature` is indexed like the flat vector of ``model.parameters()`` that
require grad (``P`` entries). Every representation keeps some blocks of the exact
``P x P`` matrix and is zero elsewhere:

==========  =======================================================================
``full``    the whole matrix
``layer``   one dense block per module (its own parameters, weight and bias)
``kron``    per module (per *site*: a row block of the weight with its own input),
            the block of ``[W, b]`` approximated by ``B ⊗ A`` (K-FAC); LayerNorm and
            BatchNorm have no Kronecker form and keep their exact unit blocks
``unit``    per output unit, the block of ``[weight row, bias entry]``
``diag``    the diagonal
==========  =======================================================================

Parameters of ignored modules get zero rows and columns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["Curvature", "KronFactor", "ModuleCurvature"]


@dataclass
class KronFactor:
    r"""One Kronecker-factored block ``B ⊗ A`` of a module.

    Attributes:
        A: input factor ``sum_{n,t} ã ã^T / N`` (``ã`` = input with a trailing 1 when
            the module has a bias), ``(J[+1], J[+1])``.
        B: output factor ``sum_{n,t,k} e e^T`` over the scaled output-gradients, i.e.
            ``sum ê ê^T / N`` with ``ê = sqrt(N) e``; ``(I, I)``.
        index: ``(I, J[+1])`` positions (in the module's flat parameters) of the
            canonical entries: row ``i`` is output unit ``i`` of this site, column
            ``j < J`` its weight on input ``j``, the last column its bias.


    Example:
        >>> index = torch.arange(6).reshape(3, 2)
        >>> f = KronFactor(torch.eye(2), 2 * torch.eye(3), index)
        >>> f.to_dense().shape
        torch.Size([6, 6])
        >>> torch.equal(f.mvp(torch.ones(3, 2)), 2 * torch.ones(3, 2))
        True
    """

    A: torch.Tensor
    B: torch.Tensor
    index: torch.Tensor

    def to_dense(self) -> torch.Tensor:
        """``B ⊗ A`` in canonical (row-major ``(i, j)``) order."""
        return torch.kron(self.B, self.A)

    def mvp(self, v: torch.Tensor) -> torch.Tensor:
        """``(B ⊗ A) vec(V) = vec(B V A)`` for canonical ``V`` of shape ``index``."""
        return self.B @ v @ self.A


@dataclass
class ModuleCurvature:
    """The part of a :class:`Curvature` that belongs to one module.

    Attributes:
        name: qualified module name.
        module: the module.
        shape: the representation.
        index: global flat positions of the module's parameters (its own, in
            ``named_parameters(recurse=False)`` order).
        block: the dense ``(P_m, P_m)`` block ("layer", and "full" where it is the
            diagonal block of the full matrix).
        diagonal: the ``(P_m,)`` diagonal ("diag").
        units: unit blocks ``(R, U, U)`` ("unit"; "kron" for LayerNorm/BatchNorm).
        unit_index: ``(R, U)`` positions in the module's flat parameters of unit
            ``r``'s entries.
        kron: Kronecker factors ("kron"), one per site.

    Example:
        >>> from leantrain.precond.curv import curvature
        >>> model = nn.Sequential(nn.Linear(3, 2))
        >>> x, y = torch.randn(4, 3), torch.randn(4, 2)
        >>> part = curvature(model, "mse", x, y, kind="ggn", shape="kron")["0"]
        >>> part.A.shape, part.B.shape, part.index.tolist()
        (torch.Size([4, 4]), torch.Size([2, 2]), [0, 1, 2, 3, 4, 5, 6, 7])
    """

    name: str
    module: nn.Module
    shape: str
    index: torch.Tensor
    block: torch.Tensor | None = None
    diagonal: torch.Tensor | None = None
    units: torch.Tensor | None = None
    unit_index: torch.Tensor | None = None
    kron: list[KronFactor] = field(default_factory=list)

    @property
    def A(self) -> torch.Tensor:  # noqa: N802 - the standard K-FAC name
        """The input factor of a single-site Kronecker-factored module."""
        return self._single_factor().A

    @property
    def B(self) -> torch.Tensor:  # noqa: N802
        """The output factor of a single-site Kronecker-factored module."""
        return self._single_factor().B

    def _single_factor(self) -> KronFactor:
        if len(self.kron) != 1:
            raise ValueError(
                f"module {self.name!r} has {len(self.kron)} Kronecker factor pairs "
                f"(shape {self.shape!r}); read .kron for the list"
            )
        return self.kron[0]

    def diag(self) -> torch.Tensor:
        """The ``(P_m,)`` diagonal of the block, without forming the block."""
        if self.block is not None:
            return self.block.diagonal().clone()
        if self.diagonal is not None:
            return self.diagonal
        out = self._ref().new_zeros(self.index.numel())
        if self.units is not None:
            out[self.unit_index] = self.units.diagonal(dim1=-2, dim2=-1)
        for factor in self.kron:
            out[factor.index] = torch.outer(factor.B.diagonal(), factor.A.diagonal())
        return out

    def to_dense(self) -> torch.Tensor:
        """The module's ``(P_m, P_m)`` block as this representation keeps it."""
        if self.block is not None:
            return self.block
        p = self.index.numel()
        ref = self._ref()
        out = ref.new_zeros(p, p)
        if self.diagonal is not None:
            out += torch.diag(self.diagonal)
        if self.units is not None:
            idx = self.unit_index
            out[idx.unsqueeze(-1), idx.unsqueeze(-2)] = self.units
        for factor in self.kron:
            idx = factor.index.reshape(-1)
            out[idx.unsqueeze(-1), idx.unsqueeze(-2)] = factor.to_dense()
        return out

    def _ref(self) -> torch.Tensor:
        for t in (self.block, self.diagonal, self.units):
            if t is not None:
                return t
        return self.kron[0].A

    def mvp(self, v: torch.Tensor) -> torch.Tensor:
        """Multiply the module block with ``v`` of shape ``(P_m,)``."""
        if self.block is not None:
            return self.block @ v
        out = torch.zeros_like(v)
        if self.diagonal is not None:
            out += self.diagonal * v
        if self.units is not None:
            idx = self.unit_index
            out[idx] += torch.einsum("ruv,rv->ru", self.units, v[idx])
        for factor in self.kron:
            out[factor.index] += factor.mvp(v[factor.index])
        return out


class Curvature:
    """A curvature matrix over the parameters of a model, in one representation.

    Built by :func:`~leantrain.precond.curv.curvature`. Indexing follows the flat
    vector of ``model.parameters()`` that require grad.

    Args:
        kind: the curvature kind.
        shape: the representation.
        params: parameters that require grad, in ``model.parameters()`` order.
        modules: per-module parts, by qualified name.
        full: the ``(P, P)`` matrix for shape ``"full"``.

    Example:
        >>> from leantrain.precond.curv import curvature
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
        >>> c = curvature(model, nn.CrossEntropyLoss(), x, y, kind="ggn", shape="diag")
        >>> c.to_dense().shape
        torch.Size([26, 26])
        >>> v = [torch.ones_like(p) for p in model.parameters()]
        >>> [t.shape for t in c @ v] == [p.shape for p in model.parameters()]
        True
    """

    def __init__(
        self,
        kind: str,
        shape: str,
        params: Sequence[nn.Parameter],
        modules: dict[str, ModuleCurvature],
        full: torch.Tensor | None = None,
    ) -> None:
        self.kind = kind
        self.shape = shape
        self.params = list(params)
        self.numel = sum(p.numel() for p in self.params)
        self.modules = modules
        self.full = full

    def __getitem__(self, name: str) -> ModuleCurvature:
        if name not in self.modules:
            raise KeyError(
                f"no curvature for module {name!r}; modules: {sorted(self.modules)}"
            )
        return self.modules[name]

    def __repr__(self) -> str:
        return (
            f"Curvature(kind={self.kind!r}, shape={self.shape!r}, P={self.numel}, "
            f"modules={len(self.modules)})"
        )

    def _dtype_device(self) -> tuple[torch.dtype, torch.device]:
        p = self.params[0] if self.params else torch.zeros(())
        return p.dtype, p.device

    def to_dense(self) -> torch.Tensor:
        """The ``(P, P)`` matrix, zero outside the blocks this representation keeps."""
        if self.full is not None:
            return self.full
        dtype, device = self._dtype_device()
        out = torch.zeros(self.numel, self.numel, dtype=dtype, device=device)
        for part in self.modules.values():
            idx = part.index
            out[idx.unsqueeze(-1), idx.unsqueeze(-2)] = part.to_dense().to(dtype)
        return out

    def diagonal(self) -> torch.Tensor:
        """The diagonal of :meth:`to_dense` (cheap for every representation)."""
        if self.full is not None:
            return self.full.diagonal().clone()
        dtype, device = self._dtype_device()
        out = torch.zeros(self.numel, dtype=dtype, device=device)
        for part in self.modules.values():
            out[part.index] = part.diag().to(dtype)
        return out

    def trace(self) -> float:
        """The trace of :meth:`to_dense`."""
        return float(self.diagonal().sum())

    def _flatten(
        self, v: torch.Tensor | Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, bool]:
        if isinstance(v, torch.Tensor):
            if v.dim() != 1 or v.numel() != self.numel:
                raise ValueError(
                    f"flat vector must have shape ({self.numel},), got {tuple(v.shape)}"
                )
            return v, True
        if not isinstance(v, (list, tuple)):
            raise TypeError(
                "mvp expects a flat tensor or a list of tensors shaped like the "
                f"parameters, got {type(v).__name__}"
            )
        if len(v) != len(self.params) or any(
            tuple(t.shape) != tuple(p.shape)
            for t, p in zip(v, self.params, strict=True)
        ):
            shapes = [tuple(p.shape) for p in self.params]
            raise ValueError(
                f"list of tensors must match the parameter shapes {shapes}, got "
                f"{[tuple(t.shape) for t in v]}"
            )
        return torch.cat([t.reshape(-1) for t in v]), False

    def mvp(
        self, v: torch.Tensor | Sequence[torch.Tensor]
    ) -> torch.Tensor | list[torch.Tensor]:
        """Matrix-vector product with a flat ``(P,)`` tensor or a parameter-shaped list.

        Returns the same form as the input.
        """
        flat, is_flat = self._flatten(v)
        if self.full is not None:
            out = self.full @ flat.to(self.full.dtype)
        else:
            out = torch.zeros_like(flat)
            for part in self.modules.values():
                out[part.index] = part.mvp(flat[part.index]).to(out.dtype)
        if is_flat:
            return out
        pieces, start = [], 0
        for p in self.params:
            pieces.append(out[start : start + p.numel()].reshape(p.shape))
            start += p.numel()
        return pieces

    __matmul__ = mvp
