r"""Kronecker factors of one batch, inverted through the batch's Gram matrix.

A K-FAC factor computed from a single batch is a scaled Gram matrix of rows:
``A = s Z^T Z`` with ``Z`` the ``P`` layer inputs (a trailing 1 for the bias, one row
per example and position, ``s = 1/N``) and ``B = Z^T Z`` with ``Z`` the
back-propagated output-gradients of every Fisher pass. When there are fewer rows
than the factor is wide (``P < d``: a 128-example batch through a 256-wide layer)
its damped inverse never needs the ``d x d`` matrix (Woodbury):

.. math::

   (s Z^\top Z + \lambda I)^{-1} = \tfrac{1}{\lambda}\bigl(I - Z^\top
       (c I + Z Z^\top)^{-1} Z\bigr), \qquad c = \lambda / s,

   Z\,(s Z^\top Z + \lambda I)^{-1} = \tfrac{1}{s}\,(c I + Z Z^\top)^{-1} Z.

One ``P x P`` Gram product and Cholesky replace the ``d x d`` factor product and
its Cholesky, and each apply is two products with ``Z`` and a ``P x P`` solve
(:class:`GramInverse`). K-FAC uses it when every factor replaces the last
(``ema_decay=None``) and the preconditioner is rebuilt every step: a running
average or a preconditioner reused on later batches is full rank. A factor with at
least as many rows as columns is formed and Cholesky-factored as usual
(:class:`CholeskyInverse`); both expose the same ``right`` / ``left`` products, so
the apply does not care which one a side got.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from leantrain.precond.curv import damped_cholesky
from leantrain.precond.curv.linalg import cholesky_padding

__all__ = [
    "CholeskyInverse",
    "GramInverse",
    "LowRankFactor",
    "as_dense",
    "factor_inverse",
    "right_solve",
    "trace_mean",
]


def right_solve(m: Tensor, lower: Tensor) -> Tensor:
    """``m (L L^T)^{-1}`` by two triangular solves on the rows of ``m``, in the wider
    of the two dtypes (LAPACK has no half precision: a bf16 gradient is solved
    against its float32 factor and cast back)."""
    dtype = torch.promote_types(m.dtype, lower.dtype)
    lower, rows = lower.to(dtype), m.to(dtype)
    z = torch.linalg.solve_triangular(lower.mT, rows, upper=True, left=False)
    return torch.linalg.solve_triangular(lower, z, upper=False, left=False).to(m.dtype)


@dataclass
class LowRankFactor:
    """The factor ``scale * rows^T rows`` kept as its ``(P, d)`` rows."""

    rows: Tensor
    scale: float

    @property
    def shape(self) -> torch.Size:
        """``(d, d)``, as the dense factor's."""
        d = self.rows.shape[-1]
        return torch.Size((d, d))

    def dense(self) -> Tensor:
        """The ``(d, d)`` factor itself."""
        return (self.rows.T @ self.rows).mul_(self.scale)

    def trace_mean(self) -> float:
        """``tr(F) / d`` without forming ``F``."""
        flat = self.rows.reshape(-1)
        return float(torch.dot(flat, flat)) * self.scale / self.rows.shape[-1]


class GramInverse:
    """``(s Z^T Z + λ I)^{-1}`` through the Cholesky factor of ``c I + Z Z^T``.

    Args:
        factor: the low-rank factor (``P`` rows of width ``d``).
        damping: ``λ > 0``.
    """

    def __init__(self, factor: LowRankFactor, damping: float) -> None:
        self.n_rows = len(factor.rows)
        self.scale = factor.scale
        self.damping = damping
        rows = _padded(factor.rows)
        # In the rows' dtype first. If the Gram matrix is numerically indefinite
        # there (damping tiny against the rows), the whole operator is rebuilt and
        # kept in float64: a float32 solve against that factor would return noise.
        for dtype in dict.fromkeys((rows.dtype, torch.float64)):
            self.rows = rows.to(dtype)
            gram = self.rows @ self.rows.T
            gram.diagonal().add_(damping / self.scale)
            self.cholesky, info = torch.linalg.cholesky_ex(gram)
            if not bool(info):
                return
        raise torch.linalg.LinAlgError(
            f"c I + Z Z^T is not positive definite even in float64 (damping "
            f"{damping}); increase the damping"
        )

    def right(self, m: Tensor) -> Tensor:
        """``m F^{-1}`` for ``m`` of shape ``(k, d)``."""
        z, m_ = self.rows, m.to(self.rows.dtype)
        w = torch.cholesky_solve(z @ m_.T, self.cholesky)  # (P, k)
        inv = 1.0 / self.damping
        return torch.addmm(m_, w.T, z, beta=inv, alpha=-inv).to(m.dtype)

    def left(self, m: Tensor) -> Tensor:
        """``F^{-1} m`` for ``m`` of shape ``(d, k)``."""
        z, m_ = self.rows, m.to(self.rows.dtype)
        w = torch.cholesky_solve(z @ m_, self.cholesky)  # (P, k)
        inv = 1.0 / self.damping
        return torch.addmm(m_, z.T, w, beta=inv, alpha=-inv).to(m.dtype)

    def rows_times_inverse(self) -> Tensor:
        """``Z F^{-1} = (c I + Z Z^T)^{-1} Z / s``: no subtraction, one solve."""
        out = torch.cholesky_solve(self.rows, self.cholesky).mul_(1.0 / self.scale)
        return out[: self.n_rows]


def _padded(rows: Tensor) -> Tensor:
    """``rows`` with zero rows appended where the Gram matrix's size would hit
    oneMKL's slow Cholesky sizes (``curv.linalg.cholesky_padding``): zero rows leave
    ``Z^T Z``, and every product here, unchanged."""
    pad = cholesky_padding(len(rows), rows.device)
    if not pad:
        return rows
    return torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])


class CholeskyInverse:
    """``(F + λ I)^{-1}`` of a dense factor, applied by triangular solves."""

    def __init__(self, matrix: Tensor, damping: float) -> None:
        self.cholesky = damped_cholesky(matrix, damping)

    def right(self, m: Tensor) -> Tensor:
        """``m (F + λ I)^{-1}`` for ``m`` of shape ``(k, d)``."""
        return right_solve(m, self.cholesky)

    def left(self, m: Tensor) -> Tensor:
        """``(F + λ I)^{-1} m`` for ``m`` of shape ``(d, k)``."""
        return right_solve(m.mT, self.cholesky).mT


def trace_mean(factor: LowRankFactor | Tensor) -> float:
    """``tr(F) / d`` of a factor, low-rank (without forming it) or dense."""
    if isinstance(factor, LowRankFactor):
        return factor.trace_mean()
    return float(factor.diagonal(dim1=-2, dim2=-1).sum()) / factor.shape[-1]


def as_dense(factor: LowRankFactor | Tensor) -> Tensor:
    """A factor as its ``(d, d)`` tensor (formed if low-rank)."""
    return factor.dense() if isinstance(factor, LowRankFactor) else factor


def factor_inverse(
    factor: LowRankFactor | Tensor, damping: float
) -> GramInverse | CholeskyInverse:
    """The cheaper inverse of ``factor + damping I``: through the Gram matrix when
    the factor has fewer rows than columns, through its Cholesky factor otherwise."""
    if isinstance(factor, LowRankFactor):
        if factor.rows.shape[0] < factor.rows.shape[1]:
            return GramInverse(factor, damping)
        factor = factor.dense()
    return CholeskyInverse(factor, damping)
