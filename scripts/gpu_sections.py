"""The measured sections of ``scripts/gpu_check.sh``: each takes a :class:`Size` and a
device and returns plain data (lists of rows, numbers) that ``gpu_check.py`` writes
into the report.

* :func:`optimizer_step` — one optimizer step over GPT-2 small's parameter shapes,
  measured by :func:`leantrain.compare.optimizer_step.measure` (the measurement
  ``benchmarks/gefen_step.py`` prints; its contenders: fused and foreach AdamW, Gefen
  8-bit and 4-bit at their defaults and 8-bit with blocks ``v``, bitsandbytes' and
  torchao's 8-bit AdamW when importable, and ``p.add_(g)`` over the same tensors, the
  memory-traffic floor). This section is the check's only optimizer-step measurement:
  ``gpu_check.sh`` does not run ``benchmarks/gefen_step.py`` besides, so GPU time
  pays for it once.
* :func:`precond_step` — whole training steps of a GPT in the user's loop, measured
  by :func:`leantrain.compare.precond_step.measure` (what
  ``benchmarks/precond_step.py --schedule`` prints on CPU): ``AdamW(fused=True)``
  alone, and per method (K-FAC with the Monte-Carlo and the empirical Fisher,
  EKFAC, Shampoo around that AdamW; SOAP around SGD without momentum) a plain step
  (the preconditioner only applied), a refresh step (curvature and preconditioner
  updated) and, where the registry's schedule has them, a curvature-only step; the
  mean step of a run on the registry's schedule (``kfac`` every 20 steps, ``ekfac``
  every 10, ``shampoo`` statistics every 10 and roots every 100, ``soap`` statistics
  every step and bases every 10) follows from the three, as ratios to AdamW's.
* :func:`training` — a short run of AdamW against Gefen 8-bit and 4-bit from the same
  init on the embedded text, each stopped at a step count or a time budget.
* :func:`depth` — the layer-parallel axis's inputs measured on the device (the four
  kinds of layer step per micro-batch count, the work outside the stack, the cost of
  moving a state) fed to the schedule simulator: MGRIT against the best pipeline.

Times on CUDA come from CUDA events after warm-up
(``leantrain.compare.optimizer_step.Clock``); on CPU (``--quick``) from the wall
clock. Each is the median over the timed repeats.
"""

from __future__ import annotations

import copy
import math
import statistics
from dataclasses import dataclass

import torch

from leantrain.compare.devices import device_clock
from leantrain.compare.optimizer_step import Clock, gpt2_shapes, measure
from leantrain.compare.precond_step import PrecondMethod
from leantrain.compare.precond_step import measure as measure_precond_step
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


@dataclass(frozen=True)
class Size:
    """How big and how long each section runs (``FULL`` on a GPU, ``QUICK`` on CPU)."""

    # optimizer step: GPT-2 small's shapes (124.4 M parameters, 148 tensors)
    opt_layers: int = 12
    opt_width: int = 768
    opt_vocab: int = 50257
    opt_context: int = 1024
    opt_steps: int = 20
    opt_budget_s: float = 30.0  # per dtype: past it, no new round once 3 are timed
    # the GPT of the preconditioning, training and depth sections
    layers: int = 12
    width: int = 768
    heads: int = 12
    tokens: int = 256
    precond_batch: int = 16
    # Reference and plain arms: warm-up (step 0 refreshes) then timed steps; the
    # curvature and refresh arms time few steps (a Shampoo refresh is an eigh of
    # every factor): the section stays within ~90 s on an H200 (not yet timed).
    precond_warmup: int = 2
    precond_steps: int = 20
    precond_refresh_warmup: int = 1
    precond_refresh_steps: int = 3
    train_batch: int = 32
    train_steps: int = 300
    train_budget_s: float = 30.0  # per optimizer
    depth_reps: int = 5
    depths: tuple[int, ...] = (16, 32, 64, 128, 256)
    ranks: tuple[int, ...] = (8,)


FULL = Size()
QUICK = Size(
    opt_layers=2, opt_width=64, opt_vocab=512, opt_context=64, opt_steps=3,
    opt_budget_s=5.0, layers=2, width=64, heads=2, tokens=32, precond_batch=4,
    precond_warmup=1, precond_steps=2, precond_refresh_warmup=1,
    precond_refresh_steps=1, train_batch=4, train_steps=12, train_budget_s=10.0,
    depth_reps=2, depths=(16, 32),
)  # fmt: skip


def optimizer_step(size: Size, device: torch.device, dtypes=("float32", "bfloat16")):
    """:func:`leantrain.compare.optimizer_step.measure` at ``size``'s GPT-2 layout: per
    dtype, every contender round-robin on the same fixed gradients, ``opt_steps``
    rounds at most and none started past ``opt_budget_s`` once 3 are timed; one row
    per dtype and contender (``measure``'s row, with its dtype)."""
    shapes = gpt2_shapes(
        size.opt_layers, size.opt_width, size.opt_vocab, size.opt_context
    )
    rows = []
    for name in dtypes:
        measured = measure(
            shapes,
            getattr(torch, name),
            device,
            repeats=size.opt_steps,
            budget_s=size.opt_budget_s,
            clock=Clock(device),
        )
        rows += [{"dtype": name, **row} for row in measured]
    parameters = sum(math.prod(s) for s in shapes)
    return {"parameters": parameters, "tensors": len(shapes), "rows": rows}


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


# The section's methods in the user's loop, each around the base it expects.
PRECOND_METHODS = (
    PrecondMethod("kfac", "K-FAC, MC Fisher (kfac)"),
    PrecondMethod(
        "kfac", "K-FAC, empirical Fisher (kfac)", {"fisher_type": "fisher_emp"}
    ),
    PrecondMethod("ekfac", "EKFAC (ekfac)"),
    PrecondMethod("shampoo", "Shampoo (shampoo)"),
    PrecondMethod("soap", "SOAP (soap)"),
)
PRECOND_REFERENCE = "AdamW(fused)"
PRECOND_LR = 3e-4


def _precond_base(method: str, params) -> torch.optim.Optimizer:
    # SOAP's direction already carries Adam's moments (the registry's comment):
    # it wraps SGD without momentum; the others wrap the user's AdamW.
    if method == "soap":
        return torch.optim.SGD(params, lr=PRECOND_LR)
    return torch.optim.AdamW(params, lr=PRECOND_LR, fused=True)


def precond_step(size: Size, device: torch.device):
    """:func:`leantrain.compare.precond_step.measure` on the section's GPT: per arm
    the median ms of a whole step and its ratio to AdamW(fused)'s; per method the
    registry's schedule (C, I), the plain step, the refresh step and the mean step
    of a run on that schedule, as ratios to AdamW's. On a GPU each method's arms are
    built, timed and freed before the next's (``per_method``: one method's model
    copies in memory at a time); on CPU all arms take turns (fair under load)."""
    model = _gpt(size, device)
    g = torch.Generator(device=device).manual_seed(0)
    shape = (size.precond_batch, size.tokens)
    x = torch.randint(0, 256, shape, generator=g, device=device)
    t = torch.randint(0, 256, shape, generator=g, device=device)
    costs = measure_precond_step(
        model,
        (x, t),
        PRECOND_METHODS,
        base=_precond_base,
        references={
            PRECOND_REFERENCE: lambda ps: torch.optim.AdamW(
                ps, lr=PRECOND_LR, fused=True
            )
        },
        reference=PRECOND_REFERENCE,
        clock=Clock(device),
        steps=size.precond_steps,
        warmup=size.precond_warmup,
        refresh_steps=size.precond_refresh_steps,
        refresh_warmup=size.precond_refresh_warmup,
        forms=("loop",),
        autocast_dtype=torch.bfloat16 if device.type == "cuda" else None,
        per_method=device.type == "cuda",
    )
    arms = [
        {
            "arm": name,
            "method": costs.arms[name][0],
            "kind": costs.arms[name][1],
            "median_ms": sec * 1e3,
            "x_adamw": costs.x_reference(sec),
        }
        for name, sec in costs.medians.items()
    ]
    methods = []
    for m in PRECOND_METHODS:
        label = m.row
        curvature = costs.medians.get(f"{label} curvature")
        methods.append(
            {
                "method": label,
                "registry": m.name,
                "schedule": list(costs.intervals[label]),
                "plain_ms": costs.medians[costs.plain[label]] * 1e3,
                "curvature_ms": None if curvature is None else curvature * 1e3,
                "refresh_ms": costs.medians[f"{label} refresh"] * 1e3,
                "plain_x_adamw": costs.x_reference(costs.medians[costs.plain[label]]),
                "mean_x_adamw": costs.x_reference(costs.means[label]),
                "floor": costs.floors[label],
            }
        )
    return {
        "parameters": model.num_params(),
        "batch": list(shape),
        "reference": PRECOND_REFERENCE,
        "reference_ms": costs.medians[PRECOND_REFERENCE] * 1e3,
        "steps": [size.precond_warmup, size.precond_steps],
        "refresh_steps": [size.precond_refresh_warmup, size.precond_refresh_steps],
        "arms": arms,
        "methods": methods,
    }


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
    now = device_clock(device)
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
                started = now()
            x, y = (t.to(device, non_blocking=True) for t in batches.sample())
            with _autocast(device):
                loss = lm_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
            if started is not None and step % 10 == 9:
                marks.append((step + 1, now() - started))
                if marks[-1][1] > size.train_budget_s:
                    break
        done = len(losses)
        timed = now() - started if started is not None else math.nan
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
    clock = device_clock(device)
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
