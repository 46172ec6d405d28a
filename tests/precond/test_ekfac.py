"""EKFAC: the dense definition Q diag(s + λ)^{-1} Q^T g, and it is not K-FAC."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leantrain.precond import PreconditioningConfig
from leantrain.precond.methods.ekfac import EkfacGradientMaker
from leantrain.precond.methods.kfac import KfacGradientMaker
from tests._helpers.kfac_models import assert_resume_bit_exact
from tests._helpers.kron_reference import (
    canonical_grad,
    kron_factors,
    per_example_grads,
)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def batch(shape=(12, 4), seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 3, (shape[0],), generator=g)


def step(gm, model, x, t):
    model.zero_grad()
    y = gm.setup_model_call(model, x)
    gm.setup_loss_call(F.cross_entropy, y, t)
    gm.forward_and_backward()


def dense_ekfac(model, x, t, names, lam):
    """Q diag(s + λ)^{-1} Q^T g with s = mean_n (Q^T g_n)^2, all dense."""
    ref = copy.deepcopy(model)
    F.cross_entropy(ref(x), t).backward()
    factors = kron_factors(ref, x, t, names, "fisher_emp")
    modules = dict(ref.named_modules())
    out = {}
    for name in names:
        m = modules[name]
        gw, gb = per_example_grads(ref, F.cross_entropy, x, t, [m.weight, m.bias])
        g_n = torch.cat([gw.flatten(2), gb.unsqueeze(-1)], -1).flatten(1)  # (N, P)
        a, b = factors[name]
        q = torch.kron(torch.linalg.eigh(b)[1], torch.linalg.eigh(a)[1])
        s = (g_n @ q).square().mean(0)
        g = canonical_grad(m).reshape(-1)
        out[name] = (q @ ((q.T @ g) / (s + lam))).reshape(canonical_grad(m).shape)
    return out


@pytest.mark.parametrize("lam", [1e-3, 1e-1])
def test_equals_dense_definition_and_differs_from_kfac(lam):
    model, (x, t) = mlp(), batch()
    want = dense_ekfac(model, x, t, ["0", "2"], lam)
    kfac_model = copy.deepcopy(model)
    gm = EkfacGradientMaker(
        model, PreconditioningConfig(damping=lam), fisher_type="fisher_emp"
    )
    step(gm, model, x, t)
    kfac = KfacGradientMaker(
        kfac_model,
        PreconditioningConfig(damping=lam),
        fisher_type="fisher_emp",
        damping_mode="exact",
    )
    step(kfac, kfac_model, x, t)
    for name in ("0", "2"):
        got = canonical_grad(dict(model.named_modules())[name])
        torch.testing.assert_close(got, want[name], rtol=1e-8, atol=1e-12)
        other = canonical_grad(dict(kfac_model.named_modules())[name])
        assert (got - other).norm() > 1e-3 * got.norm()  # not a no-op relabelling


def test_weight_shared_layer_scaling_matches_per_example_loop():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 2, 3), nn.Tanh(), nn.Flatten(), nn.Linear(8, 3)
    ).double()
    x, t = batch((5, 1, 4, 4))
    lam = 1e-2
    ref = copy.deepcopy(model)
    F.cross_entropy(ref(x), t).backward()
    factors = kron_factors(ref, x, t, ["0"], "fisher_emp")
    gw, gb = per_example_grads(ref, F.cross_entropy, x, t, [ref[0].weight, ref[0].bias])
    g_n = torch.cat([gw.flatten(2), gb.unsqueeze(-1)], -1).flatten(1)
    a, b = factors["0"]
    q = torch.kron(torch.linalg.eigh(b)[1], torch.linalg.eigh(a)[1])
    s = (g_n @ q).square().mean(0)
    g = canonical_grad(ref[0]).reshape(-1)
    want = (q @ ((q.T @ g) / (s + lam))).reshape(2, -1)
    gm = EkfacGradientMaker(
        model, PreconditioningConfig(damping=lam), fisher_type="fisher_emp"
    )
    step(gm, model, x, t)
    torch.testing.assert_close(canonical_grad(model[0]), want, rtol=1e-8, atol=1e-12)


def test_scaling_is_reestimated_between_basis_updates():
    model = mlp()
    cfg = PreconditioningConfig(
        curvature_interval=1, preconditioner_interval=2, ema_decay=0.5, damping=1e-2
    )
    gm = EkfacGradientMaker(model, cfg, fisher_type="fisher_emp")
    step(gm, model, *batch(seed=1))
    basis = gm.bases["0"][0][0].clone()
    scale = gm.scaling["0"][0].clone()
    step(gm, model, *batch(seed=2))  # curvature only: same basis, new scaling
    assert torch.equal(gm.bases["0"][0][0], basis)
    assert not torch.allclose(gm.scaling["0"][0], scale)
    step(gm, model, *batch(seed=3))  # preconditioner due: basis refreshed
    assert not torch.allclose(gm.bases["0"][0][0], basis)


def test_state_dict_resume_is_bit_exact():
    cfg = PreconditioningConfig(
        curvature_interval=1, preconditioner_interval=2, ema_decay=0.9, damping=1e-2
    )
    data = [batch(seed=s) for s in range(5)]
    assert_resume_bit_exact(
        lambda m: EkfacGradientMaker(m, cfg), mlp(), data, step_fn=step
    )
