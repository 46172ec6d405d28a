"""NewtonGradientMaker against a torch.func.hessian solve."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, hessian

from leantrain.precond import PreconditioningConfig
from leantrain.precond.methods.newton import NewtonGradientMaker, newton_direction
from tests._helpers.ng_reference import (
    ConvNet,
    NormNet,
    assert_resumes_bit_exactly,
    batch,
    damped_solve,
    flat_grad,
    mlp,
    run_maker,
)


def func_hessian(model, x, t) -> torch.Tensor:
    """Dense Hessian from torch.func.hessian on the flat parameter vector."""
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def loss(flat):
        params, start = {}, 0
        for n, s in zip(names, shapes, strict=True):
            params[n] = flat[start : start + s.numel()].reshape(s)
            start += s.numel()
        return F.cross_entropy(functional_call(model, params, (x,)), t)

    return hessian(loss)(theta)


@pytest.mark.parametrize("absolute", [False, True])
@pytest.mark.parametrize("net", ["mlp", "conv"])
def test_matches_func_hessian_solve(net, absolute):
    torch.manual_seed(0)
    model = mlp() if net == "mlp" else ConvNet().double()
    x, t = batch(model)
    h = func_hessian(model, x, t)
    vals, vecs = torch.linalg.eigh(h)
    damping = 0.5 if absolute else float(vals.min().abs()) + 0.5  # keep H + l I > 0
    if absolute:
        h = vecs @ torch.diag(vals.abs()) @ vecs.T
    expected = damped_solve(h, flat_grad(model, x, t), damping)
    gm = NewtonGradientMaker(
        model, PreconditioningConfig(damping=damping), absolute=absolute
    )
    torch.testing.assert_close(
        run_maker(gm, model, x, t), expected, rtol=1e-9, atol=1e-11
    )


def test_norm_layers_and_reference():
    torch.manual_seed(0)
    model = NormNet().double()
    x, t = batch(model)
    from leantrain.precond.curv import dense_hessian

    h = dense_hessian(model, "cross_entropy", x, t)  # autograd reference (see docs)
    expected = newton_direction(h, flat_grad(model, x, t), 0.3, absolute=True)
    gm = NewtonGradientMaker(model, PreconditioningConfig(damping=0.3), absolute=True)
    torch.testing.assert_close(
        run_maker(gm, model, x, t), expected, rtol=1e-8, atol=1e-10
    )


def test_interval_and_state_dict():
    torch.manual_seed(0)
    cfg = PreconditioningConfig(
        damping=0.5, curvature_interval=2, preconditioner_interval=2
    )
    a = mlp()
    b = copy.deepcopy(a)
    gm_a = NewtonGradientMaker(a, cfg, absolute=True)
    for step in range(3):
        x, t = batch(a, seed=step)
        got = run_maker(gm_a, a, x, t)
        if step % 2 == 0:
            h = func_hessian(a, x, t)
        expected = newton_direction(h, flat_grad(a, x, t), 0.5, absolute=True)
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-11)
    assert gm_a.curvature_updates == 2
    assert_resumes_bit_exactly(
        gm_a, a, b, lambda m: NewtonGradientMaker(m, cfg, absolute=True), range(3, 6)
    )


def test_errors():
    with pytest.raises(ValueError, match="max_params=10"):
        NewtonGradientMaker(mlp(), max_params=10)
    with pytest.raises(TypeError, match="absolute must be a bool"):
        NewtonGradientMaker(mlp(), absolute=1)
