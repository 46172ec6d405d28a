"""A ``torch.compile``'d model passed to ``setup_model_call``.

Module hooks do not fire inside a compiled graph, so a maker that reads activations
or output-gradients (or takes Hessian-vector products through the call) would build
its curvature from nothing. Such makers call the original module eagerly, with one
warning; their result equals the uncompiled model's bit for bit. The plain
GradientMaker and Shampoo (gradients only) run the compiled call.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leantrain.precond import GradientMaker
from leantrain.precond.gradient_maker import compiled_original
from leantrain.precond.registry import PRECOND_METHODS, make_gradient_maker

RUNS_COMPILED = {"shampoo", "shampoo_1", "soap"}
METHOD_OPTIONS = {"soap": {"max_precond_dim": 4, "config": {"damping": 1e-4}}}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _grads(make, compiled: bool, steps: int = 2):
    model = _model()
    gm = make(model)
    call = torch.compile(model) if compiled else model
    gen = torch.Generator().manual_seed(1)
    grads = []
    for _ in range(steps):
        x = torch.randn(8, 4, generator=gen, dtype=torch.float64)
        t = torch.randint(0, 3, (8,), generator=gen)
        model.zero_grad()
        y = gm.setup_model_call(call, x)
        gm.setup_loss_call(F.cross_entropy, y, t)
        gm.forward_and_backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    return grads


@pytest.mark.parametrize("name", sorted(set(PRECOND_METHODS) - RUNS_COMPILED))
def test_hook_makers_call_a_compiled_model_eagerly(name):
    def make(model):
        return make_gradient_maker(name, model)

    want = _grads(make, compiled=False)
    with pytest.warns(UserWarning, match="torch.compile'd") as record:
        got = _grads(make, compiled=True)
    assert sum("torch.compile'd" in str(w.message) for w in record) == 1  # once
    for w_step, g_step in zip(want, got, strict=True):
        for a, b in zip(w_step, g_step, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("name", sorted(RUNS_COMPILED) + ["plain"])
def test_gradient_only_makers_run_the_compiled_call(name):
    def make(model):
        if name == "plain":
            return GradientMaker(model)
        # SOAP: only full-rank sides rotated and a larger eps, else compile's
        # rounding is amplified (see tests/_helpers/precond_patterns.py).
        return make_gradient_maker(name, model, **METHOD_OPTIONS.get(name, {}))

    want = _grads(make, compiled=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*torch.compile'd")
        got = _grads(make, compiled=True)
    for w_step, g_step in zip(want, got, strict=True):
        for a, b in zip(w_step, g_step, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_compiled_original():
    model = _model()
    assert compiled_original(torch.compile(model)) is model

    def fn(x):
        return 2 * x

    assert compiled_original(torch.compile(fn)) is fn
    assert compiled_original(model) is None and compiled_original(fn) is None
