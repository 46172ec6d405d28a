"""The method registry: every registered method builds and runs one step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leantrain.precond import PreconditionedGradientMaker
from leantrain.precond.registry import (
    PRECOND_METHODS,
    MethodUnavailableError,
    available_methods,
    make_gradient_maker,
)


@pytest.mark.parametrize("name", sorted(PRECOND_METHODS))
def test_every_method_builds_and_steps(name):
    if available_methods()[name] is not None:
        pytest.skip(f"{name} not importable here: {available_methods()[name]}")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    gm = make_gradient_maker(name, model)
    assert isinstance(gm, PreconditionedGradientMaker)
    x = torch.randn(8, 4)
    t = torch.randint(0, 3, (8,))
    y = gm.setup_model_call(model, x)
    gm.setup_loss_call(F.cross_entropy, y, t)
    gm.forward_and_backward()
    grads = [p.grad for p in model.parameters()]
    assert all(torch.isfinite(g).all() for g in grads)


def test_overrides_and_errors():
    model = nn.Sequential(nn.Linear(4, 3))
    gm = make_gradient_maker(
        "ng_unit", model, config={"damping": 0.5}, fisher_type="fisher_emp"
    )
    assert gm.config.damping == 0.5 and gm.fisher_type == "fisher_emp"
    with pytest.raises(ValueError, match="unknown preconditioning method 'nope'"):
        make_gradient_maker("nope", model)
    assert issubclass(MethodUnavailableError, ImportError)
