"""Preconditioned base: config rules, schedule, module selection, the hook path.

Schedules are observed on the concrete diagonal empirical Fisher maker (its numbers
are checked in test_diagonal_fisher.py) and on a minimal hook-based subclass.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from leantrain.precond import (
    DiagonalEmpiricalFisherGradientMaker,
    PreconditionedGradientMaker,
    PreconditioningConfig,
    is_due,
)

# -- schedule ----------------------------------------------------------------------


class Recording(DiagonalEmpiricalFisherGradientMaker):
    """Records at which steps each part of the step ran."""

    def __init__(self, *args, **kwargs):
        self.log = {
            "pass": [],
            "curvature": [],
            "preconditioner": [],
            "precondition": [],
        }
        super().__init__(*args, **kwargs)

    def _curvature_pass(self):
        self.log["pass"].append(self.step)
        return super()._curvature_pass()

    def update_curvature(self):
        self.log["curvature"].append(self.step)
        super().update_curvature()

    def update_preconditioner(self):
        self.log["preconditioner"].append(self.step)
        super().update_preconditioner()

    def precondition(self):
        self.log["precondition"].append(self.step)
        super().precondition()


def test_schedule_after_warmup(zoo):
    model = zoo.MLP()
    cfg = PreconditioningConfig(
        curvature_interval=2, preconditioner_interval=4, warmup_steps=3, ema_decay=0.9
    )
    gm = Recording(model, cfg)
    x, t = torch.randn(4, 5), torch.randint(0, 3, (4,))
    gm.setup_loss_call(F.cross_entropy, gm.setup_model_call(model, x), t)
    for _ in range(12):
        gm.forward_and_backward()
    # Warm-up 0, 1, 2 every step; then every 2nd (curvature) / 4th (preconditioner).
    assert gm.log["curvature"] == [0, 1, 2, 3, 5, 7, 9, 11]
    assert gm.log["preconditioner"] == [0, 1, 2, 3, 7, 11]
    assert gm.log["pass"] == gm.log["curvature"]  # the only per-example passes
    assert gm.log["precondition"] == list(range(12))
    assert (gm.step, gm.curvature_updates, gm.preconditioner_updates) == (12, 8, 6)
    assert [s for s in range(12) if cfg.curvature_due(s)] == gm.log["curvature"]
    assert all(is_due(s, 1, 0) for s in range(5))


def test_num_total_steps_stops_the_maker(zoo):
    model = zoo.MLP()
    gm = DiagonalEmpiricalFisherGradientMaker(
        model, PreconditioningConfig(num_total_steps=2)
    )
    gm.setup_loss_repr(gm.setup_model_call(model, torch.randn(3, 5)).square().mean())
    gm.forward_and_backward()
    gm.forward_and_backward()
    with pytest.raises(RuntimeError, match="num_total_steps=2"):
        gm.forward_and_backward()


# -- config --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            {"curvature_interval": 0},
            ValueError,
            "curvature_interval must be an int >= 1",
        ),
        ({"preconditioner_interval": -2}, ValueError, "preconditioner_interval"),
        ({"warmup_steps": -1}, ValueError, "warmup_steps must be an int >= 0, got -1"),
        ({"warmup_steps": 1.5}, TypeError, "warmup_steps must be an int"),
        ({"curvature_interval": True}, TypeError, "curvature_interval"),
        ({"damping": 0.0}, ValueError, "damping must be a finite float > 0"),
        ({"damping": float("nan")}, ValueError, "damping"),
        ({"damping": "1e-3"}, TypeError, "damping"),
        (
            {"ema_decay": 1.0},
            ValueError,
            r"ema_decay must be None or a float in \(0, 1\)",
        ),
        ({"ema_decay": 0.0}, ValueError, "ema_decay"),
        ({"ema_decay": -0.5}, ValueError, "ema_decay"),
        ({"num_total_steps": 0}, ValueError, "num_total_steps"),
        ({"accumulation_steps": 0}, ValueError, "accumulation_steps"),
        ({"accumulation_steps": 1.5}, TypeError, "accumulation_steps"),
        ({"num_total_steps": 3, "warmup_steps": 5}, ValueError, "exceeds"),
        (
            {"curvature_interval": 2, "preconditioner_interval": 3, "ema_decay": 0.9},
            ValueError,
            "multiple of curvature_interval",
        ),
        (
            {"curvature_interval": 4, "preconditioner_interval": 2, "ema_decay": 0.9},
            ValueError,
            "multiple",
        ),
        (
            {"curvature_interval": 1, "preconditioner_interval": 2},
            ValueError,
            "discarded",
        ),
        ({"ignore_modules": (3,)}, TypeError, "ignore_modules entries"),
        ({"ignore_modules": (int,)}, TypeError, "not an nn.Module subclass"),
        ({"ignore_modules": ("",)}, ValueError, "empty name"),
        ({"ignore_modules": 3}, TypeError, "ignore_modules must be a sequence"),
    ],
)
def test_config_rejects_bad_values(kwargs, error, match):
    with pytest.raises(error, match=match):
        PreconditioningConfig(**kwargs)


@settings(max_examples=200, deadline=None)
@given(
    k=st.integers(1, 6),
    mult=st.integers(1, 4),
    warmup=st.integers(0, 8),
    decay=st.one_of(st.none(), st.floats(0.01, 0.99)),
)
def test_every_preconditioner_update_sees_a_fresh_curvature(k, mult, warmup, decay):
    kwargs = dict(curvature_interval=k, preconditioner_interval=k * mult)
    if decay is None and mult > 1:
        with pytest.raises(ValueError, match="discarded"):
            PreconditioningConfig(warmup_steps=warmup, ema_decay=decay, **kwargs)
        return
    cfg = PreconditioningConfig(warmup_steps=warmup, ema_decay=decay, **kwargs)
    steps = range(warmup + 3 * k * mult + 1)
    curv = [s for s in steps if cfg.curvature_due(s)]
    pre = [s for s in steps if cfg.preconditioner_due(s)]
    assert set(pre) <= set(curv) and pre[0] == curv[0] == 0
    after = [s for s in curv if s >= warmup]
    assert all(b - a == k for a, b in zip(after, after[1:], strict=False))
    assert len([s for s in pre if s >= warmup]) == 4


def test_config_accepts_valid_combinations():
    cfg = PreconditioningConfig(
        curvature_interval=5,
        preconditioner_interval=20,
        ema_decay=0.95,
        ignore_modules="head",
    )
    assert cfg.ignore_modules == ("head",)
    assert not cfg.preconditioner_due(5) and cfg.preconditioner_due(20)


def test_maker_rejects_a_wrong_config_type(zoo):
    with pytest.raises(TypeError, match="PreconditioningConfig"):
        DiagonalEmpiricalFisherGradientMaker(zoo.MLP(), {"damping": 1e-3})
    with pytest.raises(ValueError, match="loss_reduction"):
        DiagonalEmpiricalFisherGradientMaker(zoo.MLP(), loss_reduction="none")


# -- module selection ----------------------------------------------------------------


def selected(model, ignore):
    gm = DiagonalEmpiricalFisherGradientMaker(
        model, PreconditioningConfig(ignore_modules=ignore)
    )
    return [name for name, _ in gm.modules()]


def test_ignore_modules_by_instance_class_and_name(zoo):
    lm = zoo.TinyLM()
    assert selected(lm, ()) == ["embed", "mix", "head"]
    assert selected(lm, (lm.mix,)) == ["embed", "head"]
    assert selected(lm, (nn.Linear,)) == ["embed"]
    assert selected(lm, ("hea",)) == ["embed", "mix"]
    outer = nn.Sequential(zoo.MLP(), nn.Linear(3, 2))
    assert selected(outer, (outer[0],)) == ["1"]  # children of an ignored module too


def test_ignoring_every_module_raises_a_clear_error(zoo):
    model = zoo.MLP()
    with pytest.raises(ValueError, match="no module left to precondition.*fc1"):
        selected(model, (nn.Linear,))
    with pytest.raises(ValueError, match="not a submodule"):
        selected(model, (nn.Linear(2, 2),))


# -- the base's hook path, with a minimal real subclass ------------------------------


class InputScaleGradientMaker(PreconditionedGradientMaker):
    """Divides each Linear's weight gradient by the mean squared input it saw.

    Uses the base's default curvature pass with forward hooks from curvature_hooks().
    """

    def __init__(self, model, config=None):
        self.seen: dict[str, torch.Tensor] = {}
        self.hook_calls = 0
        self.scale: dict[str, torch.Tensor] = {}
        super().__init__(model, config)

    def is_supported(self, module):
        return isinstance(module, nn.Linear)

    @contextlib.contextmanager
    def curvature_hooks(self):
        handles = []
        for name, module in self.modules():

            def hook(mod, inputs, output, name=name):
                self.hook_calls += 1
                self.seen[name] = inputs[0].detach().square().mean()

            handles.append(module.register_forward_hook(hook))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def update_curvature(self):
        for name, value in self.seen.items():
            self.seen[name] = self._ema_update(name, value)

    def update_preconditioner(self):
        self.scale = {n: 1.0 / (v + self.config.damping) for n, v in self.seen.items()}

    def precondition(self):
        for name, module in self.modules():
            module.weight.grad.mul_(self.scale[name])


def test_module_hooks_are_active_only_in_curvature_passes(zoo):
    model = zoo.MLP().double()
    ref = zoo.twin(model)
    cfg = PreconditioningConfig(curvature_interval=2, preconditioner_interval=2)
    gm = InputScaleGradientMaker(model, cfg)
    x, t = torch.randn(4, 5, dtype=torch.float64), torch.randint(0, 3, (4,))
    gm.setup_loss_call(F.cross_entropy, gm.setup_model_call(model, x), t)
    for _ in range(3):
        gm.forward_and_backward()
    assert gm.hook_calls == 2 * 2  # two Linear modules, curvature at steps 0 and 2
    for _ in range(3):
        F.cross_entropy(ref(x), t).backward()
    hidden = torch.tanh(ref.fc1(x))
    scale1 = 1.0 / (x.square().mean() + 1e-7)
    scale2 = 1.0 / (hidden.square().mean() + 1e-7)
    # .grad accumulates; each step preconditions the whole accumulated gradient.
    g1 = ref.fc1.weight.grad / 3
    expected = ((g1 * scale1 + g1) * scale1 + g1) * scale1
    torch.testing.assert_close(model.fc1.weight.grad, expected)
    g2 = ref.fc2.weight.grad / 3
    torch.testing.assert_close(
        model.fc2.weight.grad, ((g2 * scale2 + g2) * scale2 + g2) * scale2
    )


def test_a_shared_module_is_selected_once():
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.Tanh(), shared)
    assert selected(model, ()) == ["0"]
