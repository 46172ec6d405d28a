"""Robust symmetric eigen-decomposition and damped inverses for curvature blocks.

Curvature factors are symmetric positive semi-definite and often badly conditioned.
LAPACK in fp32 sometimes fails to converge on them (``torch.linalg.eigh`` raises
``LinAlgError``); retrying in fp64 almost always succeeds. Inverses go through a
Cholesky factorization of the damped matrix, never through ``torch.inverse``: batched
``torch.inverse`` hangs on CPU oneMKL with two threads (see ANCHORS.md, ASDL section).
"""

from __future__ import annotations

import torch

__all__ = [
    "cholesky_ex",
    "cholesky_inverse",
    "damped_cholesky",
    "damped_inverse",
    "pi_damping",
    "pi_split",
    "robust_eigh",
    "symmetrize",
]


def symmetrize(matrix: torch.Tensor) -> torch.Tensor:
    """Return ``(M + M^T) / 2`` over the last two dimensions.

    Accumulated outer products drift from symmetry by rounding; eigh and Cholesky
    only read one triangle, so the drift would silently bias the result.
    """
    return 0.5 * (matrix + matrix.transpose(-1, -2))


# On CPU, LAPACK's (oneMKL's) Cholesky of an n x n matrix with n a multiple of 128
# runs 2-4x slower than of an (n + 8) x (n + 8) one (measured on Intel Xeon:
# 256: 463 vs 156 us, 512: 2.15 vs 0.82 ms, 1024: 14.3 vs 7.0 ms, one thread): the
# power-of-two-like row stride makes the columns it walks collide in the cache.
_PAD_MULTIPLE, _PAD = 128, 8


def cholesky_padding(n: int, device: torch.device) -> int:
    """Rows/columns of identity to append before factoring an ``n x n`` matrix on
    ``device``: 8 for CPU sizes that are multiples of 128 (see above), else 0."""
    if device.type != "cpu" or n < _PAD_MULTIPLE or n % _PAD_MULTIPLE:
        return 0
    return _PAD


def cholesky_ex(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.linalg.cholesky_ex`` (lower factor, info), faster on CPU for sizes
    that are multiples of 128: those are factored inside an identity-padded
    ``(n + 8) x (n + 8)`` matrix, whose factor is ``[[L, 0], [0, I]]`` with ``L``
    the factor of ``matrix`` (same arithmetic on the same entries; the padding adds
    only zeros). Batched; ``info`` as torch's (the pad never fails)."""
    n = matrix.shape[-1]
    pad = cholesky_padding(n, matrix.device)
    if not pad:
        return torch.linalg.cholesky_ex(matrix)
    padded = matrix.new_zeros(*matrix.shape[:-2], n + pad, n + pad)
    padded[..., :n, :n] = matrix
    padded[..., n:, n:].diagonal(dim1=-2, dim2=-1).fill_(1)
    factor, info = torch.linalg.cholesky_ex(padded)
    return factor[..., :n, :n].contiguous(), info


def damped_cholesky(matrix: torch.Tensor, damping: float) -> torch.Tensor:
    """Lower Cholesky factor of ``M + damping I`` (batched) in ``M``'s dtype,
    factored in float64 when ``M``'s own precision makes the damped matrix
    numerically indefinite.

    Raises:
        torch.linalg.LinAlgError: not positive definite even in float64.
    """
    damped = matrix.clone()
    damped.diagonal(dim1=-2, dim2=-1).add_(damping)
    factor, info = cholesky_ex(damped)
    if not bool((info != 0).any()):
        return factor
    wide = symmetrize(matrix.double())
    wide.diagonal(dim1=-2, dim2=-1).add_(damping)
    factor, info = cholesky_ex(wide)
    if bool((info != 0).any()):
        raise torch.linalg.LinAlgError(
            f"matrix + {damping} * I is not positive definite even in float64; "
            "increase the damping"
        )
    return factor.to(matrix.dtype)


def _first_dtype(dtype: torch.dtype, compute_dtype: torch.dtype | None) -> torch.dtype:
    if compute_dtype is not None:
        if compute_dtype not in (torch.float32, torch.float64):
            raise ValueError(
                "compute_dtype must be torch.float32 or torch.float64, got "
                f"{compute_dtype}"
            )
        return compute_dtype
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_square(matrix: torch.Tensor, what: str) -> None:
    if not isinstance(matrix, torch.Tensor):
        raise TypeError(f"{what} expects a torch.Tensor, got {type(matrix).__name__}")
    if matrix.dim() < 2 or matrix.shape[-1] != matrix.shape[-2]:
        raise ValueError(
            f"{what} expects a (batch of) square matrix, got shape "
            f"{tuple(matrix.shape)}"
        )
    if not matrix.is_floating_point():
        raise TypeError(f"{what} expects a floating tensor, got dtype {matrix.dtype}")


def robust_eigh(
    matrix: torch.Tensor, *, compute_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Eigen-decomposition of a symmetric matrix, fp32 first, fp64 on failure.

    The matrix is symmetrized, decomposed in ``compute_dtype`` and, if LAPACK reports
    non-convergence (or returns non-finite values), decomposed again in float64.
    Results come back in the input dtype.

    Args:
        matrix: symmetric ``(..., n, n)`` tensor.
        compute_dtype: dtype of the first attempt; default float32, or float64 for
            float64 input (half-precision input is always upcast: LAPACK has none).

    Returns:
        ``(eigenvalues, eigenvectors)`` with eigenvalues ascending, as
        :func:`torch.linalg.eigh`.

    Raises:
        TypeError: ``matrix`` is not a floating tensor.
        ValueError: ``matrix`` is not square.
        torch.linalg.LinAlgError: the float64 retry failed too.

    Example:
        >>> m = torch.tensor([[2.0, 1.0], [1.0, 2.0]])
        >>> vals, vecs = robust_eigh(m)
        >>> torch.allclose(vals, torch.tensor([1.0, 3.0]))
        True
    """
    _check_square(matrix, "robust_eigh")
    out_dtype = matrix.dtype
    first = _first_dtype(out_dtype, compute_dtype)
    sym = symmetrize(matrix)
    try:
        vals, vecs = torch.linalg.eigh(sym.to(first))
    except torch.linalg.LinAlgError:
        vals, vecs = torch.linalg.eigh(sym.to(torch.float64))
    else:
        if not (torch.isfinite(vals).all() and torch.isfinite(vecs).all()):
            vals, vecs = torch.linalg.eigh(sym.to(torch.float64))
    return vals.to(out_dtype), vecs.to(out_dtype)


def cholesky_inverse(
    matrix: torch.Tensor,
    damping: float = 0.0,
    *,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    r"""Inverse of ``M + damping * I`` for symmetric positive (semi-)definite ``M``.

    Computed as ``cholesky_inverse(cholesky(M + \lambda I))`` in ``compute_dtype``;
    when the factorization fails (the damped matrix is numerically indefinite in that
    precision) it is retried in float64. Works on batches; ``torch.inverse`` is never
    called.

    Args:
        matrix: symmetric ``(..., n, n)`` tensor.
        damping: non-negative value added to the diagonal (Tikhonov damping).
        compute_dtype: dtype of the first attempt; default float32, or float64 for
            float64 input.

    Returns:
        The damped inverse, symmetric, in the input dtype.

    Raises:
        TypeError: ``matrix`` is not a floating tensor.
        ValueError: ``matrix`` is not square, or ``damping`` is negative or not finite.
        torch.linalg.LinAlgError: the damped matrix is not positive definite even in
            float64 (raise the damping).

    Example:
        >>> m = torch.tensor([[4.0, 0.0], [0.0, 1.0]])
        >>> inv = cholesky_inverse(m, damping=1.0)
        >>> torch.allclose(inv, torch.diag(torch.tensor([0.2, 0.5])))
        True
    """
    _check_square(matrix, "cholesky_inverse")
    damping = float(damping)
    if not damping >= 0.0 or damping == float("inf"):
        raise ValueError(f"damping must be finite and >= 0, got {damping}")
    out_dtype = matrix.dtype
    first = _first_dtype(out_dtype, compute_dtype)
    n = matrix.shape[-1]
    eye = torch.eye(n, dtype=torch.float64, device=matrix.device)
    sym = symmetrize(matrix)

    def attempt(dtype: torch.dtype) -> torch.Tensor | None:
        damped = sym.to(dtype) + damping * eye.to(dtype)
        factor, info = cholesky_ex(damped)
        if bool((info != 0).any()):
            return None
        return torch.cholesky_inverse(factor)

    result = attempt(first)
    if result is None and first != torch.float64:
        result = attempt(torch.float64)
    if result is None:
        raise torch.linalg.LinAlgError(
            f"cholesky_inverse: matrix + {damping} * I is not positive definite even "
            "in float64; increase the damping"
        )
    return symmetrize(result).to(out_dtype)


def damped_inverse(matrix: torch.Tensor, damping: float) -> torch.Tensor:
    """``(M + damping I)^{-1}`` for symmetric PSD ``M`` (batched), one Cholesky.

    The fast path of :func:`cholesky_inverse` (what K-FAC's refresh runs): factors the
    damped matrix in its own dtype without the symmetrizing copies (Cholesky reads
    one triangle), which costs ~40% less on a 256x256 factor; on failure (or a
    half-precision factor) it falls back to ``cholesky_inverse`` and its fp64 retry.
    """
    if matrix.dtype in (torch.float32, torch.float64):
        damped = matrix.clone()
        damped.diagonal(dim1=-2, dim2=-1).add_(damping)
        factor, info = cholesky_ex(damped)
        if not bool((info != 0).any()):
            # LAPACK returns the inverse column-major (strides (1, n)); every step
            # multiplies with it, and oneMKL's GEMM on such an operand ran a K-FAC
            # apply 1.65x slower (0.56 vs 0.34 ms on a 256-wide layer): one copy
            # per inversion buys row-major operands for all the steps that reuse it.
            return torch.cholesky_inverse(factor).contiguous()
    return cholesky_inverse(matrix, damping)


def pi_damping(a: torch.Tensor, b: torch.Tensor, damping: float) -> tuple[float, float]:
    r"""Split a damping ``\lambda`` between Kronecker factors (Martens & Grosse, 2015).

    ``(B + \lambda_B I) ⊗ (A + \lambda_A I)`` with :math:`\pi = \sqrt{(\mathrm{tr} A /
    \dim A) / (\mathrm{tr} B / \dim B)}`, :math:`\lambda_A = \pi \sqrt{\lambda}`,
    :math:`\lambda_B = \sqrt{\lambda} / \pi` approximates ``B ⊗ A + \lambda I`` while
    keeping both factors equally well conditioned. Falls back to ``\pi = 1`` when a
    trace is zero.

    Args:
        a: input factor ``A``.
        b: output factor ``B``.
        damping: ``\lambda >= 0``.

    Returns:
        ``(damping_a, damping_b)``.

    Example:
        >>> pi_damping(torch.eye(2) * 4.0, torch.eye(3), 1e-2)
        (0.2, 0.05)
    """
    mean_a = float(a.diagonal(dim1=-2, dim2=-1).sum()) / a.shape[-1]
    mean_b = float(b.diagonal(dim1=-2, dim2=-1).sum()) / b.shape[-1]
    return pi_split(mean_a, mean_b, damping)


def pi_split(mean_a: float, mean_b: float, damping: float) -> tuple[float, float]:
    r""":func:`pi_damping` from the factors' mean eigenvalues ``tr A / dim A`` and
    ``tr B / dim B`` (for factors that are never formed, e.g. low-rank ones)."""
    damping = float(damping)
    if not damping >= 0.0 or damping == float("inf"):
        raise ValueError(f"damping must be finite and >= 0, got {damping}")
    pi = (mean_a / mean_b) ** 0.5 if mean_a > 0 and mean_b > 0 else 1.0
    root = damping**0.5
    return root * pi, root / pi
