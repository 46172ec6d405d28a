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


@pytest.mark.parametrize("name", sorted(PRECOND_METHODS))
def test_every_method_preconditions_a_bfloat16_model(name):
    # Curvature stays in float32 (LAPACK has no bf16); .grad keeps the model's dtype
    # and stays close to that of the model's float32 copy after two steps.
    if available_methods()[name] is not None:
        pytest.skip(f"{name} not importable here: {available_methods()[name]}")
    grads = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3))
        model = model.to(dtype)
        gm = make_gradient_maker(name, model)
        x = torch.randn(16, 6, generator=torch.Generator().manual_seed(1)).to(dtype)
        t = torch.arange(16) % 3
        for _ in range(2):
            for p in model.parameters():
                p.grad = None
            gm.setup_loss_call(F.cross_entropy, gm.setup_model_call(model, x), t)
            gm.forward_and_backward()
        grads[dtype] = [p.grad for p in model.parameters()]
    assert all(g.dtype == torch.bfloat16 for g in grads[torch.bfloat16])
    if name == "soap":
        # SOAP's first Adam steps are near-sign steps on every rotated entry: bf16
        # rounding of the gradient, spread over the small rotated entries, flips
        # them (and eigh picks another basis of the factors' null space), 15-85%
        # apart here. tests/precond/test_soap.py checks that its float32 state and
        # arithmetic give a bf16 model the float32 model's step on equal gradients.
        assert all(torch.isfinite(g).all() for g in grads[torch.bfloat16])
        return
    g32, g16 = (torch.cat([g.float().reshape(-1) for g in grads[d]]) for d in grads)
    # bf16 rounding moves every method by 0.4-3.5% here; the plain gradient instead
    # of the preconditioned one is 70-94% off (PSGD aside: 5%, its fitted
    # preconditioner is still near the identity after two steps).
    assert (g16 - g32).norm() / g32.norm() < 0.1


def test_overrides_and_errors():
    model = nn.Sequential(nn.Linear(4, 3))
    gm = make_gradient_maker(
        "ng_unit", model, config={"damping": 0.5}, fisher_type="fisher_emp"
    )
    assert gm.config.damping == 0.5 and gm.fisher_type == "fisher_emp"
    with pytest.raises(ValueError, match="unknown preconditioning method 'nope'"):
        make_gradient_maker("nope", model)
    assert issubclass(MethodUnavailableError, ImportError)


class SparseBag(nn.Module):
    def __init__(self):
        super().__init__()
        self.e = nn.Embedding(10, 8, sparse=True)
        self.head = nn.Linear(8, 3)

    def forward(self, ids):
        return self.head(self.e(ids).mean(1))


@pytest.mark.parametrize("name", sorted(PRECOND_METHODS))
def test_sparse_embedding_is_refused_by_name_or_left_alone(name):
    if available_methods()[name] is not None:
        pytest.skip(f"{name} not importable here: {available_methods()[name]}")
    torch.manual_seed(0)
    ids, t = torch.randint(0, 10, (6, 4)), torch.randint(0, 3, (6,))
    model = SparseBag()
    if name in ("psgd", "kbfgs"):  # Linear/Conv2d only: the sparse grad passes by
        gm = make_gradient_maker(name, model)
    else:
        with pytest.raises(ValueError, match=r"module 'e': Embedding\(sparse=True\)"):
            make_gradient_maker(name, model)
        gm = make_gradient_maker(name, model, config={"ignore_modules": (model.e,)})
    gm.setup_loss_call(F.cross_entropy, gm.setup_model_call(model, ids), t)
    gm.forward_and_backward()
    assert model.e.weight.grad.is_sparse
    assert torch.isfinite(model.head.weight.grad).all()


def test_complex_parameters_are_refused_by_name():
    model = nn.Sequential(nn.Linear(4, 4, dtype=torch.complex64))
    with pytest.raises(ValueError, match="module '0': parameter 'weight' is complex"):
        make_gradient_maker("kfac", model)
