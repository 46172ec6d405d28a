r"""Block quantization of a flat tensor with a sorted codebook, and exact lookup.

A tensor is flattened row-major and cut into blocks of ``period`` elements (the last
block is shorter when ``period`` does not divide ``n``). Each block is divided by its
absmax, so its values lie in [-1, 1] and the absmax element is exactly +-1, and each
value is replaced by the index of its nearest code (ties to the lower code).

:class:`NearestCode` finds that index without a binary search: a uniform grid over
[-1, 1] whose lookup table holds, per cell, the lowest code any value of the cell can
have; one comparison with the next code's threshold finishes the job (see the class
docstring for why one suffices). Everything here works in chunks of whole blocks, so
no full-size int64 (or fp32) temporary is ever created.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "NearestCode",
    "block_absmax",
    "block_mean_square",
    "dequantize_blockwise",
    "pack_nibbles",
    "quantize_blockwise",
    "unpack_nibbles",
]

# Elements per chunk: temporaries of a few MiB, few enough chunks that Python's
# per-chunk overhead is negligible.
CHUNK_ELEMENTS = 1 << 20


def _pieces(n: int, period: int, chunk: int) -> Iterator[tuple[int, int, int, int]]:
    """Split ``n`` elements into pieces ``(start, rows, cols, block)``.

    Elements ``[start, start + rows * cols)`` viewed as ``(rows, cols)`` have row r in
    block ``block + r``. Pieces hold whole blocks (about ``chunk`` elements) when
    ``period <= chunk``; a longer block is cut into single-row pieces of ``chunk``.
    """
    if period <= chunk:
        per = max(1, chunk // period)
        full = n // period
        for b0 in range(0, full, per):
            yield b0 * period, min(per, full - b0), period, b0
        if n > full * period:
            yield full * period, 1, n - full * period, full
    else:
        for b in range(-(-n // period)):
            stop = min(n, (b + 1) * period)
            for start in range(b * period, stop, chunk):
                yield start, 1, min(chunk, stop - start), b


def _check_flat(x: object, name: str = "x_flat") -> Tensor:
    if not isinstance(x, Tensor) or not x.is_floating_point():
        got = f"{x.dtype} tensor" if isinstance(x, Tensor) else type(x).__name__
        raise TypeError(f"{name} must be a floating-point tensor, got {got}")
    if x.dim() != 1:
        raise ValueError(f"{name} must be 1-D (flattened), got shape {tuple(x.shape)}")
    return x


def _check_period(period: object) -> int:
    if isinstance(period, bool) or not isinstance(period, int | np.integer):
        raise TypeError(f"period must be an int, got {type(period).__name__}")
    if period < 1:
        raise ValueError(f"period must be >= 1, got {period}")
    return int(period)


def block_absmax(x_flat: Tensor, period: int) -> Tensor:
    """Max of |x| over each block; fp32 ``[ceil(n / period)]``.

    Uses a min/max reduction on views, so it creates no full-size temporary.
    """
    x = _check_flat(x_flat)
    period = _check_period(period)
    n = x.numel()
    out = torch.empty(-(-n // period), dtype=torch.float32, device=x.device)
    full = n // period
    if full:
        lo, hi = torch.aminmax(x[: full * period].view(full, period), dim=1)
        out[:full] = torch.maximum(hi, lo.neg())
    if n > full * period:
        out[full] = x[full * period :].abs().max()
    return out


def block_mean_square(x_flat: Tensor, period: int) -> Tensor:
    """Mean of x^2 over each block's real elements (fp32 math); fp32 ``[nb]``.

    The shorter last block is divided by its own length.
    """
    x = _check_flat(x_flat)
    period = _check_period(period)
    n = x.numel()
    nb = -(-n // period)
    sums = torch.zeros(nb, dtype=torch.float32, device=x.device)
    for start, rows, cols, block in _pieces(n, period, CHUNK_ELEMENTS):
        piece = x[start : start + rows * cols].view(rows, cols).float()
        sums[block : block + rows] += piece.square().sum(dim=1)
    lengths = torch.full((nb,), float(period), dtype=torch.float32, device=x.device)
    if nb:
        lengths[-1] = n - (nb - 1) * period
    return sums.div_(lengths)


class NearestCode:
    r"""Exact nearest-code index for values in [-1, 1], by lookup table.

    A value u has code :math:`\#\{i : \theta_i \le u\}`, where :math:`\theta_i` is the
    smallest fp32 number strictly above the exact midpoint
    :math:`(c_i + c_{i+1})/2` (so ties go to the lower code, and fp32 comparisons are
    exact). The grid has ``G`` cells; u goes to cell
    ``clamp(floor(u * scale + offset), 0, G - 1)`` with ``scale = offset = G / 2``,
    computed in fp32. ``lut[cell]`` is the number of thresholds at or below
    ``cell_start - delta``.

    Why one comparison suffices: ``scale`` is a power of two, so ``u * scale`` is
    exact and only the addition rounds, by at most ``G * 2**-24`` cells, i.e.
    ``2**-23`` in u. So every u that lands in a cell lies within
    ``[cell_start - delta, cell_end + delta]`` with ``delta = 2**-22``. The grid is
    refined (``G`` doubled from ``4k``) until each such widened cell holds at most one
    threshold; then a value's code is ``lut[cell]`` or ``lut[cell] + 1``, and
    ``u >= thresholds[lut[cell]]`` decides which. Learned codebooks need ``G = 8k`` to
    ``32k``. If codes are so close that ``G = 2**18`` still puts two thresholds in a
    cell, ``steps`` (the most thresholds per widened cell) comparisons are made instead.

    Args:
        codebook: sorted, strictly increasing codes in [-1, 1]; 2 to 256 of them.

    Attributes:
        codebook: fp32 codes. thresholds: fp32 ``[k]``, last entry ``+inf``.
        lut: int64 ``[G]``. scale, offset: floats. grid: ``G``. steps: comparisons.

    Example:
        >>> nearest = NearestCode(torch.tensor([-1.0, -0.2, 0.1, 1.0]))
        >>> nearest(torch.tensor([-1.0, -0.45, 0.0, 0.55, 1.0])).tolist()
        [0, 1, 2, 3, 3]
    """

    DELTA = 2.0**-22
    MAX_GRID = 1 << 18

    def __init__(self, codebook: Tensor) -> None:
        if not isinstance(codebook, Tensor) or codebook.dim() != 1:
            raise TypeError(f"codebook must be a 1-D tensor, got {codebook!r}")
        k = codebook.numel()
        if not 2 <= k <= 256:
            raise ValueError(f"codebook must have 2 to 256 codes, got {k}")
        codes = codebook.detach().to("cpu", torch.float32)
        c64 = codes.double().numpy()
        if not np.all(np.isfinite(c64)) or np.any(np.abs(c64) > 1):
            raise ValueError(f"codebook values must lie in [-1, 1], got {c64.tolist()}")
        if np.any(np.diff(c64) <= 0):
            raise ValueError("codebook must be strictly increasing (distinct codes)")
        # Midpoints are exact in float64 (sums of two fp32 numbers in [-1, 1] with
        # exponents less than 29 apart); theta = smallest fp32 strictly above.
        mid = (c64[:-1] + c64[1:]) / 2
        theta = mid.astype(np.float32)
        below = theta.astype(np.float64) <= mid
        theta[below] = np.nextafter(theta[below], np.float32(np.inf))
        thresholds = np.append(theta, np.float32(np.inf))
        t64 = thresholds[:-1].astype(np.float64)
        grid = 1 << max(2, math.ceil(math.log2(4 * k)))
        while True:
            starts = -1.0 + 2.0 * np.arange(grid + 1) / grid
            low = np.searchsorted(t64, starts - self.DELTA, side="right")
            high = np.searchsorted(t64, starts + self.DELTA, side="right")
            steps = int((high[1:] - low[:-1]).max())  # thresholds per widened cell
            if steps <= 1 or grid >= self.MAX_GRID:
                break
            grid *= 2
        device = codebook.device
        self.codebook = codes.to(device)
        self.thresholds = torch.from_numpy(thresholds).to(device)
        self.lut = torch.from_numpy(low[:-1].astype(np.int64)).to(device)
        self.grid = grid
        self.scale = grid / 2.0
        self.offset = grid / 2.0
        self.steps = max(1, steps)

    def __call__(self, u: Tensor) -> Tensor:
        """Codes (uint8, same shape) of the values ``u`` (clamped to [-1, 1])."""
        if not isinstance(u, Tensor) or not u.is_floating_point():
            raise TypeError(f"u must be a floating-point tensor, got {u!r}")
        u = u.to(torch.float32)
        cell = (u * self.scale).add_(self.offset).floor_().clamp_(0, self.grid - 1)
        code = self.lut[cell.long()]
        for _ in range(self.steps):
            code += u >= self.thresholds[code]
        return code.to(torch.uint8)


def quantize_blockwise(
    x_flat: Tensor, period: int, nearest: NearestCode, *, check_finite: bool = True
) -> tuple[Tensor, Tensor]:
    """Codes (uint8 ``[n]``) and block absmax (fp32 ``[nb]``) of ``x_flat``.

    Each block is divided by its absmax (exact: the absmax element becomes +-1) and
    every value goes to its nearest code. An all-zero block keeps absmax 0 and gets
    the code nearest 0 everywhere. ``check_finite=False`` skips the NaN/inf check,
    a read of the values on the host (a wait for a CUDA device), for a caller
    whose values are finite by construction (an optimizer step after its
    non-finite gradient policy).

    Raises:
        ValueError: ``x_flat`` holds NaN or infinity (with ``check_finite``).
    """
    x = _check_flat(x_flat)
    period = _check_period(period)
    if not isinstance(nearest, NearestCode):
        raise TypeError(f"nearest must be a NearestCode, got {type(nearest).__name__}")
    absmax = block_absmax(x, period)
    if check_finite and not bool(torch.isfinite(absmax).all()):
        raise ValueError("x_flat holds NaN or infinite values; cannot quantize")
    scale = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    codes = torch.empty(x.numel(), dtype=torch.uint8, device=x.device)
    for start, rows, cols, block in _pieces(x.numel(), period, CHUNK_ELEMENTS):
        piece = x[start : start + rows * cols].view(rows, cols).float()
        u = piece / scale[block : block + rows, None]
        codes[start : start + rows * cols] = nearest(u).view(-1)
    return codes, absmax


def dequantize_blockwise(
    codes: Tensor, absmax: Tensor, period: int, codebook: Tensor
) -> Tensor:
    """``codebook[codes] * absmax`` per block; fp32 ``[n]``."""
    if not isinstance(codes, Tensor) or codes.dtype != torch.uint8 or codes.dim() != 1:
        raise TypeError(f"codes must be a 1-D uint8 tensor, got {codes!r}")
    period = _check_period(period)
    n = codes.numel()
    if absmax.shape != (-(-n // period),):
        raise ValueError(
            f"absmax must have ceil({n} / {period}) = {-(-n // period)} entries, "
            f"got shape {tuple(absmax.shape)}"
        )
    table = codebook.to(device=codes.device, dtype=torch.float32)
    scale = absmax.to(torch.float32)
    out = torch.empty(n, dtype=torch.float32, device=codes.device)
    for start, rows, cols, block in _pieces(n, period, CHUNK_ELEMENTS):
        piece = codes[start : start + rows * cols].view(rows, cols)
        values = table[piece.long()].mul_(scale[block : block + rows, None])
        out[start : start + rows * cols] = values.view(-1)
    return out


def pack_nibbles(codes: Tensor, *, check_range: bool = True) -> Tensor:
    """Pack 4-bit codes: element 2i in the low nibble of byte i, 2i+1 in the high.

    ``check_range=False`` skips the check that every code is at most 15, a read
    on the host (a wait for a CUDA device), for codes of a 16-code codebook.
    """
    if not isinstance(codes, Tensor) or codes.dtype != torch.uint8 or codes.dim() != 1:
        raise TypeError(f"codes must be a 1-D uint8 tensor, got {codes!r}")
    n = codes.numel()
    if check_range and n and int(codes.max()) > 15:
        raise ValueError(f"4-bit codes must be <= 15, got {int(codes.max())}")
    packed = codes[0::2].clone()
    packed[: n // 2] |= codes[1::2] << 4
    return packed


def unpack_nibbles(packed: Tensor, n: int) -> Tensor:
    """Inverse of :func:`pack_nibbles`: ``n`` uint8 codes from ``ceil(n / 2)`` bytes."""
    if not isinstance(packed, Tensor) or packed.dtype != torch.uint8:
        raise TypeError(f"packed must be a uint8 tensor, got {packed!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if packed.dim() != 1 or packed.numel() != -(-n // 2):
        raise ValueError(
            f"packed must be 1-D with ceil({n} / 2) = {-(-n // 2)} bytes, "
            f"got shape {tuple(packed.shape)}"
        )
    out = torch.empty(n, dtype=torch.uint8, device=packed.device)
    out[0::2] = packed & 15
    out[1::2] = packed[: n // 2] >> 4
    return out
