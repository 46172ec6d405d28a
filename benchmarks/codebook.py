"""Exact codebook DP: the C and numpy solvers against the plain O(b^2 k) program.

Prints one table: for b non-empty bins and k codes, the C solver's CPU time
(``_kernels/codebook_dp.c``; "n/a" without the native library), the numpy fast
solver's (best of 3), the reference's CPU time (run only when its estimate is under
the limit), the reference / fast ratio and whether all reach the same optimal cost.
One thread.

    python benchmarks/codebook.py            # reference up to ~20 s per cell
    python benchmarks/codebook.py --limit 5  # tighter
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import numpy as np
import torch

from leantrain.optim import codebook as cbm


def gradient_like_counts(bins: int, seed: int = 0) -> torch.Tensor:
    """Every bin non-empty: a peaked (Laplace-like) profile with noise and end spikes,
    like the histogram of block-normalized gradients."""
    rng = np.random.default_rng(seed)
    m = cbm.bin_centres(bins)
    counts = 1000.0 * np.exp(-np.abs(m) * 6) * rng.uniform(0.5, 1.5, bins) + 1.0
    counts[[0, -1]] += 500.0  # every block's absmax lands at -1 or +1
    return torch.from_numpy(np.floor(counts))


def best_of(fn, repeat: int = 3) -> tuple[float, object]:
    """Best CPU time (process time: robust when other jobs share the cores)."""
    times, out = [], None
    for _ in range(repeat):
        start = time.process_time()
        out = fn()
        times.append(time.process_time() - start)
    return min(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--limit", type=float, default=20.0, help="reference budget (s)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"native library: {cbm.native_status()}")
    header = (
        f"{'bins':>5} {'k':>4} {'C (CPU s)':>10} {'numpy (CPU s)':>13} "
        f"{'reference (CPU s)':>22} {'ratio':>7} {'equal cost':>10}"
    )
    print(header)
    print("-" * len(header))
    for bins in (256, 1024, 4096):
        counts = gradient_like_counts(bins)
        x, c, _ = cbm._prepare(counts, 2)
        for k in (16, 256):
            fast_t, (_, fast_bounds) = best_of(partial(cbm.DP_SOLVERS["fast"], x, c, k))
            native_t, native = best_of(partial(cbm.DP_SOLVERS["native"], x, c, k))
            # Partition costs evaluated directly (no prefix-sum rounding).
            fast_direct = cbm._partition_cost(fast_bounds, x, c)
            same_native = native is None or (
                abs(cbm._partition_cost(native[1], x, c) - fast_direct)
                <= 1e-12 * fast_direct
            )
            native_s = "n/a" if native is None else f"{native_t:.4f}"
            # One reference layer, times the number of layers, estimates the whole.
            one_layer, _ = best_of(
                partial(cbm.DP_SOLVERS["reference"], x, c, 3), repeat=1
            )
            estimate = one_layer * (k - 2)
            if estimate <= args.limit:
                ref_t, (_, ref_bounds) = best_of(
                    partial(cbm.DP_SOLVERS["reference"], x, c, k), repeat=1
                )
                # Both partitions' costs evaluated directly (no prefix-sum rounding).
                fast_cost = cbm._partition_cost(fast_bounds, x, c)
                ref_cost = cbm._partition_cost(ref_bounds, x, c)
                ref = f"{ref_t:.3f}"
                ratio = f"{ref_t / fast_t:.0f}x"
                same = abs(fast_cost - ref_cost) <= 1e-9 * ref_cost and same_native
                equal = "yes" if same else "NO"
            else:
                ref = f"skipped (est. {estimate:.0f} s)"
                ratio = f"~{estimate / fast_t:.0f}x"
                equal = "C=numpy" if same_native else "NO"
            print(
                f"{bins:>5} {k:>4} {native_s:>10} {fast_t:>13.4f} {ref:>22} "
                f"{ratio:>7} {equal:>10}"
            )


if __name__ == "__main__":
    main()
