"""The measured sections of ``scripts/gpu_check.sh``: each takes a :class:`Size` and a
device and returns plain data (lists of rows, numbers) that ``gpu_check.py`` writes
into the report.

* :func:`optimizer_step` — one optimizer step over GPT-2 small's parameter shapes:
  fused and foreach AdamW, Gefen 8-bit and 4-bit, bitsandbytes 8-bit when it is
  importable, and ``p.add_(g)`` over the same tensors (the memory-traffic floor).
* :func:`precond_step` — whole training steps of a GPT in the user's loop:
  ``AdamW(fused=True)`` alone and wrapped by ``precondition_in_loop`` (K-FAC with the
  Monte-Carlo and the empirical Fisher, Shampoo; curvature and preconditioner every
  10 steps).
* :func:`training` — a short run of AdamW against Gefen 8-bit and 4-bit from the same
  init on the embedded text, each stopped at a step count or a time budget.
* :func:`depth` — the layer-parallel axis's inputs measured on the device (the four
  kinds of layer step per micro-batch count, the work outside the stack, the cost of
  moving a state) fed to the schedule simulator: MGRIT against the best pipeline.

Times on CUDA come from CUDA events after warm-up; on CPU (``--quick``) from the
wall clock. Each is the median over the timed repeats.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from leantrain.data import TokenBatches, load_stdlib_text
from leantrain.layer_parallel.costs.projection import (
    MGRITSetting,
    project,
    projection_table,
)
from leantrain.layer_parallel.costs.simulate import CommModel
from leantrain.layer_parallel.costs.timing import LayerSampler, OutsideSampler
from leantrain.models import GPT, GPTConfig, lm_loss
from leantrain.optim import Gefen
from leantrain.optim.memory import bytes_per_param
from leantrain.precond import precondition_in_loop


@dataclass(frozen=True)
class Size:
    """How big and how long each section runs (``FULL`` on a GPU, ``QUICK`` on CPU)."""

    # optimizer step: GPT-2 small's shapes (124.4 M parameters, 148 tensors)
    opt_layers: int = 12
    opt_width: int = 768
    opt_vocab: int = 50257
    opt_context: int = 1024
    opt_steps: int = 20
    opt_budget_s: float = 6.0  # per optimizer and dtype: a slow step stops at 3 timed
    # the GPT of the preconditioning, training and depth sections
    layers: int = 12
    width: int = 768
    heads: int = 12
    tokens: int = 256
    precond_batch: int = 16
    precond_steps: int = 30
    train_batch: int = 32
    train_steps: int = 300
    train_budget_s: float = 40.0  # per optimizer
    depth_reps: int = 5
    depths: tuple[int, ...] = (16, 32, 64, 128, 256)
    ranks: tuple[int, ...] = (8,)


FULL = Size()
QUICK = Size(
    opt_layers=2, opt_width=64, opt_vocab=512, opt_context=64, opt_steps=3,
    opt_budget_s=5.0, layers=2, width=64, heads=2, tokens=32, precond_batch=4,
    precond_steps=4, train_batch=4, train_steps=12, train_budget_s=10.0, depth_reps=2,
    depths=(16, 32),
)  # fmt: skip


class Clock:
    """Seconds of one call: CUDA events on a GPU (the queue drained after each call),
    the wall clock on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        """A wall-clock reading after the device's queue has drained."""
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def time(self, fn: Callable[[], object]) -> float:
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def gpt2_shapes(layers: int, width: int, vocab: int, context: int) -> list[tuple]:
    """GPT-2's parameter shapes: embeddings, per layer LayerNorms, qkv, attention
    projection, MLP up and down (weights and biases), final LayerNorm."""
    d = width
    shapes: list[tuple] = [(vocab, d), (context, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,)]
        shapes += [(d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return shapes + [(d,), (d,)]


def _optimizers(device: torch.device) -> dict[str, Callable]:
    makers: dict[str, Callable] = {
        "AdamW(fused=True)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
        "AdamW(foreach=True)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
        "Gefen 8-bit": lambda ps: Gefen(ps, lr=1e-3),
        "Gefen 4-bit": lambda ps: Gefen(ps, lr=1e-3, momentum_bits=4),
    }
    if device.type == "cuda":
        try:
            import bitsandbytes as bnb

            makers["bitsandbytes AdamW8bit"] = lambda ps: bnb.optim.AdamW8bit(
                ps, lr=1e-3
            )
        except ImportError:
            pass
    return makers


class _AddFloor:
    """``p.add_(g)`` over every tensor: what one read-modify-write pass costs."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params

    def step(self) -> None:
        with torch.no_grad():
            for p in self.params:
                p.add_(p.grad, alpha=-1e-3)


def _params(shapes, dtype, device, seed=0) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    params = []
    for shape in shapes:
        p = (torch.randn(shape, generator=g, device=device) * 0.02).to(dtype)
        p.requires_grad_(True)
        p.grad = (torch.randn(shape, generator=g, device=device) * 1e-3).to(dtype)
        params.append(p)
    return params


def optimizer_step(size: Size, device: torch.device, dtypes=("float32", "bfloat16")):
    """Rows per dtype and optimizer: first step, median step, ratio to fused AdamW,
    state bytes per parameter and (CUDA) the peak memory a step adds."""
    clock = Clock(device)
    shapes = gpt2_shapes(
        size.opt_layers, size.opt_width, size.opt_vocab, size.opt_context
    )
    numel = sum(math.prod(s) for s in shapes)
    rows = []
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        cases = dict(_optimizers(device))
        cases["p.add_(g) (traffic floor)"] = _AddFloor
        base = None
        for name, make in cases.items():
            params = _params(shapes, dtype, device)
            opt = make(params)
            first = clock.time(opt.step)
            times, started = [], time.perf_counter()
            while len(times) < size.opt_steps and (
                len(times) < 3 or time.perf_counter() - started < size.opt_budget_s
            ):
                times.append(clock.time(opt.step))
            peak = None
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
                opt.step()
                peak = (torch.cuda.max_memory_allocated(device) - before) / (
                    numel * params[0].element_size()
                )
            median = statistics.median(times)
            base = median if base is None else base
            state = None if isinstance(opt, _AddFloor) else bytes_per_param(opt)
            rows.append(
                {
                    "dtype": dtype_name,
                    "optimizer": name,
                    "first_step_ms": first * 1e3,
                    "step_ms": median * 1e3,
                    "timed_steps": len(times),
                    "x_fused_adamw": median / base,
                    "state_bytes_per_param": state,
                    "peak_extra_per_param_bytes": peak,
                }
            )
            del opt, params
    return {"parameters": numel, "tensors": len(shapes), "rows": rows}


def _gpt(size: Size, device: torch.device, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    config = GPTConfig(
        n_layer=size.layers, d_model=size.width, n_head=size.heads,
        block_size=size.tokens,
    )  # fmt: skip
    return GPT(config).to(device)


def _autocast(device: torch.device):
    # bf16 autocast is how these models train on a GPU; on CPU it only slows the check
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


PRECOND_LOOPS = {
    "AdamW(fused)": None,
    "K-FAC, MC Fisher (kfac)": ("kfac", {}),
    "K-FAC, empirical Fisher (kfac)": ("kfac", {"fisher_type": "fisher_emp"}),
    "Shampoo (shampoo)": ("shampoo", {}),
}


def precond_step(size: Size, device: torch.device, warmup: int = 3):
    """Per loop: median, mean and max ms of a whole training step and mean x AdamW's."""
    clock = Clock(device)
    base_model = _gpt(size, device)
    g = torch.Generator(device=device).manual_seed(0)
    shape = (size.precond_batch, size.tokens)
    x = torch.randint(0, 256, shape, generator=g, device=device)
    y = torch.randint(0, 256, shape, generator=g, device=device)
    rows = []
    for name, spec in PRECOND_LOOPS.items():
        model = copy.deepcopy(base_model)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
        if spec is not None:
            method, kwargs = spec
            # the position table sees (T,) positions, not the batch
            config = {"ignore_modules": ("wpe",)}
            opt = precondition_in_loop(opt, model, method, config=config, **kwargs)

        def step(model=model, opt=opt) -> None:
            opt.zero_grad(set_to_none=True)
            with _autocast(device):
                loss = lm_loss(model(x), y)
            loss.backward()
            opt.step()

        times = [clock.time(step) for _ in range(warmup + size.precond_steps)]
        times = times[warmup:]
        rows.append(
            {
                "loop": name,
                "median_ms": statistics.median(times) * 1e3,
                "mean_ms": statistics.fmean(times) * 1e3,
                "max_ms": max(times) * 1e3,
            }
        )
        del model, opt
    for row in rows:
        row["mean_x_adamw"] = row["mean_ms"] / rows[0]["mean_ms"]
        row["median_x_adamw"] = row["median_ms"] / rows[0]["median_ms"]
    return {"parameters": base_model.num_params(), "batch": list(shape), "rows": rows}


TRAIN_OPTIMIZERS = {
    "AdamW(fused)": lambda ps: torch.optim.AdamW(ps, lr=6e-4, fused=True),
    "Gefen 8-bit": lambda ps: Gefen(ps, lr=6e-4),
    "Gefen 4-bit": lambda ps: Gefen(ps, lr=6e-4, momentum_bits=4),
}


def _val_loss(model: GPT, batches, device) -> float:
    with torch.no_grad(), _autocast(device):
        losses = [lm_loss(model(x), y) for x, y in batches]
    return float(torch.stack(losses).float().mean())


def training(size: Size, device: torch.device, warmup: int = 3):
    """Each optimizer from the same init on the same batches until ``train_steps`` or
    ``train_budget_s``: steps reached, ms per step, the training loss at the step all
    reached (mean of the 10 before it) over AdamW's, the held-out loss at the end."""
    corpus = load_stdlib_text()
    base_model = _gpt(size, device)
    val = TokenBatches(corpus.val, block_size=size.tokens, batch_size=8, seed=1)
    val_batches = [tuple(t.to(device) for t in val.sample()) for _ in range(8)]
    runs = {}
    for name, make in TRAIN_OPTIMIZERS.items():
        model = copy.deepcopy(base_model)
        opt = make(model.parameters())
        batches = TokenBatches(
            corpus.train, block_size=size.tokens, batch_size=size.train_batch, seed=0
        )
        losses, marks = [], []
        started = None
        for step in range(size.train_steps):
            if step == warmup:
                started = Clock(device).now()
            x, y = (t.to(device, non_blocking=True) for t in batches.sample())
            with _autocast(device):
                loss = lm_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
            if started is not None and step % 10 == 9:
                marks.append((step + 1, Clock(device).now() - started))
                if marks[-1][1] > size.train_budget_s:
                    break
        done = len(losses)
        timed = Clock(device).now() - started if started is not None else math.nan
        runs[name] = {
            "steps": done,
            "ms_per_step": timed / max(done - warmup, 1) * 1e3,
            "losses": torch.stack(losses).float().tolist(),
            "val_loss": _val_loss(model, val_batches, device),
        }
        del model, opt
    common = min(r["steps"] for r in runs.values())
    window = slice(max(common - 10, 0), common)
    base = statistics.fmean(runs["AdamW(fused)"]["losses"][window])
    for r in runs.values():
        r["loss_at_common"] = statistics.fmean(r["losses"][window])
        r["loss_x_adamw"] = r["loss_at_common"] / base
    return {
        "parameters": base_model.num_params(),
        "batch": [size.train_batch, size.tokens],
        "common_step": common,
        "runs": runs,
    }


def _copy_cost(device: torch.device, numel: int, through_host: bool) -> float:
    """Seconds to move ``numel`` fp32 values device to device, or (``through_host``)
    device -> pinned host -> device: half a round trip, as a message."""
    clock = Clock(device)
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    pin = device.type == "cuda" and through_host
    host = torch.empty(numel, pin_memory=pin) if through_host else None

    def move() -> None:
        if host is not None:
            host.copy_(src, non_blocking=pin)
            dst.copy_(host, non_blocking=pin)
        else:
            dst.copy_(src)

    move()
    cost = statistics.median(clock.time(move) for _ in range(9))
    return cost / 2 if through_host else cost


def _comm_model(device: torch.device, through_host: bool) -> CommModel:
    small = _copy_cost(device, 2, through_host)
    big_numel = 1 << 22
    big = _copy_cost(device, big_numel, through_host)
    return CommModel(latency=small, bandwidth=big_numel * 4 / max(big - small, big / 2))


DEPTH_SETTINGS = (
    MGRITSetting(levels=2, cf=4, fwd_iters=1, bwd_iters=1),
    MGRITSetting(levels=2, cf=4, fwd_iters=2, bwd_iters=1),
    MGRITSetting(levels=2, cf=4, fwd_iters=0, bwd_iters=1),
    MGRITSetting(levels=3, cf=4, fwd_iters=1, bwd_iters=1),
)
NOMINAL_INTERCONNECT = CommModel(latency=1e-5, bandwidth=25e9)


def depth(size: Size, device: torch.device, micro_batches=(1, 2, 4, 8)):
    """Layer and outside times per micro-batch count, the two measured message
    models, and the projected pipeline / MGRIT step ratios for each message model."""
    clock = Clock(device).now
    model = _gpt(size, device)
    batch = size.train_batch
    block = model.stack.steps[0]
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(batch, size.tokens, size.width, generator=g, device=device)
    idx = torch.randint(0, 256, (batch, size.tokens), generator=g, device=device)
    times, outside = {}, {}
    for m in micro_batches:
        mb = batch // m
        layer = LayerSampler(block, x[:mb], 1 / 64, clock=clock)
        ends = OutsideSampler(
            copy.deepcopy(model), (idx[:mb], idx[:mb]), 1e-3, clock, loss_fn=lm_loss
        )
        for _ in range(size.depth_reps + 1):  # the first is a warm-up
            layer()
            ends()
        layer.samples, ends.samples = layer.samples[1:], ends.samples[1:]
        times[m], outside[m] = layer.times(), ends.times()
    state_bytes = batch * size.tokens * size.width * 4
    comms = {
        "device copy (NVLink-like floor)": _comm_model(device, through_host=False),
        "through pinned host (no peer access)": _comm_model(device, through_host=True),
        "nominal interconnect (10 us, 25 GB/s)": NOMINAL_INTERCONNECT,
    }
    projections = {}
    for name, comm in comms.items():
        cells = project(
            size.depths, size.ranks, times, DEPTH_SETTINGS, comm, state_bytes, outside
        )
        projections[name] = {
            "latency_us": comm.latency * 1e6,
            "bandwidth_gb_s": comm.bandwidth / 1e9,
            "table": projection_table(cells),
            "cells": [
                {
                    "depth": c.depth,
                    "ranks": c.ranks,
                    "serial_ms": c.serial * 1e3,
                    "pipeline_ms": None if c.pipeline is None else c.pipeline * 1e3,
                    "pipeline": c.pipeline_label,
                    "mgrit_ms": None if c.mgrit is None else c.mgrit * 1e3,
                    "mgrit": c.mgrit_label,
                }  # fmt: skip
                for c in cells
            ],
        }
    layer_ms = {m: {k: v * 1e3 for k, v in vars(t).items()} for m, t in times.items()}
    return {
        "state_bytes": state_bytes,
        "layer_ms_by_micro_batches": layer_ms,
        "projections": projections,
    }
