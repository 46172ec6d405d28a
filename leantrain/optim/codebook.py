r"""Exact optimal quantization codebook from a histogram of normalized gradients.

Gefen quantizes its momentum with one global codebook learned on the first gradient:
every block of the gradient is divided by its own absmax, the values in
:math:`[-1, 1]` are histogrammed into ``bins`` bins, and the codebook is the optimal
weighted 1-D k-means of the bin centres :math:`m_i` (counts :math:`c_i`), with the
first code pinned to -1 and the last to +1 (the block absmax element maps there, and
pinning stops the range from contracting).

**The problem.** Let :math:`x_0 < \dots < x_{B-1}` be the centres of the non-empty
bins. An optimal codebook assigns each centre to its nearest code, so the clusters
are contiguous runs. A solution is a list of boundaries
:math:`0 \le t_1 \le t_2 < t_3 < \dots < t_{k-1} \le B`: cluster 0 is
:math:`[0, t_1)` around -1, the middle clusters :math:`[t_j, t_{j+1})` are non-empty
and sit at their weighted mean, cluster :math:`k-1` is :math:`[t_{k-1}, B)` around +1.
The two pinned clusters may be empty (the codes -1 and +1 exist anyway). With prefix
sums :math:`S_0, S_1, S_2` of :math:`c, cx, cx^2` the cost of a middle run is
:math:`W(s, t) = \Delta S_2 - (\Delta S_1)^2 / \Delta S_0`, and its minimum over
boundaries is also the minimum over all codebooks of
:math:`\sum_i c_i \min_j (x_i - \text{code}_j)^2` (:func:`codebook_cost`).

**The dynamic program.** :math:`L_0(t)` is the cost of :math:`[0, t)` at -1 and
:math:`L_j(t) = \min_{s < t} L_{j-1}(s) + W(s, t)` for the middle layers
:math:`j = 1..k-2`; the answer is :math:`\min_t L_{k-2}(t) + R(t)` with :math:`R(t)`
the cost of :math:`[t, B)` at +1. :func:`learn_codebook_reference` evaluates it
literally, :math:`O(B^2 k)`.

**The fast solver.** :math:`W` satisfies the quadrangle (Monge) inequality, and so do
the pinned end costs seen as edges from a virtual source and to a virtual sink
(moving points from a run to the pinned cluster costs at most their squared distance
to -1, which bounds the SSE increase). Two consequences, both proved by the usual
path-exchange argument:

1. within a layer the optimal split is monotone: some optimum for row :math:`t` lies
   at or below any chosen optimum of row :math:`t+1`;
2. across layers (Knuth): some optimum of :math:`L_j(t)` lies at or above any chosen
   optimum of :math:`L_{j-1}(t)`.

So row :math:`t` of layer :math:`j` only needs :math:`s \in [o_{j-1}(t), o_j(t+1)]`, and
these ranges total :math:`O(B)` per layer once :math:`j` is moderate. The upper end
:math:`o_j(t+1)` is unknown when all rows are evaluated at once (numpy), so we guess it
from the previous layer, evaluate every row's window in one vectorized pass, then
verify the certificate ``window_end(t) >= o_j(t+1)`` for every row and extend only the
rows that fail; when every row passes, downward induction from the top row (which
searches its whole range) proves every row exact. Layers whose predicted windows are
too wide (the first few), or that are not certified within a bounded number of
rounds, use level-by-level divide and conquer instead, each level one vectorized pass
over all midpoints. Both paths are exact; the tests compare them with
the reference and with brute force over all partitions.

**The native solver** (``_kernels/codebook_dp.c``, used when the C library builds)
runs every layer by divide and conquer with the previous layer's split as a lower
bound, over the same float64 prefix sums and with the same tie rule: 4096 bins and
256 codes take a few tens of milliseconds. The solvers live in ``_codebook_dp.py``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from . import _native
from ._codebook_dp import _solve_fast, _solve_native, _solve_reference
from .quant import _pieces, block_absmax

__all__ = [
    "DP_SOLVERS",
    "bin_centres",
    "native_status",
    "codebook_cost",
    "histogram",
    "histogram_on_device",
    "learn_codebook",
    "learn_codebook_reference",
    "with_exact_zero",
]

# The dynamic program's three implementations (the slow oracle, numpy, the C
# kernel), named for benchmarks/codebook.py and the parity tests.
DP_SOLVERS = {
    "reference": _solve_reference,
    "fast": _solve_fast,
    "native": _solve_native,
}


def native_status() -> str:
    """Whether the native (C) library loaded, and why not when it did not."""
    return _native.status()


# Elements per histogram chunk: bounds the fp32/int64 temporaries to a few MiB.
CHUNK_ELEMENTS = 1 << 20


# --------------------------------------------------------------------------- histogram
def histogram(x: Tensor, period: int, bins: int = 4096) -> Tensor:
    r"""Counts of the block-normalized values of ``x`` in ``bins`` bins over [-1, 1].

    ``x`` is flattened row-major and cut into blocks of ``period`` elements (the last
    block may be shorter); each block is divided by its own absmax (an all-zero block
    contributes zeros). A value :math:`u` falls in bin
    :math:`\lfloor (u + 1)\, \text{bins} / 2 \rfloor`, clamped to ``[0, bins - 1]``.
    Work is done in chunks of whole blocks, so temporaries stay a few MiB.

    Args:
        x: a floating-point tensor of any shape (the first gradient of a parameter).
        period: block length, >= 1.
        bins: number of bins, >= 2.

    Returns:
        float64 counts, shape ``[bins]``; histograms of several tensors add up.

    Raises:
        TypeError: ``x`` is not a floating-point tensor.
        ValueError: bad ``period``/``bins``, or ``x`` holds NaN or infinity.
    """
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {_describe(x)}")
    _check_int("period", period, 1)
    _check_int("bins", bins, 2)
    counts, finite = histogram_on_device(x, period, bins)
    if not bool(finite):
        raise ValueError("x holds NaN or infinite values; cannot build a histogram")
    return counts


def histogram_on_device(
    x: Tensor, period: int, bins: int = 4096
) -> tuple[Tensor, Tensor]:
    """:func:`histogram` without its read on the host: the counts and a 0-dim bool
    "every value finite", both on ``x``'s device (the counts are not meaningful
    when it is False). Gefen's first step sums these over all its parameters and
    reads the sum and the flags back once (``_first_codebook``).

    ``period`` and ``bins`` are not checked: callers pass valid ints.
    """
    flat = x.detach().reshape(-1)
    counts = torch.zeros(bins, dtype=torch.float64, device=flat.device)
    if flat.numel() == 0:
        return counts, torch.ones((), dtype=torch.bool, device=flat.device)
    absmax = block_absmax(flat, period)
    finite = torch.isfinite(absmax).all()
    # An all-zero block divides by 1: its zeros stay zeros.
    scale = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    half = bins / 2.0
    one = torch.ones(1, dtype=torch.float64, device=flat.device)
    for start, rows, cols, block in _pieces(flat.numel(), period, CHUNK_ELEMENTS):
        piece = flat[start : start + rows * cols].view(rows, cols).float()
        u = piece / scale[block : block + rows, None]  # exact: the absmax gives +-1
        # NaN would make an undefined index; 0 keeps bincount in range until the
        # caller reads the flag and raises
        u = torch.nan_to_num_(u, nan=0.0)
        idx = u.add_(1.0).mul_(half).floor_().clamp_(0, bins - 1).long().view(-1)
        if flat.device.type == "cpu":
            counts += torch.bincount(idx, minlength=bins).to(torch.float64)
        else:  # bincount sizes its output from the largest index: a host read there
            counts.index_add_(0, idx, one.expand(idx.numel()))
    return counts, finite


def bin_centres(bins: int) -> np.ndarray:
    """Centres ``-1 + (i + 0.5) * 2 / bins`` of the histogram bins, float64."""
    return -1.0 + (np.arange(bins, dtype=np.float64) + 0.5) * (2.0 / bins)


# ---------------------------------------------------------------------- shared helpers
def _describe(value: object) -> str:
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r}"


def _check_int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {_describe(value)}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def _prepare(counts: Tensor, k: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Validate; return the non-empty bins' centres and counts (float64), and bins."""
    if not isinstance(counts, Tensor) or counts.dim() != 1:
        raise TypeError(f"counts must be a 1-D tensor, got {_describe(counts)}")
    if counts.numel() < 2:
        raise ValueError(f"counts needs at least 2 bins, got {counts.numel()}")
    _check_int("k", k, 2)
    c = counts.detach().to("cpu", torch.float64).numpy()
    if not np.all(np.isfinite(c)) or np.any(c < 0):
        raise ValueError("counts must be finite and non-negative")
    nonempty = np.flatnonzero(c > 0)
    return bin_centres(c.size)[nonempty], c[nonempty], c.size


def _codebook_from_bounds(bounds: list[int], x, c, k: int) -> Tensor:
    """Codes: -1, the weighted mean of each middle run [bounds[j], bounds[j+1]), +1."""
    codes = np.empty(k)
    codes[0], codes[-1] = -1.0, 1.0
    for j in range(1, k - 1):
        a, b = bounds[j], bounds[j + 1]
        codes[j] = np.dot(c[a:b], x[a:b]) / c[a:b].sum()
    return torch.from_numpy(codes).to(torch.float32)


def _partition_cost(bounds: list[int], x: np.ndarray, c: np.ndarray) -> float:
    """Cost of a partition evaluated directly (no prefix sums, so no cancellation):
    run 0 about -1, the last run about +1, the others about their weighted means."""
    k = len(bounds) - 1
    total = 0.0
    for j in range(k):
        xs, cs = x[bounds[j] : bounds[j + 1]], c[bounds[j] : bounds[j + 1]]
        if cs.size == 0:
            continue
        centre = -1.0 if j == 0 else 1.0 if j == k - 1 else np.dot(cs, xs) / cs.sum()
        total += float(np.dot(cs, (xs - centre) ** 2))
    return total


def _spread(codes: np.ndarray, k: int) -> np.ndarray:
    """Add points to a sorted array until it has k, always splitting the widest gap.

    Each gap of width w that receives e extra points is cut into e + 1 equal parts,
    and gaps are chosen greedily by their current part width, so the new codes are
    distinct whenever the float64 gaps allow it.
    """
    gaps = np.diff(codes)
    extra = np.zeros(gaps.size, dtype=np.int64)
    for _ in range(k - codes.size):
        extra[np.argmax(gaps / (extra + 1))] += 1
    pieces = [codes[:1]]
    for left, width, e in zip(codes[:-1], gaps, extra, strict=True):
        pieces.append(left + width * np.arange(1, e + 2) / (e + 1))
    return np.concatenate(pieces)


def _few_bins_codebook(x: np.ndarray, k: int) -> Tensor:
    """Zero-cost codebook when B <= k - 2: -1, every centre, +1, gaps filled."""
    return torch.from_numpy(_spread(np.concatenate([[-1.0], x, [1.0]]), k)).to(
        torch.float32
    )


# ------------------------------------------------------------------------ public API
def learn_codebook(counts: Tensor, k: int) -> Tensor:
    r"""The optimal k-code codebook for a histogram, ends pinned to -1 and +1.

    Minimizes :math:`\sum_i c_i \min_j (m_i - \text{code}_j)^2` over sorted codebooks
    with ``code[0] = -1`` and ``code[-1] = +1``, where :math:`m_i` are the bin centres
    (:func:`bin_centres`). Exact, by the monotone dynamic program described in the
    module docstring (4096 bins and 256 codes: a few tens of milliseconds in C,
    ``_kernels/codebook_dp.c``, when the native library builds; ~0.4 s in the
    numpy fallback; ~9 s for the plain O(B^2 k) program; see
    ``benchmarks/codebook.py``).

    When there are at most ``k - 2`` non-empty bins, every bin centre becomes a code
    (cost 0) and the remaining codes split the widest gaps of ``[-1, ..., +1]`` evenly,
    so the codes stay distinct; an all-zero histogram gives the uniform codebook
    ``linspace(-1, 1, k)``.

    Args:
        counts: 1-D non-negative histogram (e.g. from :func:`histogram`).
        k: number of codes, >= 2 (256 for 8-bit, 16 for 4-bit momentum).

    Returns:
        fp32 tensor ``[k]``, sorted ascending, ``[0] == -1``, ``[-1] == +1``.

    Raises:
        TypeError: ``counts`` is not a 1-D tensor or ``k`` is not an int.
        ValueError: negative or non-finite counts, fewer than 2 bins, ``k < 2``.

    Example:
        >>> import torch
        >>> g = torch.randn(64, 256)
        >>> cb = learn_codebook(histogram(g, 256), 16)
        >>> cb.shape, float(cb[0]), float(cb[-1])
        (torch.Size([16]), -1.0, 1.0)
    """
    x, c, _ = _prepare(counts, k)
    if x.size <= k - 2:
        return _few_bins_codebook(x, k)
    solved = _solve_native(x, c, k)
    _, bounds = solved if solved is not None else _solve_fast(x, c, k)
    return _codebook_from_bounds(bounds, x, c, k)


def learn_codebook_reference(counts: Tensor, k: int) -> Tensor:
    """:func:`learn_codebook` by the plain O(B^2 k) dynamic program (tests only)."""
    x, c, _ = _prepare(counts, k)
    if x.size <= k - 2:
        return _few_bins_codebook(x, k)
    _, bounds = _solve_reference(x, c, k)
    return _codebook_from_bounds(bounds, x, c, k)


def codebook_cost(counts: Tensor, codebook: Tensor) -> float:
    r"""Weighted squared error :math:`\sum_i c_i \min_j (m_i - \text{code}_j)^2`.

    Every bin centre goes to its nearest code (its run, for an optimal codebook), so
    for :func:`learn_codebook`'s output this is the dynamic program's optimal value.
    """
    if not isinstance(codebook, Tensor) or codebook.dim() != 1 or codebook.numel() < 1:
        raise TypeError(f"codebook must be a non-empty 1-D tensor, got {codebook!r}")
    x, c, _ = _prepare(counts, 2)
    codes = np.sort(codebook.detach().to("cpu", torch.float64).numpy())
    hi = np.clip(np.searchsorted(codes, x), 0, codes.size - 1)
    lo = np.clip(hi - 1, 0, codes.size - 1)
    d2 = np.minimum((x - codes[lo]) ** 2, (x - codes[hi]) ** 2)
    return float(np.dot(c, d2))


def with_exact_zero(codebook: Tensor) -> Tensor:
    """``codebook`` with its code nearest 0 moved to exactly 0 (a copy).

    Gefen stores a momentum component that is exactly 0 (a weight whose gradient has
    always been 0: an input that is never lit, a dead unit) with the code nearest 0.
    Unless that code *is* 0, the stored value never decays: it stays about that
    code times the block absmax for ever. With blocks that residue is harmless
    (measured: no change in quality), but a factored or per-element second moment
    divides it by that weight's own tiny statistic (docs/gefen.md, "An exact 0
    code"), so Gefen's learned codebooks always get an exact 0, as NF4 has. Order is
    kept: no other code lies between the moved code and 0.
    """
    out = codebook.clone()
    out[int(torch.argmin(out.abs()))] = 0.0
    return out
