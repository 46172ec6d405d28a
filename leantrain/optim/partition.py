r"""Automatic block period for Gefen's shared second moment, from the first gradient.

Gefen stores one fp32 second moment and one fp32 momentum absmax per block of ``p``
contiguous elements of the row-major flattened parameter: 8 bytes per block on top of
the 1 byte (8-bit) or 0.5 byte (4-bit) per element of momentum codes. A good ``p``
groups elements whose :math:`g^2` has the same scale, and is large enough that the
8 bytes per block cost little.

**What the authors' rule gets wrong** (gefen 1.2.3, see ANCHORS.md): it only tries
divisors of ``n`` and only accepts an interior local maximum of its score, so 1-D
tensors and prime sizes fall to ``p = 1`` (a second moment per element, ~5 B/param),
structure at the coarsest level (fused qkv: 3 blocks of rows; 8-row heads) is never
a local maximum and is missed, and periods need not respect rows (a 10x512 head got
``p = 40``).

**Our rule.**

1. *Memory floor.* ``p >= floor(n) = min(n, max(min_block, min(2 sqrt(n),
   max_block / 4)))``: at most :math:`\sqrt{n}/2` blocks, so the per-block bytes cost
   at most :math:`4/\sqrt{n}` B/param (3% for a 128x128 matrix, 0.8% at 512x512,
   0.2% from 1024x4096 up). Small tensors (biases, LayerNorm, ``n <= min_block``) are
   one block. Never per-element.
2. *Aligned candidates.* For a tensor with last dimension ``d > 1`` and ``R = n / d``
   rows: whole-row periods ``d*m`` (``m`` a divisor of ``R`` or a power of two; the
   last block may be shorter) and sub-row periods that divide ``d``. For 1-D tensors:
   powers of two and divisors of ``n``, and ``n`` itself. All candidates lie in
   ``[floor, max(max_block, floor)]`` (if none does, the smallest aligned period
   above the floor).
3. *Score.* With :math:`r = \log(g^2 + 10^{-8}\,\overline{g^2})` (zeros sit at a fixed
   distance below the typical level, so zero rows are structure), the score of ``p``
   is the share of the variance of ``r`` explained by its blocks, corrected for the
   share that block means of unstructured noise would explain (the
   :math:`\omega^2` effect size): :math:`E(p) = (SS_b - (n_b - 1) MS_w) / SS_t`.
   Blocks of a period refine those of its multiples, so the finest candidates explain
   the most; :math:`E` is computed from per-unit float64 sums (a unit is the gcd of
   the candidates), never from pairs of elements.
4. *Choice.* The largest candidate with :math:`E(p) \ge E_{\max} - \max(0.1
   E_{\max}, 0.01)`: it keeps (almost) all of the structure that the best period
   sees. Unstructured gradients (iid, or column scales, which no contiguous partition
   can separate) get the largest candidate; row scales get rows; fused qkv gets its
   three thirds; 8-row heads get 8 rows; an embedding with zero rows gets rows.

The decision uses the shape and the values of the (global) gradient only, never names
or architecture metadata, and is deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "candidate_periods",
    "choose_period",
    "describe_partition",
    "period_floor",
    "score_periods",
    "state_nbytes",
]

# Candidate within this share of the best explained variance (relative / absolute)
# is considered to keep the structure.
REL_TOL = 0.1
ABS_TOL = 0.01
# Elements per chunk when reducing the gradient to per-unit sums.
CHUNK_ELEMENTS = 1 << 20


def _check_block(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def period_floor(n: int, min_block: int, max_block: int) -> int:
    """Smallest period allowed for ``n`` elements (see the module docstring)."""
    root = math.ceil(2.0 * math.sqrt(n))
    return min(n, max(min_block, min(root, max_block // 4)))


def _divisors(m: int) -> list[int]:
    small = np.arange(1, math.isqrt(m) + 1)
    small = small[m % small == 0]
    return sorted({int(v) for v in small} | {m // int(v) for v in small})


def _powers_of_two(low: int, high: int) -> list[int]:
    return [1 << e for e in range(max(0, (low - 1).bit_length()), high.bit_length())]


def candidate_periods(
    shape: tuple[int, ...], *, min_block: int = 256, max_block: int = 16384
) -> list[int]:
    """Aligned candidate periods for a tensor of this shape, ascending."""
    n = math.prod(shape)
    floor = period_floor(n, min_block, max_block)
    cap = max(max_block, floor)
    d = shape[-1] if len(shape) >= 2 else 1
    if d > 1:
        rows = n // d
        mults = set(_divisors(rows)) | set(_powers_of_two(1, rows))
        aligned = {d * m for m in mults} | set(_divisors(d))
    else:
        aligned = set(_divisors(n)) | set(_powers_of_two(floor, cap))
    aligned.add(n)
    cands = sorted(p for p in aligned if floor <= p <= min(cap, n))
    if not cands:
        cands = [min(p for p in aligned if floor <= p <= n)]
    return cands


def _unit_sums(flat: Tensor, unit: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-unit sum of r, sum of r^2 and count (float64), r = log(g^2 + tiny)."""
    n = flat.numel()
    mean_sq = float(torch.linalg.vector_norm(flat.float())) ** 2 / n
    if not math.isfinite(mean_sq):
        raise ValueError("the gradient holds NaN or infinite values")
    tiny = max(1e-8 * mean_sq, 1e-38)
    # Centre r on log(mean g^2) so that fp32 per-unit sums lose nothing that matters
    # (values are O(1..20)); units are then accumulated in float64.
    centre = math.log(mean_sq + tiny)
    n_units = -(-n // unit)
    s1 = np.empty(n_units)
    s2 = np.empty(n_units)
    step = max(1, CHUNK_ELEMENTS // unit) * unit
    for start in range(0, n, step):
        piece = flat[start : start + step].float()
        r = piece.square().add_(tiny).log_().sub_(centre)
        full = r.numel() // unit
        u0 = start // unit
        rows = r[: full * unit].view(full, unit)
        s1[u0 : u0 + full] = rows.sum(1).double().cpu().numpy()
        s2[u0 : u0 + full] = rows.square().sum(1).double().cpu().numpy()
        if r.numel() > full * unit:  # the last, shorter unit
            tail = r[full * unit :].double()
            s1[u0 + full] = float(tail.sum())
            s2[u0 + full] = float(tail.square().sum())
    counts = np.full(n_units, float(unit))
    counts[-1] = n - (n_units - 1) * unit
    return s1, s2, counts


def score_periods(g: Tensor, periods: list[int]) -> dict[int, float]:
    r"""Noise-corrected share of the variance of :math:`\log g^2` explained by the
    blocks of each period (:math:`\omega^2`; 0 for one block or a constant ``r``).
    """
    flat = g.detach().reshape(-1)  # stays on its device; only unit sums move
    n = flat.numel()
    inner = [p for p in periods if p < n]
    if not inner:
        return {p: 0.0 for p in periods}
    unit = math.gcd(*inner)
    s1, s2, cnt = _unit_sums(flat, unit)
    return scores_from_sums(s1, s2, cnt, n, unit, periods)


def scores_from_sums(
    s1: np.ndarray, s2: np.ndarray, counts: np.ndarray, n: int, unit: int, periods
) -> dict[int, float]:
    r""":math:`\omega^2` of each period from per-unit sums of r and r^2 and the unit
    sizes (float64; units of ``unit`` elements, every period a multiple of it).
    Shared with the reducible twin, which gets the sums from integer statistics."""
    p1, p2, pc = (np.concatenate([[0.0], np.cumsum(a)]) for a in (s1, s2, counts))
    total_ss = p2[-1] - p1[-1] ** 2 / n
    scores = {}
    for p in periods:
        if p >= n or total_ss <= 1e-12 * max(p2[-1], 1e-300):
            scores[p] = 0.0
            continue
        edges = np.append(np.arange(0, s1.size, p // unit), s1.size)
        b1, bc = np.diff(p1[edges]), np.diff(pc[edges])
        between = float(np.sum(b1 * b1 / bc) - p1[-1] ** 2 / n)
        nb = b1.size
        within_ms = max(total_ss - between, 0.0) / (n - nb)
        scores[p] = (between - (nb - 1) * within_ms) / total_ss
    return scores


def choose_period(g: Tensor, *, min_block: int = 256, max_block: int = 16384) -> int:
    """Block period ``p`` for one parameter from its first (global) gradient.

    See the module docstring for the rule. ``p`` need not divide ``g.numel()`` (the
    last block is then shorter).

    Args:
        g: the gradient, any shape, floating point (the global tensor under FSDP).
        min_block: smallest period for tensors larger than it.
        max_block: largest period preferred (rows longer than it are cut only at
            divisors of the row).

    Returns:
        ``p`` with ``1 <= p <= g.numel()`` (``p = n`` means one block).

    Raises:
        TypeError: ``g`` is not a floating-point tensor, or a bound is not an int.
        ValueError: a bound is < 1, ``max_block < min_block``, or ``g`` holds NaN/inf.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> g = torch.randn(64, 256) * torch.exp(2 * torch.randn(64, 1))  # row scales
        >>> choose_period(g)  # one block per row
        256
        >>> choose_period(torch.randn(64, 256))  # no structure: one block
        16384
    """
    if not isinstance(g, Tensor) or not g.is_floating_point():
        got = f"{g.dtype} tensor" if isinstance(g, Tensor) else type(g).__name__
        raise TypeError(f"g must be a floating-point tensor, got {got}")
    min_block = _check_block("min_block", min_block)
    max_block = _check_block("max_block", max_block)
    if max_block < min_block:
        raise ValueError(f"max_block ({max_block}) must be >= min_block ({min_block})")
    n = g.numel()
    if n <= 1:
        return 1
    if not math.isfinite(float(torch.linalg.vector_norm(g.detach().float()))):
        raise ValueError("g holds NaN or infinite values; cannot choose a period")
    cands = candidate_periods(tuple(g.shape), min_block=min_block, max_block=max_block)
    if len(cands) == 1:
        return cands[0]
    scores = score_periods(g, cands)
    best = max(scores.values())
    keep = best - max(REL_TOL * best, ABS_TOL)
    return max(p for p in cands if scores[p] >= keep)


def state_nbytes(n: int, period: int, momentum_bits: int | None = 8) -> int:
    """Gefen state bytes for ``n`` elements at this period (codebook not included):
    codes, one fp32 absmax per quantization block (``period``, or 256 when it is 1)
    and one fp32 second moment per block. ``momentum_bits=None``: fp32 momentum."""
    nb = -(-n // period)
    if momentum_bits is None:
        return 4 * n + 4 * nb
    if momentum_bits not in (4, 8):
        raise ValueError(f"momentum_bits must be 4, 8 or None, got {momentum_bits!r}")
    codes = n if momentum_bits == 8 else -(-n // 2)
    qblock = 256 if period == 1 else period
    return codes + 4 * -(-n // qblock) + 4 * nb


def describe_partition(
    named_grads: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]],
    *,
    momentum_bits: int | None = 8,
    **choose_kwargs: int,
) -> list[dict]:
    """One row per tensor: ``name``, ``shape``, ``numel``, ``period``, ``n_blocks``,
    ``bytes_per_param`` (Gefen state, :func:`state_nbytes`), for a report.

    The shared codebook (``4 * 2**momentum_bits`` bytes) is not in any row; add it
    once when totalling.

    Example:
        >>> rows = describe_partition({"w": torch.randn(64, 256), "b": torch.randn(64)})
        >>> [(r["name"], r["period"], r["n_blocks"]) for r in rows]
        [('w', 16384, 1), ('b', 64, 1)]
    """
    items = named_grads.items() if isinstance(named_grads, Mapping) else named_grads
    rows = []
    for name, grad in items:
        n = grad.numel()
        period = choose_period(grad, **choose_kwargs)
        rows.append(
            {
                "name": name,
                "shape": tuple(grad.shape),
                "numel": n,
                "period": period,
                "n_blocks": -(-n // period),
                "bytes_per_param": state_nbytes(n, period, momentum_bits) / max(n, 1),
            }
        )
    return rows
