r"""The automatic period rule computed from *reducible* integer statistics.

``partition.choose_period`` needs the whole gradient: a mean of :math:`g^2` and
per-unit sums of :math:`r = \log(g^2 + \text{tiny}) - \text{centre}` and of
:math:`r^2`. Under FSDP2 each rank holds a contiguous range of the flattened tensor
(whole rows of a dim-0 shard), and a unit may straddle two ranks. Float sums of the
pieces differ from one float sum of the whole in the last bits, and the period is a
discrete choice, so "the same rule on every rank" must mean *the same numbers*.

This module makes every statistic an **integer sum**, which no reduction order and no
cut into pieces can change:

* :math:`\sum g^2` is accumulated exactly: each fp32 value is ``M * 2**(e - 24)``
  with a 24-bit integer ``M``; ``M**2`` is split into a high and a low 24-bit half and
  summed per exponent in int64 (exact for up to :math:`2^{39}` elements), and the
  buckets are combined once in Python integers and rounded once to float.
* :math:`r` is rounded to a fixed-point grid of :math:`2^{-S}` (``S`` = 16 for the
  default block sizes; :math:`r` lies within about :math:`\pm 30`), so per-unit sums
  of ``round(r * 2**S)`` and of its square are int64 and exact.

A rank computes its pieces (:func:`square_sum_parts`, :func:`unit_sums`), the pieces
are summed across ranks (an ``all_reduce`` SUM of small int64 arrays: 556 values,
and two per unit, a unit being at least one period floor), and :func:`choose_period`
scores the periods from the summed integers with ``partition``'s own formula. A
single process is the one-rank case of the same code, so the period is identical for
every world size and every sharding. The rounding of :math:`r` changes each score by
at most :math:`2^{-S}` relative to ``partition.choose_period``; the tests check that
the two rules pick the same period on the structured and random gradients of
``tests/optim/test_partition.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction

import numpy as np
import torch
from torch import Tensor

from .partition import ABS_TOL, REL_TOL, candidate_periods, scores_from_sums

# fp32 exponents from frexp lie in [-148, 128]; one bucket each.
_EXP_LOW, _EXP_HIGH = -148, 128
N_BUCKETS = _EXP_HIGH - _EXP_LOW + 1
# |r| <= 2**R_BITS after clamping: r = log(g^2 + 1e-8 mean) - log(mean) >= -18.5 and
# <= log(n) < 64 for any tensor that fits in memory.
R_BITS = 6

Reduce = Callable[[Tensor], Tensor]


def _identity(x: Tensor) -> Tensor:
    return x


def square_sum_parts(flat: Tensor) -> Tensor:
    """Exact pieces of :math:`\\sum g^2` (fp32 values), int64 ``[2, N_BUCKETS]``.

    Row 0 sums the high 24 bits of ``M**2``, row 1 the low 24 bits, per exponent.
    Pieces of several ranges add up (integer addition) to the pieces of their union.
    """
    parts = torch.zeros(2, N_BUCKETS, dtype=torch.int64, device=flat.device)
    if flat.numel() == 0:
        return parts
    mantissa, exponent = torch.frexp(flat.float())
    m = (mantissa.abs() * (1 << 24)).to(torch.int64)  # exact 24-bit integer
    sq = m * m  # < 2**48, exact in int64
    index = (exponent.to(torch.int64) - _EXP_LOW).clamp_(0, N_BUCKETS - 1)
    parts[0].index_add_(0, index, sq >> 24)
    parts[1].index_add_(0, index, sq & ((1 << 24) - 1))
    return parts


def exact_square_sum(parts: Tensor | np.ndarray) -> float:
    """Correctly rounded :math:`\\sum g^2` from (reduced) :func:`square_sum_parts`
    (a tensor, or its values already read on the host)."""
    hi, lo = parts.cpu().tolist() if isinstance(parts, Tensor) else parts.tolist()
    total = Fraction(0)
    for k in range(N_BUCKETS):
        if hi[k] or lo[k]:
            e = k + _EXP_LOW
            # value = M**2 * 2**(2e - 48) and M**2 = hi * 2**24 + lo
            total += Fraction(hi[k] * (1 << 24) + lo[k]) * Fraction(2) ** (2 * e - 48)
    return float(total)


def scale_bits(unit: int) -> int:
    """Fixed-point bits ``S`` of r: a unit's int64 sum of r^2 cannot overflow."""
    # unit * 2**(2 (R_BITS + S)) <= 2**62
    return max(4, min(16, (62 - 2 * R_BITS - math.ceil(math.log2(max(unit, 1)))) // 2))


def unit_sums(
    local: Tensor, start: int, n: int, unit: int, tiny: float, centre: float
) -> Tensor:
    """Per-unit integer sums of ``round(r 2^S)`` and its square for one range.

    Args:
        local: the elements ``[start, start + local.numel())`` of the flattened tensor.
        start: their offset in the flattened global tensor.
        n: numel of the global tensor.
        unit: unit length (units are ``[k * unit, (k + 1) * unit)``).
        tiny, centre: as in ``partition`` (from the global mean of g^2).

    Returns:
        int64 ``[2, ceil(n / unit)]`` holding this range's share of every unit's sums
        (zeros for units it does not touch); shares of a cover of ``[0, n)`` add up
        to the sums of the whole tensor.
    """
    s = scale_bits(unit)
    out = torch.zeros(2, -(-n // unit), dtype=torch.int64, device=local.device)
    if local.numel() == 0:
        return out
    r = local.float().square().add_(tiny).log_().sub_(centre)
    limit = float(1 << R_BITS)
    ri = r.clamp_(-limit, limit).mul_(float(1 << s)).round_().to(torch.int64)
    head = start % unit
    u0 = start // unit
    padded = torch.nn.functional.pad(ri, (head, (-(head + ri.numel())) % unit))
    rows = padded.view(-1, unit)  # zeros in the padding add nothing
    out[0, u0 : u0 + rows.shape[0]] = rows.sum(1)
    out[1, u0 : u0 + rows.shape[0]] = rows.square().sum(1)
    return out


def choose_period(
    local: Tensor,
    shape: tuple[int, ...],
    start: int = 0,
    reduce_sum: Reduce = _identity,
) -> int:
    """``partition.choose_period`` of the global tensor, from one rank's range.

    Args:
        local: this rank's elements of the flattened global gradient (any shape).
        shape: the global tensor's shape.
        start: offset of ``local`` in the flattened global tensor.
        reduce_sum: sums an int64 tensor over the ranks (``all_reduce`` SUM); the
            identity for a single process.

    Returns:
        The period, identical on every rank and for every sharding of the tensor.

    Raises:
        ValueError: the (global) gradient holds NaN or infinite values.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> g = torch.randn(64, 256) * torch.exp(2 * torch.randn(64, 1))
        >>> choose_period(g, g.shape)
        256
    """
    n = math.prod(shape)
    if n <= 1:
        return 1
    flat = local.detach().reshape(-1)
    cands = candidate_periods(tuple(shape))
    if len(cands) == 1:
        # still refuse a non-finite gradient, as every other period choice does
        bad = (~torch.isfinite(flat)).any().to(torch.int64).view(1)
        if reduce_sum(bad).cpu().numpy()[0]:
            raise ValueError("g holds NaN or infinite values; cannot choose a period")
        return cands[0]
    # The first read on the host: the exact pieces of sum g^2 and the count of
    # non-finite values, reduced together (one collective, one transfer).
    bad = (~torch.isfinite(flat)).sum().view(1)
    parts = torch.cat([square_sum_parts(flat).view(-1), bad])
    stats = reduce_sum(parts).cpu().numpy()
    if stats[-1]:
        raise ValueError("g holds NaN or infinite values; cannot choose a period")
    mean_sq = exact_square_sum(stats[:-1].reshape(2, N_BUCKETS)) / n
    tiny = max(1e-8 * mean_sq, 1e-38)
    centre = math.log(mean_sq + tiny)
    inner = [p for p in cands if p < n]
    if not inner:
        return max(cands)
    unit = math.gcd(*inner)
    # The second and last: the per-unit sums; the scores are host arithmetic on them.
    sums = reduce_sum(unit_sums(flat, start, n, unit, tiny, centre)).cpu().numpy()
    s = scale_bits(unit)
    s1 = sums[0].astype(np.float64) / float(1 << s)
    s2 = sums[1].astype(np.float64) / float(1 << (2 * s))
    counts = np.full(s1.size, float(unit))
    counts[-1] = n - (s1.size - 1) * unit
    scores = scores_from_sums(s1, s2, counts, n, unit, cands)
    best = max(scores.values())
    keep = best - max(REL_TOL * best, ABS_TOL)
    return max(p for p in cands if scores[p] >= keep)
