"""Gefen's optimizer step on one large fp32 tensor versus torch's AdamW (CPU).

The codebook is the one Gefen learns from the benchmark's gradient (a learned
codebook's codes are at least a histogram bin apart, which the kernel's lookup
relies on for speed, not for exactness).

Prints one table: time per step (median after warm-up), the ratio to AdamW's
default step and to ``AdamW(fused=True)``, and the peak extra memory
during the step, for

* torch AdamW, default (on CPU: the single-tensor loop) and ``fused=True``;
* Gefen's fused C kernel, 8-bit and 4-bit codes (nearest, and stochastic: the
  4-bit default), 8-bit and 4-bit stochastic with a factored second moment (the
  tensor as 1000 columns),
  fp32 momentum, and 8-bit with
  a bf16 parameter and gradient (stochastic rounding, the bf16 default);
* Gefen's chunked PyTorch fallback (8-bit), and the reference step (8-bit).

Peak extra memory is the growth of the process's peak resident set during one step:
``echo 5 > /proc/self/clear_refs`` resets VmHWM to the current RSS, the step runs,
and VmHWM - VmRSS(before) is what the step's temporaries touched (Linux only;
``malloc_trim`` first returns freed heap pages, so reused ones count too; the
state already exists, so it is not counted). It is also given as a fraction of the
parameter's bytes.

Then the first-call cost of the kernel: building it into an empty cache (compile),
and loading it from a warm cache (hash + dlopen).

Usage::

    python benchmarks/gefen_step.py                 # 25M elements, 2 threads
    python benchmarks/gefen_step.py --numel 4000000 --threads 1 --repeats 9
    python benchmarks/gefen_step.py --threads 1 --clock cpu   # on a busy machine
    python benchmarks/gefen_step.py --model stack --threads 2 --repeats 9
    python benchmarks/gefen_step.py --model gpt --threads 1 --repeats 31

``--model stack`` (a 29.3 M-parameter transformer-like stack) and ``--model gpt``
(GPT.default(), about 60 small tensors) time whole-model ``opt.step`` calls instead:
Gefen 8-bit and 4-bit at their defaults against both AdamWs, with each step's
effective bandwidth beside a ``p.add_(g)`` over the same tensors (see
``gefen_step_models.py``). ``LEANTRAIN_NO_NATIVE=1`` times the PyTorch fallback.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from leantrain.optim import _fused, _native
from leantrain.optim._options import StepOptions
from leantrain.optim._state import new_state
from leantrain.optim._step import reference_step
from leantrain.optim._torch_step import torch_step
from leantrain.optim.codebook import histogram, learn_codebook, with_exact_zero
from leantrain.optim.factored import factor_shape

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gefen_step_models  # noqa: E402

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    raise KeyError(key)


def _release_free_memory() -> None:
    # Freed heap pages stay resident and would hide a step's temporaries when
    # reused; glibc's malloc_trim gives them back first.
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_extra_bytes(fn) -> int | None:
    """Bytes of resident memory a call adds at its peak (None off Linux)."""
    _release_free_memory()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status_kib("VmRSS:")
    except OSError:
        fn()
        return None
    fn()
    return max(0, _status_kib("VmHWM:") - before) * 1024


# time.perf_counter (wall) or time.process_time (CPU seconds of this process: with
# --threads 1 on a shared machine it leaves out the time other processes ran)
CLOCK = time.perf_counter


def timed(fn, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = CLOCK()
        fn()
        times.append(CLOCK() - start)
    return statistics.median(times)


def learned_codebook(grad: torch.Tensor, period: int, bits: int) -> torch.Tensor:
    """The codebook Gefen learns from this gradient (as on its first step)."""
    return learn_codebook(histogram(grad, period), 2**bits)


def gefen_case(
    numel: int,
    period: int,
    bits: int | None,
    step_fn,
    dtype=torch.float32,
    factored: bool = False,
):
    shape = (numel // 1000, 1000) if factored else (numel,)  # factored: 1000 columns
    param = torch.randn(shape, dtype=dtype)
    grad = torch.randn(shape, dtype=dtype)
    cb = learned_codebook(grad.float().reshape(-1), period, bits) if bits else None
    if factored:
        cb = with_exact_zero(cb)
    factors = factor_shape(shape) if factored else None
    state = new_state(param, period, bits, cb, factors)

    def step():
        step_fn(param, grad, state, **HYPER, maximize=False)

    return step


def fused_with(**options):
    """The fused step with ``fused_step`` options added to every call."""

    def step(param, grad, state, **hyper):
        _fused.fused_step(param, grad, state, **hyper, **options)

    return step


# Codes rounded stochastically: Gefen's default for 4-bit momentum
# (momentum_rounding="auto"), momentum_rounding="stochastic" for 8-bit; with
# update_clip=1 too, the 4-bit default on a factored matrix (update_clip="auto");
# update_clip=1 alone on 8-bit blocks shows the clamp.
stochastic_codes_step = fused_with(stochastic_codes=True, seed=1)
default_4bit_step = fused_with(stochastic_codes=True, seed=1, update_clip=1.0)
clipped_step = fused_with(update_clip=1.0)


def torch_fallback(param, grad, state, **hyper):
    """The PyTorch fallback, forced even where the kernel could run."""
    state["step"] += 1
    h = StepOptions(**hyper).scalars(float(state["step"]))
    torch_step(param, grad, state, h)


def adamw_case(numel: int, fused: bool):
    param = torch.nn.Parameter(torch.randn(numel))
    param.grad = torch.randn(numel)
    opt = torch.optim.AdamW(
        [param],
        lr=HYPER["lr"],
        betas=(HYPER["beta1"], HYPER["beta2"]),
        eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"],
        fused=fused or None,  # None: torch's CPU default (single-tensor loop)
    )
    opt.step()  # creates the state
    return opt.step


def first_call_times() -> tuple[float, float]:
    """(build into an empty cache, load from the warm cache), in seconds."""
    saved = os.environ.get("LEANTRAIN_CACHE")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["LEANTRAIN_CACHE"] = tmp
        try:
            times = []
            for _ in range(2):
                _native._tried, _native._library = False, None
                start = time.perf_counter()
                assert _native.load() is not None, _native.status()
                times.append(time.perf_counter() - start)
        finally:
            if saved is None:
                del os.environ["LEANTRAIN_CACHE"]
            else:
                os.environ["LEANTRAIN_CACHE"] = saved
            _native._tried, _native._library = False, None
            _native.load()
    return times[0], times[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--period", type=int, default=5000, help="block length p")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--slow-repeats", type=int, default=1, help="for the fallback and reference"
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: process CPU time (use with --threads 1 on a busy machine)",
    )
    parser.add_argument(
        "--model",
        choices=("tensor", *gefen_step_models.MODELS),
        default="tensor",
        help="tensor: one large tensor, every kernel option; stack, gpt: whole-model "
        "opt.step with the bandwidth reference",
    )
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    if args.model != "tensor":
        print(
            f"torch {torch.__version__}, {args.clock} clock, Gefen backend: "
            f"{_fused.backend()} ({_native.status()})"
        )
        gefen_step_models.run(args.model, args.repeats, CLOCK, peak_extra_bytes)
        return
    n, p = args.numel, args.period
    print(
        f"one fp32 tensor of {n:,} elements, period {p}, {args.threads} threads, "
        f"{args.clock} clock, "
        f"torch {torch.__version__}, Gefen backend: {_fused.backend()} "
        f"({_native.status()})"
    )
    # (name, make the step, slow): slow steps run once, without a warm-up call
    cases = [
        ("torch AdamW (default)", lambda: adamw_case(n, False), False),
        ("torch AdamW (fused=True)", lambda: adamw_case(n, True), False),
        ("Gefen fused C, 8-bit", lambda: gefen_case(n, p, 8, _fused.fused_step), False),
        (
            "Gefen fused C, 4-bit, nearest",
            lambda: gefen_case(n, p, 4, _fused.fused_step),
            False,
        ),
        (
            "Gefen fused C, 4-bit, stochastic codes",
            lambda: gefen_case(n, p, 4, stochastic_codes_step),
            False,
        ),
        (
            "Gefen fused C, 8-bit, stochastic codes",
            lambda: gefen_case(n, p, 8, stochastic_codes_step),
            False,
        ),
        (
            "Gefen fused C, 8-bit, factored v",
            lambda: gefen_case(n, p, 8, _fused.fused_step, factored=True),
            False,
        ),
        (
            "Gefen fused C, 4-bit, stochastic, factored v",
            lambda: gefen_case(n, p, 4, stochastic_codes_step, factored=True),
            False,
        ),
        (
            "Gefen fused C, 4-bit default (+ clip)",
            lambda: gefen_case(n, p, 4, default_4bit_step, factored=True),
            False,
        ),
        (
            "Gefen fused C, 8-bit, clipped",
            lambda: gefen_case(n, p, 8, clipped_step),
            False,
        ),
        (
            "Gefen fused C, fp32 m",
            lambda: gefen_case(n, p, None, _fused.fused_step),
            False,
        ),
        (
            "Gefen fused C, 8-bit, bf16 (SR)",
            lambda: gefen_case(n, p, 8, _fused.fused_step, torch.bfloat16),
            False,
        ),
        (
            "Gefen torch fallback, 8-bit",
            lambda: gefen_case(n, p, 8, torch_fallback),
            True,
        ),
        (
            "Gefen reference_step, 8-bit",
            lambda: gefen_case(n, p, 8, reference_step),
            True,
        ),
    ]
    # Fast steps run round-robin (one of each per round), so a shared machine's
    # changing load hits them alike and their ratios stay meaningful.
    fast = [(name, make()) for name, make, slow in cases if not slow]
    times: dict[str, list[float]] = {name: [] for name, _ in fast}
    for round_ in range(args.repeats + 1):  # round 0 is the warm-up
        for name, step in fast:
            seconds = timed(step, 1, warmup=0)
            if round_:
                times[name].append(seconds)
    rows = [
        (name, statistics.median(times[name]), peak_extra_bytes(step))
        for name, step in fast
    ]
    del fast
    for name, make, slow in cases:
        if slow and args.slow_repeats > 0:  # 0 skips the slow steps
            step = make()
            seconds = timed(step, args.slow_repeats, warmup=0)
            rows.append((name, seconds, peak_extra_bytes(step)))
            del step
    base, fused = rows[0][1], rows[1][1]
    param_bytes = 4 * n
    width = max(len(name) for name, *_ in rows)
    header = (
        f"{'step':{width}s} {'ms/step':>9s} {'/AdamW':>7s} {'/fused':>7s} "
        f"{'peak extra MiB':>15s} {'x param':>8s}"
    )
    print(header)
    print("-" * len(header))
    for name, seconds, extra in rows:
        mib = "n/a" if extra is None else f"{extra / 2**20:.1f}"
        frac = "n/a" if extra is None else f"{extra / param_bytes:.3f}"
        print(
            f"{name:{width}s} {seconds * 1e3:9.1f} {seconds / base:7.2f} "
            f"{seconds / fused:7.2f} {mib:>15s} {frac:>8s}"
        )
    cold, warm = first_call_times()
    print(
        f"kernel first use: build into an empty cache {cold:.2f} s, "
        f"load from the warm cache {warm * 1e3:.1f} ms"
    )
    bytes_gefen = n + 4 * math.ceil(n / p) * 2
    print(f"state bytes: AdamW {8 * n:,}; Gefen 8-bit {bytes_gefen:,}")


if __name__ == "__main__":
    main()
