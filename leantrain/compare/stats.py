"""Seed-to-seed statistics of paired ratios (a contender's loss over the baseline's,
one per seed, each pair from the same initial weights and batches).

One training run is one draw; a difference between optimizers is real only when the
interval of the ratio over seeds excludes 1. The geometric mean is used because
ratios multiply (a 5 % loss and a 5 % gain are not symmetric in arithmetic means).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

# Two-sided 95% Student t quantiles by degrees of freedom (n - 1 seeds); past 30
# the normal 1.96 (t is at most 4% wider there).
T95 = {
    1: 12.71,
    2: 4.30,
    3: 3.18,
    4: 2.78,
    5: 2.57,
    6: 2.45,
    7: 2.36,
    8: 2.31,
    9: 2.26,
    10: 2.23,
    11: 2.20,
    12: 2.18,
    13: 2.16,
    14: 2.14,
    15: 2.13,
    16: 2.12,
    17: 2.11,
    18: 2.10,
    19: 2.09,
    20: 2.09,
    21: 2.08,
    22: 2.07,
    23: 2.07,
    24: 2.06,
    25: 2.06,
    26: 2.06,
    27: 2.05,
    28: 2.05,
    29: 2.05,
    30: 2.04,
}


def ratio_interval(ratios: Sequence[float]) -> tuple[float, float, float]:
    """Geometric mean of ``ratios`` and its 95% interval (Student t on the log
    ratios, ``n - 1`` degrees of freedom).

    Returns:
        ``(mean, low, high)``; the bounds are NaN for a single ratio, and all three
        are NaN when a run diverged (a ratio that is not a positive finite number).
    """
    if not all(math.isfinite(r) and r > 0 for r in ratios):
        return math.nan, math.nan, math.nan
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), math.nan, math.nan
    half = T95.get(len(logs) - 1, 1.96) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)
