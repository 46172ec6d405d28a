"""Controller: switches a stalled problem (h = 1) to serial within one check interval,
after which training equals serial training exactly; never switches a converging one;
the iterations policy; the factor's floor; validation and logging."""

from __future__ import annotations

import copy
import doctest
import importlib
import logging
import math

import pytest
import torch
from torch import nn

from leantrain.layer_parallel import LayerParallel, MGRITStats
from leantrain.layer_parallel.controller import Controller, convergence_factor
from leantrain.models.blocks import ResidualStack
from tests._helpers.lp_steps import tanh_steps

N, D = 16, 6


class _Net(nn.Module):
    """Linear in, an ODE stack, linear out (the shape of every leantrain model)."""

    def __init__(self, stack: nn.Module) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.inp = nn.Linear(D, D).double()
        self.stack = stack
        self.out = nn.Linear(D, 1).double()

    def forward(self, x):
        return self.out(self.stack(self.inp(x)))


def _batch(k: int):
    g = torch.Generator().manual_seed(100 + k)
    x = torch.randn(4, D, generator=g, dtype=torch.float64)
    return x, x.sum(1, keepdim=True).sin()


def _train_step(model, opt, k):
    x, y = _batch(k)
    opt.zero_grad()
    (model(x) - y).pow(2).mean().backward()


def _lp_net(t_final: float, scale: float, **kw) -> _Net:
    steps = tanh_steps(N, D, scale=scale)
    kw = dict(cf=2, fwd_iters=2, bwd_iters=1, on_divergence="ignore") | kw
    return _Net(LayerParallel(steps, t_final=t_final, **kw))


def test_stalled_problem_switches_to_serial_then_trains_exactly_serial():
    model = _lp_net(t_final=float(N), scale=2.0)  # h = 1: MGRIT stalls
    ctrl = Controller(model, every=3, policy="serial")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    k = 0
    while not ctrl.switched:
        assert k < 3, "no switch within one check interval"
        _train_step(model, opt, k)
        ctrl.step()
        opt.step()
        k += 1
    (decision,) = ctrl.records
    assert decision.action == "serial" and decision.factor > 1.0
    assert model.stack.mode == "serial"
    # from here on: exactly the serial network, trained by the same optimizer
    ref = copy.deepcopy(model)
    ref.stack = ResidualStack(ref.stack.steps, t_final=float(N))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-3)
    for step in range(k, k + 4):
        _train_step(model, opt, step)
        ctrl.step()
        opt.step()
        _train_step(ref, ref_opt, step)
        ref_opt.step()
        for (name, p), q in zip(
            model.named_parameters(), ref.parameters(), strict=True
        ):
            assert (p - q).abs().max() <= 1e-12, name
    assert len(ctrl.records) == 1  # a serial model is not checked again


def test_converging_problem_never_switches_and_restores_iterations():
    model = _lp_net(t_final=1.0, scale=1.0)  # h = 1/N: factor ~0.1
    ctrl = Controller(model, every=2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    seen = []
    for k in range(5):
        _train_step(model, opt, k)
        seen.append(model.stack.stats.forward.iterations)
        ctrl.step()
        opt.step()
    assert seen == [4, 2, 4, 2, 4]  # check batches run doubled iterations
    assert [d.batch for d in ctrl.records] == [0, 2, 4]
    assert all(d.action == "keep" and d.factor < 0.5 for d in ctrl.records)
    assert not ctrl.switched and model.stack.mode == "parallel"
    assert model.stack.fwd_options.iterations == 2
    assert model.stack.bwd_options.iterations == 1


def test_iterations_policy_raises_counts_then_falls_back_to_serial():
    model = _lp_net(t_final=float(N), scale=2.0)
    ctrl = Controller(model, every=1, policy="iterations")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for k in range(6):
        _train_step(model, opt, k)
        ctrl.step()
    actions = [(d.action, d.fwd_iters, d.bwd_iters) for d in ctrl.records]
    limit = N // (2 * 2) + 1  # exact after N/(2 cf) cycles (+1 for the skip)
    assert actions[:3] == [
        ("more_iterations", 3, 2),
        ("more_iterations", 4, 3),
        ("more_iterations", 5, 4),
    ]
    assert actions[3][0] == "serial" and ctrl.switched
    assert max(a[1] for a in actions) == limit


def test_factor_ignores_residuals_below_the_floor():
    stats = MGRITStats(residuals=[1.0, 1e-3, 2e-7], final_residual=3e-7, floor=1e-6)
    # 2e-7 -> 3e-7 (growth) is rounding noise below the floor: not counted
    assert convergence_factor(stats) == pytest.approx(1e-3)
    grow = MGRITStats(residuals=[1.0, 1.5], final_residual=1.2, floor=1e-6)
    assert convergence_factor(grow) == pytest.approx(1.5)
    nan = MGRITStats(residuals=[1.0], final_residual=math.nan)
    assert convergence_factor(nan) == math.inf
    all_floor = MGRITStats(residuals=[1e-9], final_residual=2e-9, floor=1e-6)
    assert convergence_factor(all_floor) == 0.0
    assert convergence_factor(None) == 0.0


def test_decisions_are_logged_with_their_numbers(caplog):
    model = _lp_net(t_final=1.0, scale=1.0)
    ctrl = Controller(model, every=5)
    with caplog.at_level(logging.INFO, logger="leantrain.layer_parallel.controller"):
        _train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), 0)
        decision = ctrl.step()
    assert decision is ctrl.records[0]
    assert f"{decision.forward_factor:.3g}" in caplog.text and "keep" in caplog.text
    assert len(decision.forward_history) == 4 and len(decision.backward_history) == 2


@pytest.mark.parametrize(
    "kw,err,match",
    [
        (dict(policy="restart"), ValueError, "policy must be one of"),
        (dict(every=0), ValueError, "every must be >= 1"),
        (dict(every=2.5), TypeError, "every must be an int"),
        (dict(threshold=-1.0), ValueError, "threshold must be finite and > 0"),
        (dict(max_iters=0), ValueError, "max_iters must be >= 1"),
    ],
)
def test_bad_options_raise(kw, err, match):
    with pytest.raises(err, match=match):
        Controller(_lp_net(1.0, 1.0), **kw)


def test_model_without_layer_parallel_is_rejected():
    with pytest.raises(ValueError, match="contains no LayerParallel"):
        Controller(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="must be an nn.Module"):
        Controller("stack")


@pytest.mark.parametrize(
    "name",
    ["controller", "costs.simulate", "costs.cycle_work", "costs.projection", "mesh"],
)
def test_docstring_examples_run(name):
    mod = importlib.import_module(f"leantrain.layer_parallel.{name}")
    result = doctest.testmod(mod, extraglobs={"torch": torch})
    assert result.failed == 0 and result.attempted > 0


def test_controller_takes_the_mesh_of_its_stacks():
    # Not parallelized: no mesh, each process decides alone (no world-group fallback).
    model = nn.Sequential(_lp_net(1.0, 1.0), _lp_net(1.0, 1.0))
    assert Controller(model).mesh is None
    explicit = object()  # stands in for a DeviceMesh: only passed through here
    assert Controller(model, mesh=explicit).mesh is explicit
    model[0].stack._mesh, model[1].stack._mesh = object(), object()
    with pytest.raises(ValueError, match="different meshes"):
        _ = Controller(model).mesh
