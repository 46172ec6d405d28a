"""Training patterns x optimizer and layer-parallel axes (docs/patterns.md,
"Optimizers and layer-parallel"): each cell equals its plain reference within the
tolerance of the table below, or raises an error naming the pattern.

Gefen axes (8-bit, 4-bit, GefenMuon) run a pattern against the plain loop it stands
for; ``gefen_as_adamw`` runs ``Gefen(partition="element", momentum_bits=None)``
against ``torch.optim.AdamW`` under the same pattern; ``layer_parallel`` runs a tiny
GPT (a conv ODE for channels_last) with its stack as ``LayerParallel`` iterated to
exactness against the serial stack under the same pattern, trained with SGD.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math

import pytest
import torch

from leantrain.layer_parallel import Controller
from tests._helpers.launchers import run_distributed
from tests._helpers.optim_patterns import (
    FROZEN,
    OPTIMIZERS,
    STEPS,
    ConvNet,
    Loop,
    adamw,
    batches,
    depth_model,
    gefen_as_adamw,
    no_sync_worker,
    sgd,
    train,
)

BF16, FP16 = torch.bfloat16, torch.float16

# pattern: (the loop, the plain loop it must equal, tolerance on the Gefen axes;
# 0 is bit for bit). A tolerance is relative: max |a - b| <= tol * max |b| per tensor.
PATTERNS = {
    "compile_model": (Loop(compile_model=True), Loop(), 0.0),
    "compile_step": (Loop(compile_step=True), Loop(), 0.0),
    "checkpoint_reentrant": (Loop(reentrant=True), Loop(), 0.0),
    "checkpoint": (Loop(reentrant=False), Loop(), 0.0),
    # opt.step() inside the autocast block vs after it
    "autocast_bf16": (Loop(amp=BF16, step_in_amp=True), Loop(amp=BF16), 0.0),
    # GradScaler (the first step's loss inf) vs the unscaled gradients by hand, where
    # the inf step meets Gefen's own nonfinite="skip"
    "grad_scaler_fp16": (
        Loop(amp=FP16, scaler=True, inf_at=0),
        Loop(amp=FP16, manual_scale=True, inf_at=0),
        0.0,
    ),
    # 4 micro-batches vs one batch of their union, float64 parameters
    "accumulate": (Loop(micro=4, float64=True), Loop(float64=True), 1e-7),
    # clip_grad_norm_ vs its arithmetic written out
    "clip_grad_norm": (Loop(clip="torch"), Loop(clip="manual"), 0.0),
    # requires_grad toggled vs gradients set to None by hand
    "frozen": (Loop(frozen="requires_grad"), Loop(frozen="none"), 0.0),
    # channels_last weights vs a contiguous twin stepped with the same gradients
    "channels_last": (
        Loop(channels_last=True),
        Loop(channels_last=True, shadow=True),
        0.0,
    ),
}
# Gefen(element, fp32 momentum) vs AdamW: the same maths, rounded by another kernel
# (a few ulps apart after 4 steps)
ADAMW_TOL = 1e-5

# layer_parallel: tolerance vs the serial stack (float64; fp32 under autocast), or
# the error it raises.
LP_TOL = {
    "autocast_bf16": 1e-5,
    "grad_scaler_fp16": 1e-5,
}
LP_REFUSED = {
    "checkpoint_reentrant": (RuntimeError, "LayerParallel.*use_reentrant=False"),
}


def assert_close(got, want, tol: float) -> None:
    for (name, a), b in zip(got.named_parameters(), want.parameters(), strict=True):
        a, b = a.detach(), b.detach()
        if tol == 0.0:
            assert torch.equal(a, b), (name, (a - b).abs().max().item())
        else:
            err = ((a - b).abs().max() / b.abs().max()).item()
            assert err <= tol, (name, err)


def _steps_taken(model, opt) -> dict[str, int]:
    return {n: int(opt.state[p]["step"]) for n, p in model.named_parameters()}


def _expected_steps(model, loop: Loop) -> dict[str, int]:
    """How many steps AdamW takes per parameter: one per finite step in which it
    has a gradient (none while frozen, none on GradScaler's skipped step)."""
    frozen = {id(p): k for k, m in enumerate(model.freezable) for p in m.parameters()}
    out = {}
    for name, p in model.named_parameters():
        steps = range(STEPS) if loop.inf_at is None else range(1, STEPS)
        if loop.frozen is not None and id(p) in frozen:
            steps = [i for i in steps if frozen[id(p)] not in FROZEN[i]]
        out[name] = len(steps)
    return out


@pytest.mark.parametrize("axis", list(OPTIMIZERS))
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_gefen_pattern_equals_plain_loop(pattern, axis):
    loop, reference, tol = PATTERNS[pattern]
    model, opt = train(loop, ConvNet, OPTIMIZERS[axis])
    want, want_opt = train(reference, ConvNet, OPTIMIZERS[axis])
    assert model.l1.weight.ne(ConvNet().l1.weight.to(model.l1.weight)).any()
    assert_close(model, want, tol)
    assert _steps_taken(model, opt) == _expected_steps(model, loop)
    if loop.scaler:  # the scaler skipped the inf step; Gefen never saw it
        assert opt.nonfinite_steps == 0 and want_opt.nonfinite_steps == 1
    if loop.micro > 1:  # the codebook is learned from the completed gradient
        for p, q in zip(model.parameters(), want.parameters(), strict=True):
            assert torch.equal(opt.state[p]["codebook"], want_opt.state[q]["codebook"])


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_gefen_as_adamw_under_pattern(pattern):
    loop = PATTERNS[pattern][0]
    model, opt = train(loop, ConvNet, gefen_as_adamw)
    # torch.compile(AdamW.step) is not eager AdamW (3e-5 apart here); Gefen's
    # compiled step runs eagerly, so its reference is the eager AdamW step
    want_loop = Loop() if loop.compile_step else loop
    want, want_opt = train(want_loop, ConvNet, adamw)
    assert_close(model, want, ADAMW_TOL)
    assert _steps_taken(model, opt) == _steps_taken(want, want_opt)


def _serial_mode(loop):
    model = depth_model(loop, layer_parallel=True)
    model.stack.serial()
    return model


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_layer_parallel_pattern_equals_serial(pattern):
    loop = PATTERNS[pattern][0]
    parallel = functools.partial(depth_model, layer_parallel=True)
    if pattern in LP_REFUSED:
        error, match = LP_REFUSED[pattern]
        with pytest.raises(error, match=match):
            train(loop, parallel, sgd)
        model, _ = train(loop, _serial_mode, sgd)  # the error's other way out
        want, _ = train(loop, functools.partial(depth_model, layer_parallel=False), sgd)
        assert_close(model, want, 0.0)
        return
    model, _ = train(loop, parallel, sgd)
    want, _ = train(loop, functools.partial(depth_model, layer_parallel=False), sgd)
    assert model.stack.stats.forward.iterations == 2
    assert_close(model, want, LP_TOL.get(pattern, 1e-10))


# On CUDA, the patterns a GPU changes most: torch.compile, autocast, and a GradScaler
# with a real overflow step. Each CUDA loop is checked against its plain reference
# on CUDA (the table's tolerance; Gefen's CPU loops agree bit for bit, a CUDA
# kernel may move a code by one), and against the same loop on the CPU (other
# kernels: TF32 convolutions by default, other bf16/fp16 matmul rounding).
CUDA_PATTERNS = ("compile_model", "autocast_bf16", "grad_scaler_fp16")
CUDA_TOL = 1e-4
CUDA_VS_CPU_TOL = 2e-2


def _require(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device")


@pytest.mark.gpu
@pytest.mark.parametrize("axis", list(OPTIMIZERS))
@pytest.mark.parametrize("pattern", CUDA_PATTERNS)
def test_gefen_pattern_on_cuda(pattern, axis):
    _require("cuda")
    loop, reference, tol = PATTERNS[pattern]
    cuda = dataclasses.replace(loop, device="cuda")
    model, opt = train(cuda, ConvNet, OPTIMIZERS[axis])
    want, _ = train(
        dataclasses.replace(reference, device="cuda"), ConvNet, OPTIMIZERS[axis]
    )
    assert all(p.is_cuda for p in model.parameters())
    assert all(
        t.is_cuda for state in opt.state.values() for t in state.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )  # fmt: skip
    assert_close(model, want, max(tol, CUDA_TOL))
    assert _steps_taken(model, opt) == _expected_steps(model, loop)
    if loop.scaler:  # the scaler skipped the overflow step; Gefen never saw it
        assert opt.nonfinite_steps == 0
    on_cpu, _ = train(loop, ConvNet, OPTIMIZERS[axis])
    assert_close(copy.deepcopy(model).cpu(), on_cpu, CUDA_VS_CPU_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("pattern", CUDA_PATTERNS)
def test_layer_parallel_pattern_on_cuda(pattern):
    _require("cuda")
    loop = dataclasses.replace(PATTERNS[pattern][0], device="cuda")
    model, _ = train(loop, functools.partial(depth_model, layer_parallel=True), sgd)
    want, _ = train(loop, functools.partial(depth_model, layer_parallel=False), sgd)
    assert all(p.is_cuda for p in model.parameters())
    assert model.stack.stats.forward.iterations == 2
    assert_close(model, want, LP_TOL.get(pattern, 1e-10))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_layer_parallel_controller_waits_out_a_grad_scaler_overflow(device):
    """A check batch whose scaled loss overflowed measures nothing (the adjoint
    starts from inf): the Controller checks the next batch instead of switching
    the stack to serial."""
    _require(device)
    model = depth_model(Loop(amp=FP16), layer_parallel=True).to(device)
    ctrl = Controller(model, every=2, policy="serial")
    opt, scaler = sgd(model), torch.amp.GradScaler(device, init_scale=2.0**8)
    for i, (x, y) in enumerate(batches(model, torch.float32, device)):
        opt.zero_grad()
        with torch.autocast(device, dtype=FP16):
            loss = (model(x).float() - y).square().mean()
        scaler.scale(loss * (math.inf if i == 0 else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
        ctrl.step()
    assert scaler.get_scale() == 2.0**7  # the first step overflowed and was skipped
    assert not ctrl.switched
    assert [(d.batch, d.action) for d in ctrl.records] == [(1, "keep"), (2, "keep")]


@pytest.mark.distributed
def test_no_sync_accumulation_equals_union_batch():
    """DDP over 2 gloo ranks, 2 micro-batches each, the first under no_sync, equals
    one process stepping the union batch (float64): every axis in one spawn."""
    for errors in run_distributed(no_sync_worker, 2):
        for axis in OPTIMIZERS:
            assert errors[axis] <= PATTERNS["accumulate"][2], (axis, errors)
        assert errors["gefen_as_adamw"] <= ADAMW_TOL, errors
        assert errors["layer_parallel"] <= 1e-10, errors


@pytest.mark.slow
@pytest.mark.parametrize("axis", ["gefen8", "layer_parallel"])
def test_inductor_compiled_model(axis):
    """torch.compile's default backend (inductor) reorders float arithmetic: Gefen
    matches the eager model to 1e-5; LayerParallel (a graph break at its MGRIT
    solve) matches the compiled serial stack to 1e-10."""
    if axis == "gefen8":
        eager, _ = train(Loop(), ConvNet, OPTIMIZERS["gefen8"])
        model, _ = train(Loop(compile_model="inductor"), ConvNet, OPTIMIZERS["gefen8"])
        assert_close(model, eager, 1e-5)
        return
    loop = Loop(compile_model="inductor")
    model, _ = train(loop, functools.partial(depth_model, layer_parallel=True), sgd)
    want, _ = train(loop, functools.partial(depth_model, layer_parallel=False), sgd)
    assert_close(model, want, 1e-10)
