r"""The exact codebook dynamic program: plain, fast (numpy) and native (C) solvers.

The problem, the recurrence and why the fast solvers are exact are in the docstring
of :mod:`leantrain.optim.codebook`, which validates the histogram and calls these.
Every solver takes the centres ``x`` and counts ``c`` of the non-empty bins (float64,
ascending) and ``k`` and returns ``(cost, boundaries)``: the DP's optimal value and
the run boundaries ``[0, t_1, ..., t_{k-1}, B]``. All three evaluate the same
prefix-sum expressions with the same leftmost-minimum tie rule, so they agree on the
cost to float64 rounding and on the boundaries where the optimum is unique.
"""

from __future__ import annotations

import ctypes

import numpy as np


# ---------------------------------------------------------------------- prefix sums
def _prefix(x: np.ndarray, c: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Prefix sums S0, S1, S2 (length B + 1) of c, c*x, c*x^2."""
    zero = np.zeros(1)
    return (
        np.concatenate([zero, np.cumsum(c)]),
        np.concatenate([zero, np.cumsum(c * x)]),
        np.concatenate([zero, np.cumsum(c * x * x)]),
    )


def _end_costs(s0, s1, s2) -> tuple[np.ndarray, np.ndarray]:
    """Cost of [0, t) at -1 and of [t, B) at +1, for every t = 0..B."""
    head = s2 + 2.0 * s1 + s0
    r0, r1, r2 = s0[-1] - s0, s1[-1] - s1, s2[-1] - s2
    return head, r2 - 2.0 * r1 + r0


# --------------------------------------------------------------------- native solver
def _solve_native(
    x: np.ndarray, c: np.ndarray, k: int
) -> tuple[float, list[int]] | None:
    """The DP in C (divide and conquer per layer, ``_kernels/codebook_dp.c``) on the
    same prefix sums as :func:`_solve_fast`; None when the library is unavailable
    (no compiler, ``LEANTRAIN_NO_NATIVE=1``) or ``k < 3`` (nothing to solve)."""
    from . import _native  # the build is lazy: importing this module compiles nothing

    lib = _native.load()
    n = x.size
    if lib is None or k < 3 or n < k - 1:
        return None
    s0, s1, s2 = _prefix(x, c)
    head, tail = _end_costs(s0, s1, s2)
    arrays = [np.ascontiguousarray(a, dtype=np.float64) for a in (s0, s1, s2)]
    arrays += [np.ascontiguousarray(a, dtype=np.float64) for a in (head, tail)]
    bounds = np.zeros(k + 1, dtype=np.int64)
    status = ctypes.c_int32(0)
    cost = lib.lt_codebook_dp(
        *(a.ctypes.data for a in arrays),
        n,
        k,
        bounds.ctypes.data,
        ctypes.byref(status),
    )
    if status.value != 0:  # out of memory in C: the numpy solver needs less
        return None
    return float(cost), [int(b) for b in bounds]


# ------------------------------------------------------------------ reference solver
def _solve_reference(x: np.ndarray, c: np.ndarray, k: int) -> tuple[float, list[int]]:
    """Plain DP: every layer, every row, every split (the splits of one row as one
    numpy expression). Returns (cost, boundaries)."""
    n = x.size
    s0, s1, s2 = _prefix(x, c)
    head, tail = _end_costs(s0, s1, s2)
    prev = head  # L_0
    choices: list[np.ndarray] = []
    for j in range(1, k - 1):
        cur = np.full(n + 1, np.inf)
        arg = np.zeros(n + 1, dtype=np.int64)
        for t in range(j, n + 1):
            s = np.arange(j - 1, t)  # every split that leaves layer j-1 feasible
            d0 = s0[t] - s0[s]
            d1 = s1[t] - s1[s]
            vals = prev[s] + ((s2[t] - s2[s]) - d1 * d1 / d0)
            best = int(np.argmin(vals))  # leftmost minimum
            cur[t], arg[t] = vals[best], s[best]
        prev = cur
        choices.append(arg)
    total = prev + tail
    t = int(np.argmin(total[k - 2 :])) + k - 2
    return float(total[t]), _backtrack(t, choices, n)


def _backtrack(t: int, choices: list, n: int) -> list[int]:
    """Boundaries [0, t_1, ..., t_{k-1}, n] from the last split and per-layer args."""
    bounds = [t]
    for arg in reversed(choices):
        t = int(arg[t])
        bounds.append(t)
    return [0, *reversed(bounds), n]


# ----------------------------------------------------------------------- fast solver
def _row_minima(base, s0, s1, s2, rows, lo, hi, dense_width=8):
    """Min and leftmost argmin over s in [lo, hi] (inclusive, non-empty) of
    ``prev[s] + W(s, t)`` for every row t in ``rows``, vectorized over all rows.

    ``base = prev - s2``, so ``prev[s] + W(s, t) = base[s] + s2[t] - d1^2/d0`` needs
    three gathers per candidate. Narrow windows (most of them) are evaluated as one
    dense ``[width, rows]`` array; the rest as one flat, ragged array.
    """
    width = hi - lo + 1
    if rows.size < 256:  # few rows (fix-up rounds): one ragged pass is cheapest
        return _ragged_minima(base, s0, s1, s2, rows, lo, hi)
    narrow = width <= dense_width
    if narrow.all():
        return _dense_minima(base, s0, s1, s2, rows, lo, hi, int(width.max()))
    if not narrow.any():
        return _ragged_minima(base, s0, s1, s2, rows, lo, hi)
    best = np.empty(rows.size)
    arg = np.empty(rows.size, dtype=np.int64)
    for part, fn in ((narrow, _dense_minima), (~narrow, _ragged_minima)):
        extra = (int(width[part].max()),) if fn is _dense_minima else ()
        best[part], arg[part] = fn(
            base, s0, s1, s2, rows[part], lo[part], hi[part], *extra
        )
    return best, arg


def _dense_minima(base, s0, s1, s2, rows, lo, hi, width):
    """:func:`_row_minima` for windows of at most ``width``: a ``[width, rows]`` array
    (candidates past a row's ``hi`` repeat ``hi``, which cannot change its leftmost
    minimum)."""
    s = np.minimum(lo + np.arange(width)[:, None], hi)
    d0 = s0[rows] - s0[s]
    d1 = s1[rows] - s1[s]
    d1 *= d1
    d1 /= d0
    vals = base[s]
    vals -= d1
    best = vals.min(axis=0)  # axis 0 of a [width, rows] array: fast in numpy
    # s is non-decreasing down each column, so the leftmost minimum is the smallest
    # s among the hits.
    first = np.where(vals == best, s, np.iinfo(np.int64).max).min(axis=0)
    return best + s2[rows], first


def _ragged_minima(base, s0, s1, s2, rows, lo, hi):
    """:func:`_row_minima` for windows of any width: one flat array of candidates."""
    counts = hi - lo + 1
    offsets = np.zeros(rows.size, dtype=np.int64)
    np.cumsum(counts[:-1], out=offsets[1:])
    s = np.repeat(lo - offsets, counts)
    s += np.arange(s.size)
    d0 = np.repeat(s0[rows], counts)
    d0 -= s0[s]
    d1 = np.repeat(s1[rows], counts)
    d1 -= s1[s]
    d1 *= d1
    d1 /= d0
    vals = base[s]
    vals -= d1
    best = np.minimum.reduceat(vals, offsets)
    hits = np.flatnonzero(vals == np.repeat(best, counts))
    first = hits[np.searchsorted(hits, offsets)]
    return best + s2[rows], s[first]


def _layer_dc(prev, s0, s1, s2, lower, t_lo, t_hi):
    """One DP layer by divide and conquer, one vectorized pass per recursion level.

    Rows t in [t_lo, t_hi]; ``lower[t]`` is a valid lower bound on the split.
    """
    n = s0.size - 1
    base = prev - s2
    val = np.full(n + 1, np.inf)
    arg = np.zeros(n + 1, dtype=np.int64)
    ilo = np.array([t_lo])
    ihi = np.array([t_hi])
    slo = np.array([0])
    shi = np.array([t_hi - 1])
    while ilo.size:
        mid = (ilo + ihi) // 2
        a = np.maximum(slo, lower[mid])
        b = np.maximum(np.minimum(shi, mid - 1), a)
        best, opt = _row_minima(base, s0, s1, s2, mid, a, b)
        val[mid], arg[mid] = best, opt
        left = ilo <= mid - 1
        right = mid + 1 <= ihi
        ilo, ihi, slo, shi = (
            np.concatenate([ilo[left], mid[right] + 1]),
            np.concatenate([mid[left] - 1, ihi[right]]),
            np.concatenate([slo[left], opt[right]]),
            np.concatenate([opt[left], shi[right]]),
        )
    return val, arg


def _layer_knuth(prev, s0, s1, s2, lower, guess, t_lo, t_hi, max_rounds=48):
    """One DP layer from the Knuth ranges [lower[t], arg[t + 1]] with guessed ends.

    Every row first searches [lower[t], guess[t]]; a row whose window ends before the
    next row's argmin is extended (only the new part is evaluated) until no row fails.
    Returns None after ``max_rounds`` failed rounds (the caller falls back to D&C).
    """
    n = s0.size - 1
    base = prev - s2
    rows = np.arange(t_lo, t_hi + 1)
    lo = lower[rows]
    hi = np.clip(guess[rows], lo, rows - 1)
    hi[-1] = t_hi - 1  # the top row has no row above: search its whole range
    best, opt = _row_minima(base, s0, s1, s2, rows, lo, hi)
    for _ in range(max_rounds):
        need = np.minimum(opt[1:], rows[:-1] - 1)
        fail = np.flatnonzero(hi[:-1] < need)
        if fail.size == 0:
            val = np.full(n + 1, np.inf)
            arg = np.zeros(n + 1, dtype=np.int64)
            val[rows], arg[rows] = best, opt
            return val, arg
        # A run of consecutive failing rows is extended to the need of its top row,
        # a valid upper bound for all of them (splits are monotone in t), not just
        # to each row's own need, which is stale once the row above moves.
        breaks = fail[1:] != fail[:-1] + 1
        run = np.zeros(fail.size, dtype=np.int64)
        np.cumsum(breaks, out=run[1:])
        top = np.flatnonzero(np.append(breaks, True))
        # Windows also grow geometrically, so a row whose minimum keeps sliding to its
        # window's end is settled in a few rounds.
        width = hi[fail] - lo[fail] + 1
        grown = np.maximum(need[fail[top]][run], hi[fail] + width)
        new_hi = np.minimum(grown, rows[fail] - 1)
        ext_best, ext_opt = _row_minima(
            base, s0, s1, s2, rows[fail], hi[fail] + 1, new_hi
        )
        better = ext_best < best[fail]  # strict: ties keep the leftmost split
        best[fail[better]] = ext_best[better]
        opt[fail[better]] = ext_opt[better]
        hi[fail] = new_hi
    return None


def _neighbour_max(a: np.ndarray) -> np.ndarray:
    """Elementwise max of a[t - 1], a[t], a[t + 1] (edges clamped)."""
    out = a.copy()
    np.maximum(out[1:], a[:-1], out=out[1:])
    np.maximum(out[:-1], a[1:], out=out[:-1])
    return out


def _solve_fast(
    x: np.ndarray, c: np.ndarray, k: int, method: str = "auto"
) -> tuple[float, list[int]]:
    """The monotone DP (see module docstring). Returns (cost, boundaries).

    ``method``: "auto" (Knuth windows where the guessed windows are narrow, divide and
    conquer otherwise), or "dc" / "knuth" to force one (tests check both are exact;
    forced "knuth" starts from narrow guesses and allows many more fix-up rounds).
    """
    n = x.size
    s0, s1, s2 = _prefix(x, c)
    head, tail = _end_costs(s0, s1, s2)
    prev = head
    lower = np.zeros(n + 1, dtype=np.int64)  # layer 1 may split anywhere from 0
    gap = np.zeros(n + 1, dtype=np.int64) if method == "knuth" else None
    choices = []
    dc_budget = 2 * n * max(1, n.bit_length())
    for j in range(1, k - 1):
        # Rows that can still lead to a full solution: j bins used, k-2-j left.
        t_lo, t_hi = j, n - (k - 2 - j)
        result = None
        if gap is not None and method != "dc":
            # Guess row t's window end from the previous layer's Knuth widths at t and
            # its neighbours (widths shrink as j grows), with a margin: a wider first
            # pass is cheaper than the extra rounds that fix narrow windows.
            guess = lower + 2 * _neighbour_max(gap) + 2
            rows = np.arange(t_lo, t_hi + 1)
            width = np.clip(guess[rows], lower[rows], rows - 1) - lower[rows]
            if method == "knuth":
                result = _layer_knuth(
                    prev, s0, s1, s2, lower, guess, t_lo, t_hi, max_rounds=n + 1
                )
            elif width.sum() <= dc_budget:
                result = _layer_knuth(prev, s0, s1, s2, lower, guess, t_lo, t_hi)
        if result is None:
            result = _layer_dc(prev, s0, s1, s2, lower, t_lo, t_hi)
        val, arg = result
        # Keep splits monotone in t (exact arithmetic already does; this guards
        # float near-ties), so they stay valid lower bounds for the next layer.
        arg[t_lo : t_hi + 1] = np.minimum.accumulate(arg[t_lo : t_hi + 1][::-1])[::-1]
        gap = np.zeros(n + 1, dtype=np.int64)  # Knuth width: arg_j(t+1) - arg_{j-1}(t)
        gap[t_lo:t_hi] = arg[t_lo + 1 : t_hi + 1] - lower[t_lo:t_hi]
        lower = arg.copy()
        lower[t_hi + 1 :] = arg[t_hi]
        prev = val
        choices.append(arg)
    total = prev + tail
    t = int(np.argmin(total[k - 2 :])) + k - 2
    return float(total[t]), _backtrack(t, choices, n)
