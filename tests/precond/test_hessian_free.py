"""HessianFreeGradientMaker: CG on GGN / Hessian products vs direct dense solves."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _ng_reference import ConvNet, NormNet, damped_solve, flat_grad, mlp, read_grads
from torch import nn

from leantrain.precond import PreconditioningConfig
from leantrain.precond.curv import dense_ggn, dense_hessian
from leantrain.precond.hessian_free import HessianFreeGradientMaker, conjugate_gradient


def _batch(model, n=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (n, 1, 5, 5) if isinstance(model, ConvNet) else (n, 4)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    return x, torch.randint(0, 3, (n,), generator=gen)


def _run(gm, model, x, t):
    model.zero_grad()
    y = gm.setup_model_call(model, x)
    gm.setup_loss_call(F.cross_entropy, y, t)
    gm.forward_and_backward()
    return read_grads(model)


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
    model = {
        "mlp": mlp,
        "conv": lambda: ConvNet().double(),
        "norm": lambda: NormNet().double(),
    }[net]()
    x, t = _batch(model)
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
    got = _run(gm, model, x, t)
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
