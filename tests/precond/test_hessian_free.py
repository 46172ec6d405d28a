"""HessianFreeGradientMaker: CG on GGN / Hessian products vs direct dense solves."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from leantrain.precond import PreconditioningConfig
from leantrain.precond.curv import dense_ggn, dense_hessian
from leantrain.precond.methods.hessian_free import (
    HessianFreeGradientMaker,
    conjugate_gradient,
)
from tests._helpers.ng_reference import (
    batch,
    damped_solve,
    flat_grad,
    make_net,
    mlp,
    run_maker,
)


def test_cg_solves_spd_system():
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(12, 12, generator=gen, dtype=torch.float64)
    a = m @ m.T + 0.1 * torch.eye(12, dtype=torch.float64)
    b = torch.randn(12, generator=gen, dtype=torch.float64)
    x, iters = conjugate_gradient(lambda v: a @ v, b, max_iters=100, tol=1e-14)
    torch.testing.assert_close(x, torch.linalg.solve(a, b), rtol=1e-9, atol=1e-10)
    assert iters <= 100
    x, iters = conjugate_gradient(lambda v: a @ v, b, max_iters=3, tol=0.0)
    assert iters == 3


def test_cg_stops_on_negative_curvature():
    a = torch.diag(torch.tensor([-1.0, 2.0], dtype=torch.float64))
    b = torch.tensor([1.0, 0.0], dtype=torch.float64)
    x, iters = conjugate_gradient(lambda v: a @ v, b, max_iters=10, tol=0.0)
    assert iters == 0 and torch.equal(x, b)


@pytest.mark.parametrize("curvature", ["ggn", "hessian"])
@pytest.mark.parametrize("net", ["mlp", "conv", "norm"])
def test_cg_matches_direct_solve(net, curvature):
    torch.manual_seed(0)
    model = make_net(net)
    x, t = batch(model)
    dense = dense_ggn if curvature == "ggn" else dense_hessian
    c = dense(model, nn.CrossEntropyLoss(), x, t)
    damping = 0.1 + max(0.0, -float(torch.linalg.eigvalsh(c).min()))
    expected = damped_solve(c, flat_grad(model, x, t), damping)
    p = c.shape[0]
    gm = HessianFreeGradientMaker(
        model,
        PreconditioningConfig(damping=damping),
        curvature=curvature,
        max_iters=4 * p,
        tol=1e-13,
    )
    got = run_maker(gm, model, x, t)
    assert (expected - got).abs().max() <= 1e-8 * max(1.0, float(expected.abs().max()))
    assert gm.curvature_updates == 1 and gm.last_iterations < 4 * p


def test_errors():
    with pytest.raises(ValueError, match="curvature_interval and preconditioner_"):
        HessianFreeGradientMaker(
            mlp(),
            PreconditioningConfig(curvature_interval=2, preconditioner_interval=2),
        )
    with pytest.raises(ValueError, match="curvature must be one of"):
        HessianFreeGradientMaker(mlp(), curvature="fisher")
    with pytest.raises(ValueError, match="max_iters must be >= 1"):
        HessianFreeGradientMaker(mlp(), max_iters=0)
