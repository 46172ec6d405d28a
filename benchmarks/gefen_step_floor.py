"""What bounds Gefen's step on a large model: memory traffic or arithmetic?

A step that is bound by memory traffic gets much faster when its tensors sit in
cache; one bound by its arithmetic does not. This script times each contender's
``opt.step`` per element on one fp32 matrix at two sizes, with fixed gradients,
1 thread by default:

* **memory**: a matrix far larger than the caches (default 8192 x 4096, 128 MiB
  per tensor), so every step streams its tensors from memory;
* **in cache**: a 256 x 512 matrix (512 KiB per tensor: every contender's
  tensors fit in this core's L2), stepped many times in a row;

each minus the fixed cost of a call (the same optimizer on a 2 x 2 matrix), so
what is left is the per-element cost. The ratio memory / in cache near 1 means
the step is bound by its arithmetic: its in-cache time per element is its floor
on any memory system. The table also gives every figure as a ratio to
``AdamW(fused=True)`` at the memory size, the yardstick: an in-cache
ratio above 1 means no memory system could bring that step to fused AdamW's
speed without fewer operations per element.

The contenders are those of ``gefen_step.py --model stack``: torch's fused
AdamW, ``p.add_(g)`` (the bandwidth reference), Gefen's 8-bit and 4-bit defaults
(on a matrix this size: factored second moment, stochastic codes), and the 8-bit
step without either (``second_moment="blocks"``, nearest codes) and with each
alone, so each quality feature's cost per element is a difference of two rows.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/gefen_step_floor.py
    OMP_NUM_THREADS=2 python benchmarks/gefen_step_floor.py --threads 2
    python benchmarks/gefen_step_floor.py --big 4096x4096 --repeats 5   # quicker
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from leantrain.optim import Gefen

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)

# name -> Gefen options (None: AdamW(fused=True); "add": p.add_(g))
CONTENDERS: dict[str, dict | str | None] = {
    "torch AdamW (fused=True)": None,
    "p.add_(g) (bandwidth reference)": "add",
    "Gefen 8-bit (defaults)": dict(momentum_bits=8),
    "Gefen 4-bit (defaults)": dict(momentum_bits=4),
    "Gefen 8-bit, blocks v, nearest codes": dict(
        momentum_bits=8, second_moment="blocks", momentum_rounding="nearest"
    ),
    "Gefen 8-bit, factored v, nearest codes": dict(
        momentum_bits=8, second_moment="factored", momentum_rounding="nearest"
    ),
    "Gefen 8-bit, blocks v, stochastic codes": dict(
        momentum_bits=8, second_moment="blocks", momentum_rounding="stochastic"
    ),
}


def _stepper(options: dict | str | None, rows: int, cols: int) -> Callable[[], None]:
    """A warmed-up step of one contender on a fresh rows x cols matrix."""
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(rows, cols) * 0.02)
    param.grad = torch.randn(rows, cols) * 1e-2
    if options == "add":
        grad = param.grad

        def step() -> None:
            param.data.add_(grad)

    elif options is None:
        step = torch.optim.AdamW([param], fused=True, **HYPER).step
    else:
        step = Gefen([param], **options, **HYPER).step
    for _ in range(3):  # state, codebook, step plan
        step()
    return step


def _seconds_per_call(step: Callable[[], None], calls: int, repeats: int) -> float:
    """Median over ``repeats`` timings of ``calls`` calls in a row, per call."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            step()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def _shape(text: str) -> tuple[int, int]:
    rows, _, cols = text.partition("x")
    if not (rows.isdigit() and cols.isdigit()) or int(rows) < 2 or int(cols) < 2:
        raise argparse.ArgumentTypeError(f"expected ROWSxCOLS, both >= 2, got {text!r}")
    return int(rows), int(cols)


def measure(
    big: tuple[int, int], small: tuple[int, int], repeats: int
) -> dict[str, tuple[float, float]]:
    """name -> (ns per element streaming from memory, ns per element in cache)."""
    n_big, n_small = big[0] * big[1], small[0] * small[1]
    calls_small = max(20, 4_000_000 // n_small)
    out = {}
    for name, options in CONTENDERS.items():
        fixed = _seconds_per_call(_stepper(options, 2, 2), 200, repeats)
        step = _stepper(options, *small)
        in_cache = _seconds_per_call(step, calls_small, repeats) - fixed
        step = _stepper(options, *big)
        memory = _seconds_per_call(step, 2, repeats) - fixed
        del step
        out[name] = (memory / n_big * 1e9, in_cache / n_small * 1e9)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--big", type=_shape, default=(8192, 4096))
    parser.add_argument("--small", type=_shape, default=(256, 512))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if args.threads < 1 or args.repeats < 1:
        parser.error("--threads and --repeats must be >= 1")
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    results = measure(args.big, args.small, args.repeats)
    fused = results["torch AdamW (fused=True)"][0]
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), memory: "
        f"{args.big[0]}x{args.big[1]}, in cache: {args.small[0]}x{args.small[1]}, "
        f"median of {args.repeats}; load average {load:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after"
    )
    header = (
        f"{'step':42s} {'ns/el mem':>9s} {'ns/el L2':>9s} {'mem/L2':>7s}"
        f" {'mem /fused':>10s} {'L2 /fused':>10s}"
    )
    print(header)
    print("-" * len(header))
    for name, (memory, in_cache) in results.items():
        print(
            f"{name:42s} {memory:9.3f} {in_cache:9.3f} {memory / in_cache:7.2f}"
            f" {memory / fused:10.2f} {in_cache / fused:10.2f}"
        )
    print(
        "mem/L2 near 1: bound by arithmetic; 'L2 /fused' > 1: slower, with every "
        "tensor in cache, than fused AdamW's step from memory."
    )


if __name__ == "__main__":
    main()
