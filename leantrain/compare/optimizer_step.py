"""One optimizer step of several contenders over a model's parameter shapes, timed on
CPU or CUDA: Gefen's whole-model step against torch's AdamW.

``benchmarks/gefen_step.py`` prints :func:`run`'s tables; the optimizer-step section
of ``scripts/gpu_check.sh`` calls :func:`measure` at its own size. Every contender
steps its own copy of one model's parameters with the same fixed gradients
(``opt.step``: everything a training loop pays, the non-finite check, the bookkeeping
and the kernels):

* ``torch.optim.AdamW(fused=True)`` (the baseline of every ratio) and
  ``AdamW(foreach=True)``;
* Gefen 8-bit and 4-bit with every option at its default, and 8-bit with
  ``second_moment="blocks"`` (the paper's block-shared ``v``, nearest codes);
* bitsandbytes ``AdamW8bit`` (CUDA) and torchao ``AdamW8bit`` when importable;
* ``p.add_(g)`` over the same tensors: the memory-traffic reference, a step that
  reads p and g and writes p and does nothing else.

Per parameter dtype (fp32 and bf16 parameters and gradients) it reports, each from
one run: ms per step (the median of the timed steps, after a warm-up step; CUDA
events on a GPU, the wall or process clock on CPU: :class:`Clock`), the ratio to
fused AdamW's, state bytes per parameter (``bytes_per_param``), the effective
bandwidth and its ratio to ``p.add_(g)``'s, the peak extra memory of one step as a
fraction of the parameter bytes, and the first step's time, cold and warm. Cold is
the first step of that kind of optimizer in the process (on CUDA: Triton compiling, a
codebook learned, every state allocated); warm is a second optimizer's first step on
the same parameters (kernels cached; the state is still built).

Bandwidth is nominal bytes moved / time (:func:`nominal_bytes`): the tensors a step
must touch, once each. AdamW reads p, g, m, v and writes p, m, v (28 bytes per fp32
parameter); ``p.add_(g)`` reads p, g and writes p (12); Gefen reads p, g and every
state tensor and writes p and every state tensor (8-bit: 4 + 4 + 1 + 4 + 1 = 14 bytes
plus the block scales), and a factored second moment reads g once more for its row
and column sums. A step faster than ``p.add_(g)``'s bandwidth would mean the count is
wrong; one far below it is compute- or overhead-bound.

Peak extra memory (:func:`peak_extra_bytes`): on CUDA
``torch.cuda.max_memory_allocated`` over the step minus the allocation before it; on
Linux CPUs the growth of the process's peak resident set (``/proc/self/clear_refs``
resets it; ``malloc_trim`` first returns freed heap pages, so reused ones count too);
n/a elsewhere. The state exists already, so it is not counted.

Contenders run round-robin, one step of each per round, so the changing load of a
shared machine hits them alike; :func:`run` records the load average beside the
table.

Models (:data:`MODELS`): ``gpt2`` (GPT-2 small's 148 tensors, 124.4 M parameters:
50257 x 768 and 1024 x 768 embeddings, 12 x [2304 x 768, 768 x 768, 3072 x 768,
768 x 3072, biases, LayerNorms]), ``stack`` (29.3 M parameters in 19 tensors: an
embedding and three MLP blocks) and ``gpt`` (``GPT.default()``, 0.87 M in 61).
:func:`quick_shapes` is GPT-2's layout at width 64, two layers, a 512-token
vocabulary. ``LEANTRAIN_NO_NATIVE=1`` times Gefen's PyTorch fallback on CPU.

Example:
    >>> import torch
    >>> from leantrain.compare import optimizer_step
    >>> rows = optimizer_step.measure(
    ...     optimizer_step.quick_shapes(), torch.float32, torch.device("cpu"),
    ...     repeats=1, budget_s=1.0, clock=optimizer_step.Clock(torch.device("cpu")),
    ... )
    >>> rows[0]["optimizer"], rows[0]["x_fused_adamw"]
    ('AdamW(fused=True)', 1.0)
"""

from __future__ import annotations

import ctypes
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from leantrain.optim import Gefen, bytes_per_param

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
BASELINE = "AdamW(fused=True)"
FLOOR = "p.add_(g) (traffic reference)"


# ------------------------------------------------------------------------- shapes
def gpt2_shapes(
    layers: int = 12, width: int = 768, vocab: int = 50257, context: int = 1024
) -> list[tuple[int, ...]]:
    """GPT-2's parameter shapes (``nn.Linear`` layout, out x in); the defaults are
    GPT-2 small's: 148 tensors, 124,439,808 parameters."""
    block = [
        (width,), (width,),  # ln_1
        (3 * width, width), (3 * width,),  # attention qkv
        (width, width), (width,),  # attention projection
        (width,), (width,),  # ln_2
        (4 * width, width), (4 * width,),  # mlp in
        (width, 4 * width), (width,),  # mlp out
    ]  # fmt: skip
    return [(vocab, width), (context, width), *block * layers, (width,), (width,)]


def stack_shapes() -> list[tuple[int, ...]]:
    """A 29.3 M-parameter transformer-like stack: an embedding and three MLP blocks
    with a LayerNorm each (the shapes, not the forward, matter here)."""
    block = [(4096, 1024), (4096,), (1024, 4096), (1024,), (1024,), (1024,)]
    return [(4000, 1024), *block * 3]


def gpt_default_shapes() -> list[tuple[int, ...]]:
    """leantrain's ``GPT.default()`` (0.87 M parameters in 61 tensors)."""
    from leantrain.models.gpt import GPT

    return [tuple(p.shape) for p in GPT.default().parameters()]


MODELS: dict[str, Callable[[], list[tuple[int, ...]]]] = {
    "gpt2": gpt2_shapes,
    "stack": stack_shapes,
    "gpt": gpt_default_shapes,
}


def quick_shapes() -> list[tuple[int, ...]]:
    """GPT-2's layout at a tiny size (28 tensors): seconds on CPU."""
    return gpt2_shapes(layers=2, width=64, vocab=512, context=64)


# ---------------------------------------------------------------------- contenders
def contenders(device: torch.device) -> dict[str, Callable | None]:
    """Name -> optimizer factory (None: ``p.add_(g)``); peers only when importable."""
    makers: dict[str, Callable | None] = {
        BASELINE: lambda ps: torch.optim.AdamW(ps, **HYPER, fused=True),
        "AdamW(foreach=True)": lambda ps: torch.optim.AdamW(ps, **HYPER, foreach=True),
        "Gefen 8-bit (defaults)": lambda ps: Gefen(ps, **HYPER),
        "Gefen 4-bit (defaults)": lambda ps: Gefen(ps, **HYPER, momentum_bits=4),
        "Gefen 8-bit, blocks v": lambda ps: Gefen(ps, **HYPER, second_moment="blocks"),
    }
    if device.type == "cuda":
        try:
            import bitsandbytes as bnb

            makers["bitsandbytes AdamW8bit"] = lambda ps: bnb.optim.AdamW8bit(
                ps, **HYPER
            )
        except ImportError:
            pass
    try:
        from torchao.optim import AdamW8bit

        makers["torchao AdamW8bit"] = lambda ps: AdamW8bit(ps, **HYPER)
    except ImportError:
        pass
    makers[FLOOR] = None
    return makers


class _AddStep:
    """``p.add_(g)`` over every parameter, shaped like an optimizer."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params

    @torch.no_grad()
    def step(self) -> None:
        for p in self.params:
            p.add_(p.grad)


def make_params(shapes, dtype, device, seed: int = 0) -> list[torch.nn.Parameter]:
    """Parameters with fixed gradients (every step sees the same), one generator."""
    g = torch.Generator(device=device).manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(
            (torch.randn(shape, generator=g, device=device) * 0.02).to(dtype)
        )
        p.grad = (torch.randn(shape, generator=g, device=device) * 1e-2).to(dtype)
        params.append(p)
    return params


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the per-parameter state a step reads and writes (scalars and the
    shared codebook left out)."""
    total = 0
    for state in opt.state.values():
        for key, t in state.items():
            if torch.is_tensor(t) and t.numel() > 1 and key != "codebook":
                total += t.numel() * t.element_size()
    return total


def nominal_bytes(params, opt: torch.optim.Optimizer | None) -> int:
    """Bytes one step must move (see the module docstring)."""
    p_bytes = sum(p.numel() * p.element_size() for p in params)
    g_bytes = sum(p.grad.numel() * p.grad.element_size() for p in params)
    if opt is None:
        return 2 * p_bytes + g_bytes
    factored = sum(
        p.grad.numel() * p.grad.element_size()
        for p, state in opt.state.items()
        if "factored" in state
    )
    return 2 * p_bytes + g_bytes + 2 * _state_bytes(opt) + factored


# ----------------------------------------------------------------------- measuring
class Clock:
    """Seconds of one call: CUDA events on a GPU, else ``time_fn`` (wall or the
    process's CPU time)."""

    def __init__(self, device: torch.device, time_fn=time.perf_counter) -> None:
        self.cuda = device.type == "cuda"
        self.time_fn = time_fn

    def wall(self, fn: Callable[[], object]) -> float:
        """Wall seconds of a call, the device's queue drained before and after
        (for a first step, whose host work is part of its cost)."""
        if self.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def time(self, fn: Callable[[], object]) -> float:
        if not self.cuda:
            start = self.time_fn()
            fn()
            return self.time_fn() - start
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    raise KeyError(key)


def peak_extra_bytes(step: Callable[[], object], device: torch.device) -> int | None:
    """Bytes one call adds at its peak over what was allocated before it."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(device) - before
    try:  # freed heap pages stay resident and would hide reused temporaries
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status_kib("VmRSS:")
    except OSError:
        return None
    step()
    return max(0, _status_kib("VmHWM:") - before) * 1024


def measure(
    shapes: Sequence[tuple[int, ...]],
    dtype: torch.dtype,
    device: torch.device,
    *,
    repeats: int,
    budget_s: float,
    clock: Clock,
) -> list[dict]:
    """One row per contender (:func:`contenders`' order) for parameters of ``dtype``;
    ratios from this run. Each contender's first step is timed cold and warm, then
    one warm-up round and up to ``repeats`` timed rounds, one step of each per round;
    no new round starts past ``budget_s`` once 3 are timed.

    Raises:
        ValueError: ``repeats`` < 1 or ``budget_s`` <= 0, named.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    if not budget_s > 0:
        raise ValueError(f"budget_s must be positive, got {budget_s}")
    entries = []
    for name, make in contenders(device).items():
        params = make_params(shapes, dtype, device)
        if make is None:
            opt, stepper = None, _AddStep(params)
            cold = warm = None
        else:
            cold = clock.wall(make(params).step)  # first of its kind in the process
            opt = make(params)  # a second optimizer: warm kernels, a fresh state
            warm = clock.wall(opt.step)
            stepper = opt
        entries.append([name, params, opt, stepper, cold, warm, []])
    started = time.perf_counter()
    for round_ in range(repeats + 1):  # round 0 is the warm-up
        for entry in entries:
            seconds = clock.time(entry[3].step)
            if round_:
                entry[6].append(seconds)
        if round_ >= 3 and time.perf_counter() - started > budget_s:
            break
    rows = []
    for name, params, opt, stepper, cold, warm, times in entries:
        n = sum(p.numel() for p in params)
        seconds = statistics.median(times)
        extra = peak_extra_bytes(stepper.step, device)
        p_bytes = n * params[0].element_size()
        rows.append(
            {
                "optimizer": name,
                "ms_per_step": seconds * 1e3,
                "timed_steps": len(times),
                "state_bytes_per_param": None if opt is None else bytes_per_param(opt),
                "gb_per_s": nominal_bytes(params, opt) / seconds / 1e9,
                "peak_extra_x_param_bytes": None if extra is None else extra / p_bytes,
                "first_step_cold_ms": None if cold is None else cold * 1e3,
                "first_step_warm_ms": None if warm is None else warm * 1e3,
            }
        )
    base = next(r["ms_per_step"] for r in rows if r["optimizer"] == BASELINE)
    floor = next(r["gb_per_s"] for r in rows if r["optimizer"] == FLOOR)
    for r in rows:
        r["x_fused_adamw"] = r["ms_per_step"] / base
        r["x_add_bandwidth"] = r["gb_per_s"] / floor
    return rows


# ------------------------------------------------------------------------- report
def _cell(value, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def markdown(result: dict) -> str:
    """The tables of one run, one per dtype."""
    lines = [
        f"{result['model']}: {result['parameters']:,} parameters in "
        f"{result['tensors']} tensors on {result['device']} (torch "
        f"{result['torch']}, {result['threads']} threads); median of up to "
        f"{result['repeats']} round-robin steps; load average "
        f"{result['load_before']:.1f} before, {result['load_after']:.1f} after.",
        "",
    ]
    header = (
        "| optimizer | ms/step | x fused AdamW | state B/param | GB/s | x add_ GB/s "
        "| peak extra x param bytes | first step cold ms | warm ms |"
    )
    for dtype, rows in result["dtypes"].items():
        lines += [f"**{dtype} parameters**", "", header, "|" + "---|" * 9]
        for r in rows:
            cells = [
                r["optimizer"],
                _cell(r["ms_per_step"], ".2f"),
                _cell(r["x_fused_adamw"], ".2f"),
                _cell(r["state_bytes_per_param"], ".3f"),
                _cell(r["gb_per_s"], ".1f"),
                _cell(r["x_add_bandwidth"], ".2f"),
                _cell(r["peak_extra_x_param_bytes"], ".3f"),
                _cell(r["first_step_cold_ms"], ".1f"),
                _cell(r["first_step_warm_ms"], ".1f"),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


CLOCKS = ("wall", "cpu")


def dtypes_named(names: Sequence[str]) -> list[torch.dtype]:
    """The torch dtypes ``names`` spell (``"float32"``, ``"bfloat16"``).

    Raises:
        ValueError: a name that is not a torch dtype, named.
    """
    dtypes = []
    for name in names:
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{name!r} is not a torch dtype (float32, bfloat16)")
        dtypes.append(dtype)
    if not dtypes:
        raise ValueError(f"no dtype to measure: {list(names)!r}")
    return dtypes


def run(
    model: str = "gpt2",
    *,
    quick: bool = False,
    device: str | torch.device = "cpu",
    dtypes: Sequence[str] = ("float32", "bfloat16"),
    repeats: int = 20,
    budget_s: float = 60.0,
    threads: int | None = None,
    clock: str = "wall",
) -> dict:
    """:func:`measure` for each of ``dtypes`` over ``model``'s shapes, with what the
    tables' heading says (device, torch, threads, parameter count, load average).

    Args:
        model: a key of :data:`MODELS`; ignored when ``quick``.
        quick: GPT-2's layout at a tiny size (:func:`quick_shapes`), seconds on CPU.
        device: ``"cpu"`` or ``"cuda"`` (``"cuda:N"``).
        dtypes: the parameters' and gradients' dtypes, one table each.
        repeats: timed rounds at most (after one warm-up round).
        budget_s: per dtype, no new round once 3 are timed and this many seconds
            have passed.
        threads: ``torch.set_num_threads`` for the run; None leaves it.
        clock: on CPU, ``"wall"`` (``time.perf_counter``) or ``"cpu"`` (the
            process's CPU time, for one thread on a busy machine); CUDA events on a
            GPU either way.

    Returns:
        The run as plain data: :func:`markdown` renders it, JSON holds it.

    Raises:
        ValueError: an unknown model, dtype or clock, ``repeats`` < 1, ``budget_s``
            <= 0, ``threads`` < 1, or a CUDA device where there is none.
    """
    if not quick and model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose from {sorted(MODELS)}")
    if clock not in CLOCKS:
        raise ValueError(f"unknown clock {clock!r}; choose from {list(CLOCKS)}")
    if repeats < 1:  # measure checks these too, but only after the first dtype
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    if not budget_s > 0:
        raise ValueError(f"budget_s must be positive, got {budget_s}")
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    dtype_list = dtypes_named(dtypes)
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r}: CUDA is not available here")
    if threads is not None:
        torch.set_num_threads(threads)
    shapes = quick_shapes() if quick else MODELS[model]()
    timer = Clock(device, time.process_time if clock == "cpu" else time.perf_counter)
    load_before = os.getloadavg()[0]
    tables = {
        name: measure(
            shapes, dtype, device, repeats=repeats, budget_s=budget_s, clock=timer
        )
        for name, dtype in zip(dtypes, dtype_list, strict=True)
    }
    return {
        "model": "gpt2 (quick)" if quick else model,
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "clock": "cuda events" if device.type == "cuda" else clock,
        "parameters": sum(math.prod(s) for s in shapes),
        "tensors": len(shapes),
        "repeats": repeats,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "dtypes": tables,
    }
