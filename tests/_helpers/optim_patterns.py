"""Tiny models and one training loop for tests/patterns/test_patterns_optim.py.

A ``Loop`` names the pattern a run uses (compile, checkpointing, autocast, a grad
scaler, accumulation, clipping, freezing, channels_last); ``train`` runs it on a
model from a builder with an optimizer from a factory, so a pattern and its plain
reference are two ``Loop`` values of one function.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from leantrain.layer_parallel import LayerParallel
from leantrain.models import GPT, GPTConfig
from leantrain.models.blocks import ResidualStack
from leantrain.optim import Gefen, GefenMuon, muon_param_groups

OPTIMIZERS = {
    "gefen8": lambda m: Gefen(m.parameters(), lr=1e-2),
    "gefen4": lambda m: Gefen(m.parameters(), lr=1e-2, momentum_bits=4),
    "gefen_muon": lambda m: GefenMuon(muon_param_groups(m), lr=1e-2, adamw_lr=1e-2),
}


def gefen_as_adamw(model: nn.Module) -> Gefen:
    return Gefen(model.parameters(), lr=1e-2, partition="element", momentum_bits=None)


def adamw(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def sgd(model: nn.Module) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=0.1)


STEPS = 4
# Which of a model's two ``freezable`` parts have requires_grad=False at each step:
# the first is frozen from the start (no state until step 2), the second mid-run.
FROZEN = ({0}, {0, 1}, {1}, set())


@dataclass(frozen=True)
class Loop:
    """One training loop: the plain eager loop unless a field says otherwise."""

    compile_model: bool | str = False  # torch.compile(model): aot_eager, or this
    compile_step: bool = False  # torch.compile(opt.step, backend="aot_eager")
    reentrant: bool | None = None  # checkpoint the layers (None: no checkpointing)
    amp: torch.dtype | None = None  # forward and backward under torch.autocast
    step_in_amp: bool = False  # opt.step() inside the autocast block too
    scaler: bool = False  # torch.amp.GradScaler(device)
    manual_scale: bool = False  # the scaler's scales, unscaled by hand
    inf_at: int | None = None  # the loss is inf at this step
    micro: int = 1  # micro-batches per step (gradient accumulation)
    clip: str | None = None  # "torch" (clip_grad_norm_) or "manual"
    frozen: str | None = None  # "requires_grad" toggles, or "none" (grad = None)
    channels_last: bool = False
    shadow: bool = False  # return a contiguous twin stepped with the same grads
    float64: bool = False
    device: str = "cpu"  # where the model, its batches, autocast and the scaler run


class ConvNet(nn.Module):
    """conv -> conv -> linear -> linear on (B, 3, 6, 6) images; ``loop.reentrant``
    (not None) checkpoints the second convolution (its input needs a gradient, as
    reentrant checkpointing wants)."""

    def __init__(self, loop: Loop = Loop()) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.l1 = nn.Linear(8 * 36, 32)
        self.l2 = nn.Linear(32, 4)
        self.reentrant = loop.reentrant
        self.freezable = (self.c1, self.c2)

    def _body(self, h: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.c2(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.c1(x))
        if self.reentrant is None:
            h = self._body(h)
        else:
            h = checkpoint(self._body, h, use_reentrant=self.reentrant)
        return self.l2(torch.relu(self.l1(h.flatten(1))))


class Checkpointed(nn.Module):
    """A residual step whose forward is activation-checkpointed."""

    def __init__(self, step: nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.step, self.reentrant = step, reentrant

    def forward(self, x: torch.Tensor, dt: float) -> torch.Tensor:
        return checkpoint(self.step, x, dt, use_reentrant=self.reentrant)


class ConvStep(nn.Module):
    """``x + dt * tanh(conv(x))``: a residual step of (B, 4, 6, 6) images."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor, dt: float) -> torch.Tensor:
        return x + dt * torch.tanh(self.conv(x))


class ConvODE(nn.Module):
    """conv stem -> residual stack of ``ConvStep`` -> linear head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.stack = ResidualStack([ConvStep() for _ in range(4)], t_final=1.0)
        self.head = nn.Linear(4 * 36, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stack(self.stem(x)).flatten(1))


def depth_model(loop: Loop, layer_parallel: bool) -> nn.Module:
    """A tiny GPT (``ConvODE`` for channels_last) whose stack is ``LayerParallel``
    iterated to exactness (N = 4, cf = 2: one cycle is exact, two run) or serial."""
    if loop.channels_last:
        model = ConvODE()
    else:
        torch.manual_seed(0)
        config = GPTConfig(
            vocab_size=16, block_size=8, n_layer=4, d_model=16, n_head=2, t_final=1.0
        )
        model = GPT(config)
    steps = list(model.stack.steps)
    if loop.reentrant is not None:
        steps = [Checkpointed(s, loop.reentrant) for s in steps]
    if layer_parallel:
        options = {"cf": 2, "fwd_iters": 2, "bwd_iters": 2, "skip_downcycle": False}
        options["on_divergence"] = "raise"
        model.stack = LayerParallel(steps, t_final=1.0, **options)
    else:
        model.stack = ResidualStack(steps, t_final=1.0)
    model.freezable = (model.stack.steps[0], model.stack.steps[2])
    return model.double() if loop.amp is None else model


def batches(
    model: nn.Module, dtype: torch.dtype, device: str = "cpu"
) -> list[tuple[torch.Tensor, ...]]:
    """``STEPS`` batches of 8 inputs for ``model`` (images, or tokens for GPT), drawn
    on the CPU (the same numbers on every device) and moved to ``device``."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        if isinstance(model, GPT):
            x = torch.randint(0, 16, (8, 8), generator=gen)
            y = torch.randn(8, 8, 16, generator=gen, dtype=dtype)
        else:
            x = torch.randn(8, 3, 6, 6, generator=gen, dtype=dtype)
            y = torch.randn(8, 4, generator=gen, dtype=dtype)
        out.append((x.to(device), y.to(device)))
    return out


def _clip_by_hand(params: list[nn.Parameter], max_norm: float) -> None:
    # clip_grad_norm_'s arithmetic written out: the norm of the per-tensor norms,
    # then every gradient times min(1, max_norm / (norm + 1e-6)).
    grads = [p.grad for p in params if p.grad is not None]
    norms = [torch.linalg.vector_norm(g, 2.0) for g in grads]
    total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)


def train(
    loop: Loop,
    build: Callable[[Loop], nn.Module],
    make_opt: Callable[[nn.Module], torch.optim.Optimizer],
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``STEPS`` steps of ``loop``; returns the model and optimizer (the contiguous
    twin's with ``shadow``)."""
    model = build(loop).to(loop.device)
    if loop.float64:
        model = model.double()
    if loop.channels_last:
        model = model.to(memory_format=torch.channels_last)
    opt = make_opt(model)
    twin = None
    if loop.shadow:
        twin = build(Loop()).to(next(model.parameters()))
        twin.opt = make_opt(twin)
    with warnings.catch_warnings():
        # an inf loss: Gefen warns of the step it skips
        warnings.simplefilter("ignore", RuntimeWarning)
        _run(loop, model, opt, twin)
    return (twin, twin.opt) if twin is not None else (model, opt)


def _run(
    loop: Loop, model: nn.Module, opt: torch.optim.Optimizer, twin: nn.Module | None
) -> None:
    forward, step = model, opt.step
    if loop.compile_model:
        backend = loop.compile_model
        forward = torch.compile(
            model, backend=backend if isinstance(backend, str) else "aot_eager"
        )
    if loop.compile_step:
        step = torch.compile(opt.step, backend="aot_eager")
    device = loop.device
    scaler = torch.amp.GradScaler(device, init_scale=2.0**8) if loop.scaler else None
    scale = 2.0**8
    params = list(model.parameters())
    amp = torch.autocast(device, dtype=loop.amp or torch.bfloat16)
    for i, (x, y) in enumerate(batches(model, params[0].dtype, device)):
        if loop.frozen is not None:
            for k, part in enumerate(model.freezable):
                part.requires_grad_(loop.frozen == "none" or k not in FROZEN[i])
        if loop.channels_last:
            x = x.to(memory_format=torch.channels_last)
        opt.zero_grad()
        with torch.autocast(device, enabled=False) if loop.amp is None else amp:
            for xs, ys in zip(x.chunk(loop.micro), y.chunk(loop.micro), strict=True):
                loss = (forward(xs).to(ys.dtype) - ys).square().sum() / len(x)
                if i == loop.inf_at:
                    loss = loss * math.inf
                if scaler is not None:
                    loss = scaler.scale(loss)
                elif loop.manual_scale:
                    loss = loss * scale
                loss.backward()
            if loop.step_in_amp:
                step()
        if loop.frozen == "none":
            for k in FROZEN[i]:
                for p in model.freezable[k].parameters():
                    p.grad = None
        if loop.manual_scale:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(1.0 / scale)
            if i == loop.inf_at:
                scale /= 2  # GradScaler's backoff after a non-finite step
        if loop.clip == "torch":
            torch.nn.utils.clip_grad_norm_(params, 0.05)
        elif loop.clip == "manual":
            _clip_by_hand(params, 0.05)
        if twin is not None:
            for p, q in zip(params, twin.parameters(), strict=True):
                q.grad = p.grad.contiguous().clone()
            twin.opt.step()
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        elif not loop.step_in_amp:
            step()


def _relative_error(got: nn.Module, want: nn.Module) -> float:
    return max(
        ((a - b).abs().max() / b.abs().max()).item()
        for a, b in zip(got.parameters(), want.parameters(), strict=True)
    )


def no_sync_worker(rank: int, world_size: int) -> dict[str, float]:
    """DDP with 2 micro-batches per rank, the first under ``no_sync``, vs this
    process stepping the union batch alone (float64): the largest relative
    parameter error per axis (``ConvNet``; LayerParallel: ``depth_model``, SGD)."""
    errors = {}
    for axis in [*OPTIMIZERS, "gefen_as_adamw", "layer_parallel"]:
        if axis == "layer_parallel":
            model = depth_model(Loop(), layer_parallel=True)
            alone = depth_model(Loop(), layer_parallel=False)
            opt, opt_alone = sgd(model), sgd(alone)
        else:
            model, alone = ConvNet().double(), ConvNet().double()
            make = gefen_as_adamw if axis == "gefen_as_adamw" else OPTIMIZERS[axis]
            opt = make(model)
            opt_alone = adamw(alone) if axis == "gefen_as_adamw" else make(alone)
        ddp = nn.parallel.DistributedDataParallel(model)
        for x, y in batches(model, torch.float64):
            opt.zero_grad()
            opt_alone.zero_grad()
            (alone(x) - y).square().sum().div(len(x)).backward()
            opt_alone.step()
            mine = slice(rank * 4, rank * 4 + 4)
            micro = zip(x[mine].chunk(2), y[mine].chunk(2), strict=True)
            for k, (xs, ys) in enumerate(micro):
                sync = ddp.no_sync() if k == 0 else contextlib.nullcontext()
                with sync:  # DDP averages over ranks: each rank's share is / 4
                    (ddp(xs) - ys).square().sum().div(4).backward()
            opt.step()
        errors[axis] = _relative_error(model, alone)
    return errors
