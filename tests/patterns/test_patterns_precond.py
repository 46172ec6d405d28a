"""Training patterns x preconditioning methods: every cell equals its eager, plain
reference or raises an error that names the pattern and what to do instead.

Forms: ``gm`` (a gradient maker's ``forward_and_backward``) for every registered
method; ``loop`` (``PreconditionedOptimizer`` in the user's loop) for the methods it
supports. Models are float64 (a 4-5-5-3 MLP, a small CNN), three to four SGD steps
with the registry's settings; docs/patterns.md has the table these cells fill.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leantrain.precond import IN_LOOP_METHODS
from leantrain.precond.registry import PRECOND_METHODS
from tests._helpers import precond_patterns as builders
from tests._helpers.precond_patterns import (
    assert_same,
    batches,
    build,
    conv_net,
    net,
    train,
)

METHODS = sorted(PRECOND_METHODS)
LOOP = sorted(IN_LOOP_METHODS)
# Statistics from .grad itself (Shampoo's factors; SOAP keeps them too).
SHAMPOO = {"shampoo", "shampoo_1", "soap"}
# Methods that run the model themselves (second-order backward, a replay at the
# previous parameters, conjugate gradient over curvature products).
OWN_PASSES = {"psgd", "kbfgs", "hessian_free", "newton"}
ONE_BATCH = {"seng", "smw_ng"}  # keep one batch's per-example gradients
HOOKED_FISHER = set(METHODS) - SHAMPOO - OWN_PASSES  # a fisher_type option
EVERY_STEP = {"ema_decay": None, "curvature_interval": 1, "preconditioner_interval": 1}


def cells(pattern: str, loop: bool = True) -> list:
    out = [pytest.param(pattern, "gm", m, id=f"{pattern}-gm-{m}") for m in METHODS]
    if loop:
        out += [
            pytest.param(pattern, "loop", m, id=f"{pattern}-loop-{m}") for m in LOOP
        ]
    return out


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # compile's eager fallback, coverage notes
        return fn(*args, **kwargs)


# -- torch.compile --------------------------------------------------------------
# Hook makers call the original module eagerly (tests/precond/test_compiled_model.py
# checks their warning); a compiled call inside the user's loop fires the hooks.
def check_compile(form, method):
    data = batches(3)
    want = _quiet(train, form, method, net(), data)
    model = net()
    call = torch.compile(model, backend="aot_eager")
    assert_same(want, _quiet(train, form, method, model, data, call=call))


@pytest.mark.parametrize("method", ["kfac_1", "kfac"])
def test_compiled_loop_after_a_graph_without_hooks(method, set_attribute):
    # A process whose dynamo guards no module hooks (the default) and already
    # compiled the model class without them: the loop still records every step.
    import torch._dynamo

    set_attribute(torch._dynamo.config, "skip_nnmodule_hook_guards", True)
    torch._dynamo.reset()
    data = batches(12)  # kfac: hooks attached at steps 0 and 10 only
    first = net()
    torch.compile(first, backend="aot_eager")(data[0][0]).sum().backward()
    want = train("loop", method, net(), data)
    model = net()
    call = torch.compile(model, backend="aot_eager")
    assert_same(want, _quiet(train, "loop", method, model, data, call=call))


@pytest.mark.slow
def test_compiled_loop_with_inductor_is_close():
    data = batches(3)
    want = train("loop", "kfac", net(), data)
    model = net()
    got = _quiet(train, "loop", "kfac", model, data, call=torch.compile(model))
    assert_same(want, got, rel=1e-10)  # inductor's fused kernels round otherwise


# -- activation checkpointing ---------------------------------------------------
def check_checkpoint(form, method, where):
    data = batches(3)
    want = _quiet(train, form, method, net(), data)
    got = _quiet(train, form, method, net(ckpt=where), data)
    assert_same(want, got)  # the re-run inside the backward is not recorded


def check_checkpoint_layer(form, method):
    check_checkpoint(form, method, "layer")


def check_checkpoint_block(form, method):
    check_checkpoint(form, method, "block")


def check_checkpoint_reentrant(form, method):
    # The first forward runs without gradients; the re-run inside the backward is
    # the evaluation that counts. A plain backward records it (the loop's; the
    # maker's once torch refuses its autograd.grad pass, summing in another order).
    data = batches(3)
    model = net(ckpt="layer", reentrant=True)
    kw = {"fisher_type": "fisher_emp"} if method in HOOKED_FISHER - ONE_BATCH else {}
    if method in OWN_PASSES:
        with pytest.raises(RuntimeError, match="use_reentrant=False"):
            _quiet(train, form, method, model, data)
        return
    want = _quiet(train, form, method, net(), data, **kw)
    got = _quiet(train, form, method, model, data, **kw)
    assert_same(want, got, rel=1e-12 if form == "gm" and method not in SHAMPOO else 0.0)


def test_reentrant_checkpoint_with_micro_batches_and_monte_carlo():
    data = batches(3)
    emp = {"fisher_type": "fisher_emp"}
    for form in ("gm", "loop"):  # the maker's micro-batches run a plain backward
        want = train(form, "kfac", net(), data, micro=2, **emp)
        model = net(ckpt="layer", reentrant=True)
        assert_same(want, train(form, "kfac", model, data, micro=2, **emp))
    # Monte-Carlo vectors are back-propagated with torch.autograd.grad.
    for form in ("gm", "loop"):
        with pytest.raises(RuntimeError, match="use_reentrant=False"):
            train(form, "kfac", net(ckpt="layer", reentrant=True), data)


# -- autocast (bfloat16 on CPU) -------------------------------------------------
def check_autocast(form, method):
    # As tests/precond/test_registry.py for a bf16 model: two steps on one batch
    # (lr 0), float32 against bfloat16 autocast; the curvature arithmetic runs
    # outside autocast, in float32.
    device = builders.DEVICE
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(1)).to(device)
    t = (torch.arange(16) % 3).to(device)
    grads = []
    for enabled in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3))
        model = model.to(device)
        gm, opt = _quiet(build, form, method, model, lr=0.0)
        for _ in range(2):
            opt.zero_grad()
            with torch.autocast(device, dtype=torch.bfloat16, enabled=enabled):
                if form == "gm":
                    gm.setup_loss_call(
                        F.cross_entropy, gm.setup_model_call(model, x), t
                    )
                    gm.forward_and_backward()
                else:
                    loss = F.cross_entropy(model(x), t)
            if form == "loop":
                loss.backward()
            opt.step()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    assert all(g.dtype == torch.float32 for g in grads)
    if method == "soap":  # near-sign first Adam steps: see tests/precond/test_registry
        assert torch.isfinite(grads[1]).all()
        return
    assert (grads[1] - grads[0]).norm() / grads[0].norm() < 0.05  # 0.3-2% here


# -- GradScaler ----------------------------------------------------------------
BAD = 1  # this batch has an inf input: the scaler skips its step


def _scaler_data():
    data = batches(4)
    data[BAD][0][0, 0] = float("inf")
    return data


def check_grad_scaler(form, method):
    data = _scaler_data()
    scaler = torch.amp.GradScaler(builders.DEVICE, init_scale=2.0**10)
    if form == "gm" and method in OWN_PASSES:
        with pytest.raises(ValueError, match="cannot take grad_scaler"):
            train(form, method, net(), data, scaler=scaler)
        return
    kw = {"fisher_type": "fisher_emp"} if method in HOOKED_FISHER - ONE_BATCH else {}
    got = _quiet(train, form, method, net(), data, scaler=scaler, **kw)
    assert scaler.get_scale() == 2.0**9  # backed off once, at the skipped step
    if form == "gm":  # the maker counted the skipped step: so does the reference
        want = _quiet(train, form, method, net(), data, skip_nonfinite=True, **kw)
    else:  # a step the scaler skips leaves no trace in the loop
        clean = [b for i, b in enumerate(data) if i != BAD]
        want = _quiet(train, form, method, net(), clean, **kw)
        want.insert(BAD, got[BAD])
    del got[BAD], want[BAD]  # non-finite
    assert_same(want, got)


@pytest.mark.parametrize("method", ["kfac", "shampoo"])
def test_grad_scaler_unscale_then_clip_in_loop(method):
    # unscale_ before step (for clipping) needs the scaler given to the wrapper.
    data = batches(3)

    def run(scaler, **kw):
        model = net()
        _, opt = (
            build("loop", method, model, fisher_type="fisher_emp", **kw)
            if method == "kfac"
            else build("loop", method, model, **kw)
        )
        for x, t in data:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), t)
            (loss if scaler is None else scaler.scale(loss)).backward()
            if scaler is not None:
                scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
        return [[p.detach().clone() for p in model.parameters()]]

    want = run(None)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    assert_same(want, run(scaler, grad_scaler=scaler))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    if method == "kfac":
        with pytest.raises(RuntimeError, match="grad_scaler=scaler"):
            run(scaler)


# -- gradient accumulation --------------------------------------------------------
def check_accumulation(form, method):
    data = batches(3)
    kw = {"fisher_type": "fisher_emp"} if method in HOOKED_FISHER - ONE_BATCH else {}
    if form == "gm" and method in OWN_PASSES | ONE_BATCH:
        with pytest.raises(ValueError, match="cannot accumulate micro-batches"):
            _quiet(train, form, method, net(), data, micro=2)
        return
    if method in ONE_BATCH:
        with pytest.raises(RuntimeError, match="gradient accumulation is not"):
            _quiet(train, form, method, net(), data, micro=2)
        return
    want = _quiet(train, form, method, net(), data, **kw)  # one batch: the union
    got = _quiet(train, form, method, net(), data, micro=2, **kw)
    assert_same(want, got, rel=1e-12)  # the union's sums in another order


# -- clip_grad_norm_ -----------------------------------------------------------------
def check_clip(form, method):
    # lr 0 keeps both runs at the same parameters: the clipped one must differ
    # from the unclipped one by the clip coefficient alone. The maker clips its
    # preconditioned gradient; in a loop the plain gradient is clipped before the
    # preconditioning, so Shampoo's statistics see it clipped (reference: its loss
    # times the coefficient) and the hook methods' do not (reference: coef * P g).
    data = batches(3)
    coefs = []

    def clip(model):
        norm = nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        coefs.append(min(1.0, 0.05 / (float(norm) + 1e-6)))

    got = _quiet(train, form, method, net(), data, before_step=clip, lr=0.0)
    # (A maker's SOAP writes zero at its first step: nothing to clip there.)
    first = 1 if form == "gm" and method == "soap" else 0
    assert all(c < 1 for c in coefs[first:])
    if form == "loop" and method in SHAMPOO:
        model, want = net(), []
        gm, opt = build(form, method, model, lr=0.0)
        for (x, t), c in zip(data, coefs, strict=True):
            opt.zero_grad()
            (F.cross_entropy(model(x), t) * c).backward()
            opt.step()
            want.append([p.grad.clone() for p in model.parameters()])
    else:
        plain = _quiet(train, form, method, net(), data, lr=0.0)[:-1]
        want = [[g * c for g in step] for step, c in zip(plain, coefs, strict=True)]
    assert_same(want, got[:-1], rel=1e-12)


# -- frozen and unfrozen parameters ----------------------------------------------------
def check_frozen(form, method):
    # Frozen after the maker was built: as a maker built on the frozen model.
    data = batches(3)
    if method in {"psgd", "kbfgs"}:
        model = net()
        gm, opt = build(form, method, model)
        model.l1.requires_grad_(False)
        with pytest.raises(RuntimeError, match="frozen after the maker was built"):
            _quiet(train_built, form, gm, opt, model, data)
        return
    ref = net()
    ref.l1.requires_grad_(False)
    want = _quiet(train, form, method, ref, data)
    model = net()
    gm, opt = _quiet(build, form, method, model)
    model.l1.requires_grad_(False)
    assert_same(want, _quiet(train_built, form, gm, opt, model, data), rel=1e-12)


def check_unfrozen(form, method):
    # Frozen when the maker was built, trainable later: it would keep its plain
    # gradient, so the step refuses.
    model = net()
    model.l1.requires_grad_(False)
    gm, opt = _quiet(build, form, method, model)
    model.l1.requires_grad_(True)
    with pytest.raises(RuntimeError, match="when the maker was built"):
        _quiet(train_built, form, gm, opt, model, batches(1))


def check_refrozen(form, method):
    # Built trainable, frozen for two steps, unfrozen: the next step equals a maker
    # built then (same Monte-Carlo generator state; no EMA to carry history).
    if method in {"psgd", "kbfgs"}:
        return check_frozen(form, method)
    data = batches(4)
    if method in SHAMPOO:  # accumulates: a frozen weight's statistics pause
        return check_refrozen_shampoo(form, method, data)
    model = net()
    gm, opt = _quiet(build, form, method, model, config=EVERY_STEP)
    model.l1.requires_grad_(False)
    _quiet(train_built, form, gm, opt, model, data[:2])
    model.l1.requires_grad_(True)
    ref = copy.deepcopy(model)
    ref_gm, ref_opt = _quiet(build, form, method, ref, config=EVERY_STEP)
    if hasattr(gm, "generators"):
        ref_gm.generators.set_state(gm.generators.get_state())
    want = _quiet(train_built, form, ref_gm, ref_opt, ref, data[2:])
    assert_same(want, _quiet(train_built, form, gm, opt, model, data[2:]))


def check_refrozen_shampoo(form, method, data):
    # Reference: l1 trainable but its gradient dropped before the step (SGD and
    # Shampoo skip a parameter without .grad) on the frozen steps.
    steps = iter(range(len(data)))

    def drop(model):
        if next(steps) < 2:
            model.l1.weight.grad = model.l1.bias.grad = None

    want = _quiet(
        train, "loop", method, net(), data, before_step=drop, config=EVERY_STEP
    )
    model = net()
    gm, opt = _quiet(build, form, method, model, config=EVERY_STEP)
    model.l1.requires_grad_(False)
    got = _quiet(train_built, form, gm, opt, model, data[:2])[:-1]
    model.l1.requires_grad_(True)
    got += _quiet(train_built, form, gm, opt, model, data[2:])
    assert_same(want[2:], got[2:], rel=1e-12)


def train_built(form, gm, opt, model, data):
    out = []
    for x, t in data:
        opt.zero_grad()
        if form == "gm":
            gm.setup_loss_call(F.cross_entropy, gm.setup_model_call(model, x), t)
            gm.forward_and_backward()
        else:
            F.cross_entropy(model(x), t).backward()
        opt.step()
        out.append(
            [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        )
    return [*out, [p.detach().clone() for p in model.parameters()]]


# -- channels_last convolutions ---------------------------------------------------
def check_channels_last(form, method):
    data = batches(3, image=True)
    want = _quiet(train, form, method, conv_net(), data)
    model = conv_net().to(memory_format=torch.channels_last)
    last = [(x.to(memory_format=torch.channels_last), t) for x, t in data]
    got = _quiet(train, form, method, model, last)
    assert_same(want, [[g.contiguous() for g in step] for step in got], rel=1e-11)


CHECKS = {
    "compile": check_compile,
    "checkpoint_layer": check_checkpoint_layer,
    "checkpoint_block": check_checkpoint_block,
    "checkpoint_reentrant": check_checkpoint_reentrant,
    "autocast": check_autocast,
    "grad_scaler": check_grad_scaler,
    "accumulation": check_accumulation,
    "clip": check_clip,
    "frozen": check_frozen,
    "unfrozen": check_unfrozen,
    "refrozen": check_refrozen,
    "channels_last": check_channels_last,
}


@pytest.mark.parametrize(
    ("pattern", "form", "method"), [c for p in CHECKS for c in cells(p)]
)
def test_cell(pattern, form, method):
    CHECKS[pattern](form, method)


# On CUDA: the checks a GPU changes most (torch.compile, bf16 autocast, a GradScaler
# with a real overflow step) for the methods a user starts with, both forms, with
# the builders' tensors on the device.
CUDA_CHECKS = ("compile", "autocast", "grad_scaler")
CUDA_METHODS = {"kfac_1", "kfac", "ekfac", "shampoo", "psgd"}


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("pattern", "form", "method"),
    [c for p in CUDA_CHECKS for c in cells(p) if c.values[2] in CUDA_METHODS],
)
def test_cell_on_cuda(pattern, form, method, monkeypatch):
    if not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device")
    monkeypatch.setattr(builders, "DEVICE", "cuda")
    assert net().l1.weight.is_cuda
    CHECKS[pattern](form, method)
