"""The exact codebook DP (numpy, C) against the plain DP and brute force; the
histogram."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leantrain.optim import _codebook_dp as dp
from leantrain.optim import codebook as cbm
from leantrain.optim.codebook import (
    bin_centres,
    codebook_cost,
    histogram,
    learn_codebook,
    learn_codebook_reference,
)


def brute_force_cost(counts: np.ndarray, k: int) -> float:
    """Min over every monotone labelling of the bins with k clusters: label 0 at -1,
    label k-1 at +1 (both may be empty), labels 1..k-2 non-empty at their means."""
    x = bin_centres(counts.size)
    keep = counts > 0
    x, c = x[keep], counts[keep]
    best = math.inf
    for labels in itertools.combinations_with_replacement(range(k), x.size):
        lab = np.array(labels)
        if any(not np.any(lab == j) for j in range(1, k - 1)):
            continue
        cost = 0.0
        for j in range(k):
            m = lab == j
            if not m.any():
                continue
            centre = (
                -1.0
                if j == 0
                else 1.0
                if j == k - 1
                else np.dot(c[m], x[m]) / c[m].sum()
            )
            cost += float(np.dot(c[m], (x[m] - centre) ** 2))
        best = min(best, cost)
    return best


def dp_cost(counts: np.ndarray, k: int, method: str = "auto") -> float:
    x, c, _ = cbm._prepare(torch.from_numpy(counts), k)
    return dp._solve_fast(x, c, k, method)[0]


def ref_cost(counts: np.ndarray, k: int) -> float:
    x, c, _ = cbm._prepare(torch.from_numpy(counts), k)
    return dp._solve_reference(x, c, k)[0]


def random_counts(seed: int, bins: int, density: float, integer: bool) -> np.ndarray:
    rng = np.random.default_rng(seed)
    c = rng.exponential(size=bins) * (rng.random(bins) < density)
    return np.floor(c * 20) if integer else c


def assert_valid(cb: torch.Tensor, k: int) -> None:
    assert cb.dtype == torch.float32 and cb.shape == (k,)
    assert cb[0] == -1 and cb[-1] == 1
    assert torch.all(cb[1:] > cb[:-1]), "codes must be strictly increasing"


# ------------------------------------------------------------------- DP exactness
@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    bins=st.integers(2, 8),
    k=st.integers(2, 5),
    density=st.floats(0.2, 1.0),
)
def test_matches_brute_force_on_tiny_histograms(seed, bins, k, density):
    counts = random_counts(seed, bins, density, integer=True)
    nonempty = int((counts > 0).sum())
    if nonempty <= k - 2:
        cb = learn_codebook(torch.from_numpy(counts), k)
        assert codebook_cost(torch.from_numpy(counts), cb) == pytest.approx(
            0, abs=1e-10
        )
        return
    expected = brute_force_cost(counts, k)
    for got in (ref_cost(counts, k), dp_cost(counts, k), dp_cost(counts, k, "dc")):
        assert got == pytest.approx(expected, rel=1e-9, abs=1e-12)
    cb = learn_codebook(torch.from_numpy(counts), k)
    assert codebook_cost(torch.from_numpy(counts), cb) == pytest.approx(
        expected, rel=1e-5, abs=1e-9
    )


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    bins=st.integers(2, 200),
    k=st.integers(2, 20),
    density=st.sampled_from([0.05, 0.3, 1.0]),
    integer=st.booleans(),
)
def test_fast_equals_reference(seed, bins, k, density, integer):
    counts = random_counts(seed, bins, density, integer)
    if int((counts > 0).sum()) <= k - 2:
        return
    x, c, _ = cbm._prepare(torch.from_numpy(counts), k)
    ref_dp, ref_bounds = dp._solve_reference(x, c, k)
    ref = cbm._partition_cost(ref_bounds, x, c)  # direct: no prefix-sum rounding
    # The DP's own value carries prefix-sum rounding of order eps * total mass.
    assert ref_dp == pytest.approx(ref, rel=1e-9, abs=1e-13 * c.sum())
    for method in ("auto", "dc", "knuth"):
        got_dp, bounds = dp._solve_fast(x, c, k, method)
        assert got_dp == pytest.approx(ref, rel=1e-9, abs=1e-13 * c.sum()), method
        got = cbm._partition_cost(bounds, x, c)
        assert got == pytest.approx(ref, rel=1e-9, abs=1e-15 * c.sum()), method
        if not integer:  # continuous weights: the optimum is unique (a.s.)
            assert bounds == ref_bounds, method
    if not integer:
        t = torch.from_numpy(counts)
        assert torch.equal(learn_codebook(t, k), learn_codebook_reference(t, k))


def test_mid_size_parity_and_lloyd_fixed_point():
    torch.manual_seed(0)
    g = torch.randn(64, 128) * torch.rand(64, 1)
    counts = histogram(g, 128, bins=512)
    k = 24
    cb = learn_codebook(counts, k)
    ref = learn_codebook_reference(counts, k)
    assert torch.equal(cb, ref)
    assert codebook_cost(counts, cb) == pytest.approx(
        ref_cost(counts.numpy(), k), rel=1e-6
    )


def test_full_size_finishes_and_is_a_lloyd_fixed_point():
    """4096 bins, 256 codes (timing is in benchmarks/codebook.py). An optimal
    codebook is a Lloyd fixed point: each free code is the mean of its nearest bins."""
    torch.manual_seed(0)
    g = torch.randn(256, 512) * torch.rand(256, 1) ** 2
    counts = histogram(g, 512)
    cb = learn_codebook(counts, 256)
    assert_valid(cb, 256)
    x = bin_centres(4096)
    c = counts.numpy()
    codes = cb.double().numpy()
    nearest = np.abs(x[:, None] - codes[None, :]).argmin(1)
    for j in range(1, 255):
        m = (nearest == j) & (c > 0)
        assert m.any()
        assert codes[j] == pytest.approx(np.dot(c[m], x[m]) / c[m].sum(), abs=1e-6)
    # No codebook from a coarser DP (fewer codes, padded) can be better.
    assert codebook_cost(counts, cb) < codebook_cost(
        counts, learn_codebook(counts, 128)
    )


# ----------------------------------------------------------- codebook validity
@pytest.mark.parametrize("k", [2, 3, 16, 256])
def test_ends_pinned_sorted_distinct(k):
    torch.manual_seed(k)
    counts = histogram(torch.randn(50, 200), 200, bins=1024)
    assert_valid(learn_codebook(counts, k), k)


def test_fewer_bins_than_codes_is_zero_cost_and_distinct():
    counts = torch.zeros(4096, dtype=torch.float64)
    counts[[100, 2048, 2049, 4000]] = torch.tensor([3.0, 10.0, 1.0, 2.0]).double()
    cb = learn_codebook(counts, 16)
    assert_valid(cb, 16)
    assert codebook_cost(counts, cb) == pytest.approx(0.0, abs=1e-10)
    centres = bin_centres(4096)[[100, 2048, 2049, 4000]]
    assert np.abs(cb.double().numpy()[:, None] - centres).min(0).max() < 1e-7


def test_k_minus_one_bins_matches_reference():
    counts = torch.zeros(64, dtype=torch.float64)
    counts[[3, 20, 40, 60]] = torch.tensor([1.0, 5.0, 2.0, 7.0]).double()
    k = 5  # 4 bins > k - 2 = 3 free codes: the DP must merge or pin one
    assert codebook_cost(counts, learn_codebook(counts, k)) == pytest.approx(
        brute_force_cost(counts.numpy(), k), rel=1e-6
    )


def test_all_zero_histogram_gives_uniform_codebook():
    cb = learn_codebook(torch.zeros(4096, dtype=torch.float64), 256)
    assert_valid(cb, 256)
    assert float((cb - torch.linspace(-1, 1, 256)).abs().max()) < 1e-6


def test_pinned_ends_can_stay_empty():
    """Mass only near 0: the optimum need not move any bin to -1 or +1."""
    counts = torch.zeros(64, dtype=torch.float64)
    counts[30:34] = 1.0
    assert codebook_cost(counts, learn_codebook(counts, 4)) == pytest.approx(
        brute_force_cost(counts.numpy(), 4), rel=1e-9
    )


@pytest.mark.parametrize(
    ("counts", "k", "error"),
    [
        (torch.ones(2, 2), 4, TypeError),
        (torch.ones(10), 1, ValueError),
        (torch.ones(10), 2.0, TypeError),
        (torch.tensor([1.0, -1.0, 2.0]), 2, ValueError),
        (torch.tensor([1.0, float("nan")]), 2, ValueError),
        (torch.ones(1), 2, ValueError),
    ],
)
def test_bad_input(counts, k, error):
    with pytest.raises(error):
        learn_codebook(counts, k)


# ------------------------------------------------------------------- histogram
def histogram_reference(x: torch.Tensor, period: int, bins: int) -> np.ndarray:
    flat = x.reshape(-1).double().numpy()
    out = np.zeros(bins)
    for start in range(0, flat.size, period):
        block = flat[start : start + period]
        a = np.abs(block).max()
        u = block / a if a > 0 else block
        idx = np.clip(np.floor((u + 1) * bins / 2), 0, bins - 1).astype(int)
        np.add.at(out, idx, 1)
    return out


@pytest.mark.parametrize(
    ("shape", "period", "bins"),
    [((10, 30), 30, 4096), ((1003,), 100, 64), ((7, 11), 5, 16), ((500,), 500, 4096)],
)
def test_histogram_matches_reference(shape, period, bins):
    torch.manual_seed(1)
    x = torch.randn(shape)
    x.view(-1)[:period] = 0.0  # an all-zero block counts zeros
    h = histogram(x, period, bins)
    assert h.dtype == torch.float64 and h.shape == (bins,)
    np.testing.assert_array_equal(h.numpy(), histogram_reference(x, period, bins))
    assert h.sum() == x.numel()


def test_histogram_absmax_lands_in_the_end_bins():
    x = torch.tensor([0.5, -2.0, 1.0, 3.0])
    h = histogram(x, 2, bins=8)
    assert h[0] == 1 and h[-1] == 1  # -2 / 2 and 3 / 3


@pytest.mark.parametrize("period", [3, 8, 50])
def test_histogram_chunks_and_long_blocks(monkeypatch, period):
    torch.manual_seed(2)
    x = torch.randn(203)
    expected = histogram(x, period, 32)
    monkeypatch.setattr(cbm, "CHUNK_ELEMENTS", 16)  # blocks longer than a chunk too
    np.testing.assert_array_equal(histogram(x, period, 32).numpy(), expected.numpy())
    np.testing.assert_array_equal(expected.numpy(), histogram_reference(x, period, 32))


def test_histogram_bf16_and_errors():
    x = torch.randn(64, dtype=torch.bfloat16)
    np.testing.assert_array_equal(
        histogram(x, 16, 128).numpy(), histogram_reference(x.float(), 16, 128)
    )
    with pytest.raises(TypeError):
        histogram(torch.arange(4), 2)
    with pytest.raises(ValueError):
        histogram(torch.randn(4), 0)
    with pytest.raises(ValueError):
        histogram(torch.tensor([1.0, float("inf")]), 2)


@pytest.mark.parametrize("seed", range(4))
def test_row_minima_dense_and_ragged_paths_agree_with_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = 600
    x = np.sort(rng.uniform(-1, 1, n))
    c = rng.exponential(size=n)
    s0, s1, s2 = dp._prefix(x, c)
    prev = rng.uniform(0, 1, n + 1)
    base = prev - s2
    rows = np.arange(50, n + 1)
    lo = np.maximum(rows - rng.integers(1, 20, rows.size), 0)
    hi = np.minimum(lo + rng.integers(0, 12, rows.size), rows - 1)
    expected = []
    for t, a, b in zip(rows, lo, hi, strict=True):
        s = np.arange(a, b + 1)
        v = prev[s] + (s2[t] - s2[s]) - (s1[t] - s1[s]) ** 2 / (s0[t] - s0[s])
        expected.append((v.min(), s[np.flatnonzero(v <= v.min() + 1e-12)[0]]))
    exp_best, exp_arg = map(np.array, zip(*expected, strict=True))
    for fn in (dp._row_minima, dp._ragged_minima):
        best, arg = fn(base, s0, s1, s2, rows, lo, hi)
        np.testing.assert_allclose(best, exp_best, rtol=1e-9, atol=1e-9)
        np.testing.assert_array_equal(arg, exp_arg)
    narrow = (hi - lo + 1) <= 8
    best, arg = dp._dense_minima(
        base, s0, s1, s2, rows[narrow], lo[narrow], hi[narrow], 8
    )
    np.testing.assert_array_equal(arg, exp_arg[narrow])


def test_knuth_fallback_to_divide_and_conquer_is_exact(monkeypatch):
    """A layer whose windows are not certified within the round limit falls back to
    divide and conquer; force that on every layer and compare with the reference."""
    original = dp._layer_knuth

    def impatient(*args, **kwargs):
        kwargs["max_rounds"] = 0
        return original(*args, **kwargs)

    monkeypatch.setattr(dp, "_layer_knuth", impatient)
    for seed in range(3):
        counts = random_counts(seed, 150, 0.7, integer=False)
        x, c, _ = cbm._prepare(torch.from_numpy(counts), 12)
        cost, bounds = dp._solve_fast(x, c, 12)
        ref_cost, ref_bounds = dp._solve_reference(x, c, 12)
        assert bounds == ref_bounds and cost == pytest.approx(ref_cost, rel=1e-9)


# ------------------------------------------------------------------ native solver
def native_or_skip():
    from leantrain.optim import _native

    if _native.load() is None:
        pytest.skip(f"native library unavailable: {_native.status()}")


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    bins=st.integers(2, 300),
    k=st.integers(3, 24),
    density=st.sampled_from([0.05, 0.3, 1.0]),
    integer=st.booleans(),
)
def test_native_equals_numpy_and_reference(seed, bins, k, density, integer):
    """C solver == numpy fast solver == plain DP: the same optimal cost to 1e-12
    relative, and the same boundaries where the optimum is unique."""
    native_or_skip()
    counts = random_counts(seed, bins, density, integer)
    if int((counts > 0).sum()) <= k - 2:
        return
    x, c, _ = cbm._prepare(torch.from_numpy(counts), k)
    native_cost, native_bounds = dp._solve_native(x, c, k)
    fast_cost, fast_bounds = dp._solve_fast(x, c, k)
    ref_cost, ref_bounds = dp._solve_reference(x, c, k)
    # All three evaluate the same prefix-sum expressions: agreement is near-exact.
    assert native_cost == pytest.approx(fast_cost, rel=1e-12, abs=1e-15 * c.sum())
    assert native_cost == pytest.approx(ref_cost, rel=1e-12, abs=1e-15 * c.sum())
    direct = cbm._partition_cost(native_bounds, x, c)
    assert direct == pytest.approx(
        cbm._partition_cost(ref_bounds, x, c), rel=1e-9, abs=1e-15 * c.sum()
    )
    assert len(native_bounds) == k + 1 and native_bounds[0] == 0
    assert native_bounds[-1] == x.size
    assert np.all(np.diff(native_bounds[1:-1]) > 0)  # middle runs are non-empty
    if not integer:  # continuous weights: the optimum is unique (a.s.)
        assert native_bounds == ref_bounds == fast_bounds


def test_native_full_size_matches_numpy(monkeypatch):
    """4096 bins, 256 codes: the codebook learn_codebook returns with the C solver
    equals the numpy solver's, bit for bit (LEANTRAIN_NO_NATIVE=1 forces numpy)."""
    native_or_skip()
    torch.manual_seed(3)
    g = torch.randn(512, 512) * torch.rand(512, 1) ** 2
    counts = histogram(g, 512)
    x, c, _ = cbm._prepare(counts, 256)
    native_cost, native_bounds = dp._solve_native(x, c, 256)
    fast_cost, fast_bounds = dp._solve_fast(x, c, 256)
    assert native_cost == pytest.approx(fast_cost, rel=1e-12)
    assert native_bounds == fast_bounds
    native = learn_codebook(counts, 256)
    monkeypatch.setenv("LEANTRAIN_NO_NATIVE", "1")
    assert dp._solve_native(x, c, 256) is None
    assert torch.equal(native, learn_codebook(counts, 256))


def test_native_declines_what_it_does_not_solve():
    """k = 2 (no middle layer) and too few bins go to the numpy path."""
    native_or_skip()
    x, c, _ = cbm._prepare(torch.ones(10, dtype=torch.float64), 2)
    assert dp._solve_native(x, c, 2) is None
    assert dp._solve_native(x, c, 12) is None  # 10 bins < k - 1
