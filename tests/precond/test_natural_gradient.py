"""NaturalGradientMaker: every shape against a dense solve, schedule, state, errors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from leantrain.precond import PreconditioningConfig
from leantrain.precond.curv import dense_empirical_fisher, dense_ggn
from leantrain.precond.methods.natural_gradient import (
    NaturalGradientMaker,
    natural_gradient,
)
from tests._helpers.ng_reference import (
    assert_resumes_bit_exactly,
    batch,
    block_mask,
    damped_solve,
    flat_grad,
    make_net,
    mlp,
    run_maker,
)

DAMPING = 1e-2


@pytest.mark.parametrize("shape", ["full", "layer", "unit", "diag"])
@pytest.mark.parametrize("kind", ["fisher_exact", "fisher_emp"])
@pytest.mark.parametrize("net", ["mlp", "conv", "norm"])
def test_matches_dense_solve(shape, kind, net):
    torch.manual_seed(1)
    model = make_net(net)
    x, t = batch(model)
    dense = dense_ggn if kind == "fisher_exact" else dense_empirical_fisher
    fisher = dense(model, nn.CrossEntropyLoss(), x, t)
    fisher = torch.where(block_mask(model, shape), fisher, torch.zeros_like(fisher))
    expected = damped_solve(fisher, flat_grad(model, x, t), DAMPING)
    gm = NaturalGradientMaker(
        model, PreconditioningConfig(damping=DAMPING), fisher_type=kind, shape=shape
    )
    got = run_maker(gm, model, x, t)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-11)


def test_reference_solve():
    gen = torch.Generator().manual_seed(0)
    u = torch.randn(5, 3, generator=gen, dtype=torch.float64)
    g = torch.randn(5, generator=gen, dtype=torch.float64)
    got = natural_gradient(u @ u.T, g, 0.1)
    torch.testing.assert_close((u @ u.T + 0.1 * torch.eye(5)) @ got, g)


def test_mc_fisher_is_unbiased_on_average():
    """The MC diagonal averaged over many seeds approaches the exact one."""
    torch.manual_seed(0)
    model = mlp()
    x, t = batch(model, n=8)
    exact = dense_ggn(model, nn.CrossEntropyLoss(), x, t).diagonal()
    gm = NaturalGradientMaker(
        model,
        PreconditioningConfig(damping=DAMPING),
        fisher_type="fisher_mc",
        shape="diag",
        n_mc_samples=400,
        seed=3,
    )
    run_maker(gm, model, x, t)
    mc = torch.cat([gm.fisher[n].reshape(-1) for n in ("0", "2")])
    # canonical (R, U) = [weight row, bias]; compare the totals (layout-free)
    assert abs(float(mc.sum() / exact.sum()) - 1.0) < 0.1


def test_interval_schedule_reuses_stale_inverse():
    torch.manual_seed(0)
    model = mlp()
    cfg = PreconditioningConfig(
        damping=DAMPING, curvature_interval=3, preconditioner_interval=3
    )
    gm = NaturalGradientMaker(model, cfg, fisher_type="fisher_emp", shape="layer")
    calls = []
    original = gm.update_curvature
    gm.update_curvature = lambda: (calls.append(gm.step), original())[1]
    stale = None
    for step in range(7):
        x, t = batch(model, seed=step)
        got = run_maker(gm, model, x, t)
        if step % 3 == 0:
            fisher = dense_empirical_fisher(model, nn.CrossEntropyLoss(), x, t)
            stale = torch.where(block_mask(model, "layer"), fisher, 0 * fisher)
        # stale preconditioner from the last due step, gradient of this batch
        expected = damped_solve(stale, flat_grad(model, x, t), DAMPING)
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-11)
    assert calls == [0, 3, 6]
    assert gm.curvature_updates == 3 and gm.preconditioner_updates == 3


def test_state_dict_resumes_bit_exactly():
    torch.manual_seed(0)
    cfg = PreconditioningConfig(
        damping=DAMPING, curvature_interval=2, preconditioner_interval=2, ema_decay=0.9
    )
    a = mlp()
    b = copy.deepcopy(a)
    gm_a = NaturalGradientMaker(a, cfg, fisher_type="fisher_mc", shape="unit")
    for step in range(3):
        run_maker(gm_a, a, *batch(a, seed=step))
    assert_resumes_bit_exactly(
        gm_a,
        a,
        b,
        lambda m: NaturalGradientMaker(
            m, cfg, fisher_type="fisher_mc", shape="unit", seed=9
        ),
        range(3, 6),
    )


def test_errors():
    model = mlp()
    with pytest.raises(ValueError, match="shape must be one of"):
        NaturalGradientMaker(model, shape="kron")
    with pytest.raises(ValueError, match="fisher_type must be one of"):
        NaturalGradientMaker(model, fisher_type="hessian")
    with pytest.raises(ValueError, match="max_block=10"):
        NaturalGradientMaker(model, shape="layer", max_block=10)
    with pytest.raises(TypeError, match="max_block"):
        NaturalGradientMaker(model, max_block=1.5)
    gm = NaturalGradientMaker(model, shape="diag")
    with pytest.raises(ValueError, match="'fisher', 'preconditioner'"):
        gm.load_state_dict({**gm.state_dict(), "extra": {}})
