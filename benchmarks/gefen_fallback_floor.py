"""The floor of a Gefen step written in torch ops on CPU: what decoding and encoding
8-bit codes cost alone, beside one fused AdamW step over the same number of elements.

The PyTorch fallback (``LEANTRAIN_NO_NATIVE=1``, or no C compiler) must at least
decode every stored code to its codebook value and encode every new momentum to a
code. This times the cheapest torch ops for each, one thread, process CPU time,
median of ``--repeats``, and prints each as a ratio to ``AdamW(fused=True)``'s whole
step. Run: ``OMP_NUM_THREADS=1 python benchmarks/gefen_fallback_floor.py``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=29_283_328)  # gefen_step's stack
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    n = args.numel
    param = torch.nn.Parameter(torch.randn(n, generator=gen))
    param.grad = torch.randn(n, generator=gen) * 1e-2
    adamw = torch.optim.AdamW([param], lr=1e-3, fused=True)
    codebook = torch.sort(torch.randn(256, generator=gen)).values
    codebook /= codebook.abs().max()
    midpoints = (codebook[1:] + codebook[:-1]) / 2
    codes = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    codes32 = codes.int()
    x = torch.rand(n, generator=gen) * 2 - 1
    rows = [
        ("AdamW(fused=True) step", adamw.step),
        ("p.add_(g)", lambda: param.data.add_(param.grad)),
        ("codes.int() (uint8 -> int32)", codes.int),
        (
            "codebook.index_select(0, codes32) (decode)",
            lambda: codebook.index_select(0, codes32),
        ),
        ("codebook[codes.long()] (decode)", lambda: codebook[codes.long()]),
        (
            "torch.bucketize(m, midpoints) (encode)",
            lambda: torch.bucketize(x, midpoints),
        ),
    ]
    print(f"{n:,} elements, 1 thread, process CPU time, median of {args.repeats}")
    base = None
    for name, fn in rows:
        ms = _median_ms(fn, args.repeats)
        base = base or ms
        print(f"{name:45s} {ms:9.1f} ms {ms / base:7.2f}x")


if __name__ == "__main__":
    main()
