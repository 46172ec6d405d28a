"""Tiny float64 models, batches and one training loop for the preconditioning
pattern matrix (tests/patterns/test_patterns_precond.py).

:func:`train` runs SGD steps either through a gradient maker's
``forward_and_backward`` (form ``"gm"``) or through ``PreconditionedOptimizer`` in a
plain loop (form ``"loop"``), with the pattern's options, and returns each step's
``.grad`` (after preconditioning) followed by the final parameters.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from leantrain.precond import make_gradient_maker, precondition_in_loop

IN, HIDDEN, OUT, BATCH = 4, 5, 3, 8
# Where net(), conv_net() and batches() put their tensors. The matrix's gpu cells set
# it to "cuda" and run the same checks there.
DEVICE = "cpu"
# What "the same" means off the CPU: a CUDA kernel may fuse a multiply-add that a
# compiled graph's decomposition runs as two ops (an ulp apart, float64).
CUDA_REL = 1e-10


class Net(nn.Module):
    """Linear-Tanh-Linear-Tanh-Linear; ``ckpt`` wraps ``l2`` ("layer") or
    ``l1``-Tanh-``l2``-Tanh ("block") in ``torch.utils.checkpoint.checkpoint``."""

    def __init__(self, ckpt: str | None = None, reentrant: bool = False) -> None:
        super().__init__()
        self.l1 = nn.Linear(IN, HIDDEN)
        self.l2 = nn.Linear(HIDDEN, HIDDEN)
        self.l3 = nn.Linear(HIDDEN, OUT)
        self.ckpt, self.reentrant = ckpt, reentrant

    def _block(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.l2(torch.tanh(self.l1(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ckpt == "block":
            h = checkpoint(self._block, x, use_reentrant=self.reentrant)
        elif self.ckpt == "layer":
            h = torch.tanh(self.l1(x))
            h = torch.tanh(checkpoint(self.l2, h, use_reentrant=self.reentrant))
        else:
            h = self._block(x)
        return self.l3(h)


class ConvNet(nn.Module):
    """Conv2d-Tanh-Linear on (N, 2, 4, 4) images."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.head = nn.Linear(3 * 4 * 4, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.conv(x)).flatten(1))


def net(seed: int = 0, **options) -> nn.Module:
    torch.manual_seed(seed)
    return Net(**options).double().to(DEVICE)


def conv_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return ConvNet().double().to(DEVICE)


def batches(n: int, *, image: bool = False, seed: int = 1) -> list:
    gen = torch.Generator().manual_seed(seed)
    shape = (BATCH, 2, 4, 4) if image else (BATCH, IN)
    return [
        (
            torch.randn(*shape, generator=gen, dtype=torch.float64).to(DEVICE),
            torch.randint(0, OUT, (BATCH,), generator=gen).to(DEVICE),
        )
        for _ in range(n)
    ]


# SOAP runs Adam in the factors' eigenbasis, where rounding is amplified twice.
# A factor of rank below its size (5x5 from one 3x5 gradient) has a null space in
# which eigh picks any basis, and Adam is not rotation invariant there: two runs
# that differ by rounding (another summation order, a clip coefficient) then differ
# by O(1); rotating only sides of at most 4 leaves full-rank factors here. And a
# rotated entry that is zero but for rounding (the softmax head's gradient has no
# component along all-ones) is divided by sqrt(v) + eps ~ eps: at eps 1e-8 rounding
# of 1e-17 becomes 1e-9; eps 1e-4 keeps it at 1e-13. So the cells compare SOAP to
# rounding as they do the other methods.
METHOD_OPTIONS = {"soap": {"max_precond_dim": 4, "config": {"damping": 1e-4}}}


def build(form: str, name: str, model: nn.Module, lr: float = 0.1, **options):
    """``(maker, optimizer)``: the registry's method through the form's entry."""
    extra = METHOD_OPTIONS.get(name, {})
    config = {**extra.get("config", {}), **options.get("config", {})}
    options = {**extra, **options, **({"config": config} if config else {})}
    sgd = torch.optim.SGD(model.parameters(), lr=lr)
    if form == "gm":
        return make_gradient_maker(name, model, **options), sgd
    opt = precondition_in_loop(sgd, model, name, **options)
    return opt.maker, opt


def train(
    form: str,
    name: str,
    model: nn.Module,
    data: list,
    *,
    call: Callable | None = None,
    micro: int = 1,
    scaler: torch.amp.GradScaler | None = None,
    before_step: Callable | None = None,
    lr: float = 0.1,
    skip_nonfinite: bool = False,
    **options,
) -> list[list]:
    """Train on ``data``; each step's ``.grad`` then the final parameters.

    ``micro``: micro-batches per step (losses divided by it; the maker gets
    ``accumulation_steps=micro``). ``scaler``: a GradScaler used the usual way.
    ``before_step(model)``: runs between the backward and the optimizer step.
    ``skip_nonfinite``: no optimizer step on a non-finite gradient (what the
    scaler does).
    """
    if micro > 1 and form == "gm":
        options["config"] = {**options.get("config", {}), "accumulation_steps": micro}
    gm, opt = build(form, name, model, lr=lr, **options)
    call = model if call is None else call
    out = []
    for x, t in data:
        opt.zero_grad()
        for xs, ts in zip(x.chunk(micro), t.chunk(micro), strict=True):
            if form == "gm":
                y = gm.setup_model_call(call, xs)
                gm.setup_loss_call(lambda a, b: F.cross_entropy(a, b) / micro, y, ts)
                gm.forward_and_backward(grad_scaler=scaler)
            else:
                loss = F.cross_entropy(call(xs), ts) / micro
                (loss if scaler is None else scaler.scale(loss)).backward()
        if before_step is not None:
            before_step(model)
        finite = all(
            p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters()
        )
        if scaler is None and (finite or not skip_nonfinite):
            opt.step()
        elif scaler is not None:
            scaler.step(opt)
        # (scaler.step has unscaled .grad in place, or the loop's step() did)
        out.append(
            [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        )
        if scaler is not None:
            scaler.update()
    if form == "loop":
        opt.close()
    return [*out, [p.detach().clone() for p in model.parameters()]]


def max_rel_err(want: list, got: list) -> float:
    """Largest entry-wise difference over the largest entry, tensor by tensor."""
    err = 0.0
    for w_step, g_step in zip(want, got, strict=True):
        for a, b in zip(w_step, g_step, strict=True):
            if a is None or b is None:
                assert a is None and b is None
                continue
            scale = float(a.abs().max()) or 1.0
            err = max(err, float((a - b).abs().max()) / scale)
    return err


def assert_same(want: list, got: list, rel: float = 0.0) -> None:
    """Bit for bit (``rel=0``) or within ``rel`` of each tensor's largest entry
    (on CUDA at least :data:`CUDA_REL`)."""
    if DEVICE != "cpu":
        rel = max(rel, CUDA_REL)
    if rel == 0.0:
        for w_step, g_step in zip(want, got, strict=True):
            for a, b in zip(w_step, g_step, strict=True):
                assert (a is None and b is None) or torch.equal(a, b)
    else:
        assert max_rel_err(want, got) <= rel
