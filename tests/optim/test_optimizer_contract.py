"""One table of optimizer contract checks run on Gefen (several configs) and AdamW.

Whatever torch's AdamW does with state dicts, bad arguments, lr = 0, closures, param
groups, zero_grad, unused parameters and LR schedulers, Gefen must do the same.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as sched

from leantrain.optim import Gefen

OPTIMIZERS = {
    "adamw": lambda params, **kw: torch.optim.AdamW(params, **kw),
    "gefen-8-auto": lambda params, **kw: Gefen(params, **kw),
    "gefen-4-auto": lambda params, **kw: Gefen(params, momentum_bits=4, **kw),
    "gefen-fp32-element": lambda params, **kw: Gefen(
        params, momentum_bits=None, partition="element", **kw
    ),
    "gefen-8-tensor": lambda params, **kw: Gefen(params, partition="tensor", **kw),
    # An odd block length: blocks straddle rows and 4-bit code bytes.
    "gefen-4-p7": lambda params, **kw: Gefen(
        params, momentum_bits=4, partition=7, **kw
    ),
}
NAMES = list(OPTIMIZERS)


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip_resumes_bit_exactly(name, kit):
    x, y = kit.make_data()
    model = kit.make_mlp()
    opt = OPTIMIZERS[name](model.parameters(), lr=1e-2, weight_decay=0.1)
    kit.train(model, opt, x, y, 5)
    resumed_model = kit.clone(model)
    resumed = OPTIMIZERS[name](resumed_model.parameters(), lr=1e-2, weight_decay=0.1)
    resumed.load_state_dict(kit.roundtrip(opt.state_dict()))
    kit.train(model, opt, x, y, 5)
    kit.train(resumed_model, resumed, x, y, 5)
    assert kit.max_diff(model, resumed_model) == 0.0


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -1.0}, "Invalid learning rate: -1.0"),
        ({"betas": (1.0, 0.999)}, "Invalid beta parameter at index 0: 1.0"),
        ({"betas": (0.9, -0.1)}, "Invalid beta parameter at index 1: -0.1"),
        ({"eps": -1e-8}, "Invalid epsilon value: -1e-08"),
        ({"weight_decay": -0.5}, "Invalid weight_decay value: -0.5"),
    ],
)
def test_invalid_hyperparameters_raise(name, kwargs, message):
    params = [nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match=message):
        OPTIMIZERS[name](params, **kwargs)


@pytest.mark.parametrize("name", NAMES)
def test_lr_zero_changes_nothing(name, kit):
    x, y = kit.make_data()
    model = kit.make_mlp()
    before = kit.clone(model)
    opt = OPTIMIZERS[name](model.parameters(), lr=0.0, weight_decay=0.1)
    kit.train(model, opt, x, y, 3)
    assert kit.max_diff(model, before) == 0.0
    assert len(opt.state) > 0


@pytest.mark.parametrize("name", NAMES)
def test_closure_equals_explicit_backward(name, kit):
    x, y = kit.make_data()
    model = kit.make_mlp()
    explicit_model = kit.clone(model)
    opt = OPTIMIZERS[name](model.parameters(), lr=1e-2)
    explicit = OPTIMIZERS[name](explicit_model.parameters(), lr=1e-2)

    def closure():
        opt.zero_grad()
        loss = kit.loss_fn(model, x, y)
        loss.backward()
        return loss

    for _ in range(3):  # the first step included (partition and codebook)
        expected = kit.loss_fn(model, x, y).item()
        assert opt.step(closure).item() == expected
    kit.train(explicit_model, explicit, x, y, 3)
    assert kit.max_diff(model, explicit_model) == 0.0


@pytest.mark.parametrize("name", NAMES)
def test_add_param_group_equals_groups_at_construction(name, kit):
    x, y = kit.make_data()
    model = kit.make_mlp()
    grouped_model = kit.clone(model)
    first, rest = list(model.parameters())[:2], list(model.parameters())[2:]
    opt = OPTIMIZERS[name](first, lr=1e-2)
    opt.add_param_group({"params": rest, "lr": 3e-3, "weight_decay": 0.0})
    g_first, g_rest = (
        list(grouped_model.parameters())[:2],
        list(grouped_model.parameters())[2:],
    )
    grouped = OPTIMIZERS[name](
        [{"params": g_first}, {"params": g_rest, "lr": 3e-3, "weight_decay": 0.0}],
        lr=1e-2,
    )
    kit.train(model, opt, x, y, 4)
    kit.train(grouped_model, grouped, x, y, 4)
    assert kit.max_diff(model, grouped_model) == 0.0
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 3e-3]


@pytest.mark.parametrize("name", NAMES)
def test_param_group_added_mid_training_trains(name, kit):
    x, y = kit.make_data()
    model = kit.make_mlp()
    extra = nn.Linear(12, 5)
    opt = OPTIMIZERS[name](model.parameters(), lr=1e-2)
    kit.train(model, opt, x, y, 2)
    opt.add_param_group({"params": extra.parameters(), "lr": 1e-2})
    before = extra.weight.detach().clone()
    for _ in range(3):
        opt.zero_grad()
        (kit.loss_fn(model, x, y) + extra(x).square().mean()).backward()
        opt.step()
    assert not torch.equal(extra.weight, before)
    assert torch.isfinite(extra.weight).all()


@pytest.mark.parametrize("name", NAMES)
def test_zero_grad(name, kit):
    x, y = kit.make_data()
    model = kit.make_mlp()
    opt = OPTIMIZERS[name](model.parameters())
    kit.train(model, opt, x, y, 1)
    kit.loss_fn(model, x, y).backward()
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("name", NAMES)
def test_param_without_grad_is_untouched(name, kit):
    x, y = kit.make_data()
    model = kit.make_mlp()
    unused = nn.Parameter(torch.randn(7))
    before = unused.detach().clone()
    opt = OPTIMIZERS[name]([*model.parameters(), unused], lr=1e-2, weight_decay=0.5)
    kit.train(model, opt, x, y, 3)
    assert torch.equal(unused, before)
    assert not opt.state.get(unused)


SCHEDULERS = {
    "StepLR": lambda o: sched.StepLR(o, step_size=3, gamma=0.5),
    "MultiStepLR": lambda o: sched.MultiStepLR(o, milestones=[2, 5], gamma=0.3),
    "ExponentialLR": lambda o: sched.ExponentialLR(o, gamma=0.9),
    "CosineAnnealingLR": lambda o: sched.CosineAnnealingLR(o, T_max=6),
    "CosineAnnealingWarmRestarts": lambda o: sched.CosineAnnealingWarmRestarts(
        o, T_0=3
    ),
    "LambdaLR": lambda o: sched.LambdaLR(o, lambda e: 1 / (1 + e)),
    "MultiplicativeLR": lambda o: sched.MultiplicativeLR(o, lambda e: 0.9),
    "LinearLR": lambda o: sched.LinearLR(o, start_factor=0.2, total_iters=4),
    "ConstantLR": lambda o: sched.ConstantLR(o, factor=0.5, total_iters=3),
    "PolynomialLR": lambda o: sched.PolynomialLR(o, total_iters=8, power=2.0),
    "OneCycleLR": lambda o: sched.OneCycleLR(
        o, max_lr=1e-2, total_steps=12, cycle_momentum=True
    ),
    "CyclicLR": lambda o: sched.CyclicLR(
        o, base_lr=1e-3, max_lr=1e-2, step_size_up=3, cycle_momentum=True
    ),
    "SequentialLR": lambda o: sched.SequentialLR(
        o,
        [sched.LinearLR(o, 0.5, total_iters=2), sched.ExponentialLR(o, 0.9)],
        milestones=[2],
    ),
    "ChainedScheduler": lambda o: sched.ChainedScheduler(
        [sched.ConstantLR(o, 0.5, total_iters=2), sched.ExponentialLR(o, 0.9)]
    ),
    "ReduceLROnPlateau": lambda o: sched.ReduceLROnPlateau(o, patience=0, factor=0.5),
}


def _run_schedule(opt, scheduler, step_fn, steps=10):
    """Steps ``opt`` and ``scheduler``; returns (lr, momentum) seen at each step."""
    seen = []
    for _ in range(steps):
        group = opt.param_groups[0]
        momentum = group["betas"][0] if "betas" in group else group["momentum"]
        seen.append((group["lr"], momentum))
        step_fn()
        if isinstance(scheduler, sched.ReduceLROnPlateau):
            scheduler.step(1.0)  # a flat metric: every step is a plateau
        else:
            scheduler.step()
    return seen


# Schedulers only touch param_group entries, so one config per momentum kind is
# enough (the 8-bit first step learns a 256-code codebook, ~1 s on these CPUs).
@pytest.mark.parametrize("scheduler_name", list(SCHEDULERS))
@pytest.mark.parametrize("name", ["adamw", "gefen-4-auto", "gefen-fp32-element"])
def test_lr_schedulers_drive_lr_and_betas_like_sgd_momentum(name, scheduler_name, kit):
    x, y = kit.make_data()
    model = kit.make_mlp()
    opt = OPTIMIZERS[name](model.parameters(), lr=5e-3)
    before = kit.clone(model)

    def train_step():
        kit.train(model, opt, x, y, 1)

    seen = _run_schedule(opt, SCHEDULERS[scheduler_name](opt), train_step)
    # SGD with momentum is the independent reference: schedulers set its "lr" and
    # "momentum" exactly as they must set Gefen's "lr" and betas[0].
    ref_param = nn.Parameter(torch.zeros(2))
    ref = torch.optim.SGD([ref_param], lr=5e-3, momentum=0.9)
    ref_seen = _run_schedule(ref, SCHEDULERS[scheduler_name](ref), ref.step)
    # Compared as flat lists: pytest.approx does not take nested tuples.
    lrs, momenta = zip(*seen, strict=True)
    ref_lrs, ref_momenta = zip(*ref_seen, strict=True)
    assert list(lrs) == pytest.approx(list(ref_lrs), rel=1e-12, abs=0)
    if scheduler_name in ("OneCycleLR", "CyclicLR"):  # the two that cycle momentum
        assert list(momenta) == pytest.approx(list(ref_momenta), rel=1e-12, abs=0)
    assert kit.max_diff(model, before) > 0
    assert all(torch.isfinite(p).all() for p in model.parameters())
