"""SmwNgGradientMaker: SMW natural gradient against a dense empirical-Fisher solve."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from leantrain.precond import PreconditioningConfig
from leantrain.precond.curv import dense_empirical_fisher
from leantrain.precond.methods.smw_ng import SmwNgGradientMaker, smw_natural_gradient
from tests._helpers.ng_reference import (
    assert_resumes_bit_exactly,
    batch,
    damped_solve,
    flat_grad,
    make_net,
    mlp,
    per_example_grads,
    run_maker,
)

DAMPING = 1e-2


@pytest.mark.parametrize("net", ["mlp", "conv", "norm"])
def test_matches_dense_solve(net):
    torch.manual_seed(0)
    model = make_net(net)
    x, t = batch(model)
    fisher = dense_empirical_fisher(model, nn.CrossEntropyLoss(), x, t)
    expected = damped_solve(fisher, flat_grad(model, x, t), DAMPING)
    gm = SmwNgGradientMaker(model, PreconditioningConfig(damping=DAMPING))
    torch.testing.assert_close(
        run_maker(gm, model, x, t), expected, rtol=1e-9, atol=1e-11
    )


def test_reference_formula_matches_dense():
    torch.manual_seed(0)
    model = mlp()
    x, t = batch(model)
    u = per_example_grads(model, x, t).T / x.shape[0] ** 0.5  # U U^T = mean g g^T
    g = flat_grad(model, x, t)
    torch.testing.assert_close(
        smw_natural_gradient(u, g, DAMPING), damped_solve(u @ u.T, g, DAMPING)
    )


def test_interval_reuses_stale_factors():
    torch.manual_seed(0)
    model = mlp()
    cfg = PreconditioningConfig(
        damping=DAMPING, curvature_interval=2, preconditioner_interval=2
    )
    gm = SmwNgGradientMaker(model, cfg)
    for step in range(5):
        x, t = batch(model, seed=step)
        got = run_maker(gm, model, x, t)
        if step % 2 == 0:
            fisher = dense_empirical_fisher(model, nn.CrossEntropyLoss(), x, t)
        torch.testing.assert_close(
            got,
            damped_solve(fisher, flat_grad(model, x, t), DAMPING),
            rtol=1e-8,
            atol=1e-10,
        )
    assert gm.curvature_updates == 3 and gm.preconditioner_updates == 3


def test_state_dict_resumes_bit_exactly():
    torch.manual_seed(0)
    cfg = PreconditioningConfig(
        damping=DAMPING, curvature_interval=2, preconditioner_interval=2
    )
    a = mlp()
    b = copy.deepcopy(a)
    gm_a = SmwNgGradientMaker(a, cfg)
    for step in range(3):
        run_maker(gm_a, a, *batch(a, seed=step))
    assert_resumes_bit_exactly(
        gm_a, a, b, lambda m: SmwNgGradientMaker(m, cfg), range(3, 6)
    )


def test_errors():
    with pytest.raises(ValueError, match="ema_decay=0.9 cannot be applied"):
        SmwNgGradientMaker(mlp(), PreconditioningConfig(ema_decay=0.9))
    gm = SmwNgGradientMaker(mlp())
    with pytest.raises(ValueError, match="'factors' and 'cholesky'"):
        gm.load_state_dict({**gm.state_dict(), "extra": {"x": 1}})
