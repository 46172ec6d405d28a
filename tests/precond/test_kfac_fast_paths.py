"""K-FAC's fast routes (factored layers, Cholesky solves, Gram-matrix inverses)
give the dense formulas' results."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leantrain.precond import PreconditioningConfig
from leantrain.precond._gram import GramInverse
from leantrain.precond.methods.kfac import KfacGradientMaker
from tests._helpers.kfac_models import (
    assert_resume_bit_exact,
    batch,
    factor_dampings,
    plain_grads,
    step,
)
from tests._helpers.kron_reference import canonical_grad, dense_solve, kron_factors


# -- fast paths: same results as the dense formulas --------------------------------
def wide_mlp(inplace: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16),
        nn.ReLU(inplace=inplace),
        nn.Linear(16, 16),
        nn.Tanh(),
        nn.Linear(16, 3),
    ).double()


def factored_want(ref, x, t, mode, lam, names=("0", "2", "4")):
    factors = kron_factors(ref, x, t, list(names), "fisher_exact")
    want = {}
    for name in names:
        a, b = factors[name]
        damp_a, damp_b = factor_dampings(a, b, lam, mode)
        g = canonical_grad(dict(ref.named_modules())[name])
        want[name] = dense_solve(a, b, g, damp_a=damp_a, damp_b=damp_b)
    return want


@pytest.mark.parametrize("mode", ["pi", "tikhonov"])
@pytest.mark.parametrize(("interval", "low_rank"), [(1, True), (1, False), (2, True)])
def test_wide_layers_skip_weight_gradient_and_match_formula(mode, interval, low_rank):
    # batch 4 < width 16: layers "0" and "2" are preconditioned as
    # (B^-1 E^T)(X A^-1) without forming dW; interval 1 keeps Cholesky factors,
    # or (low_rank) inverts the 5-row input factors through their 5x5 Gram matrix.
    model, lam = wide_mlp(), 1e-2
    x, t = batch((4, 6))
    cfg = PreconditioningConfig(
        damping=lam, curvature_interval=interval, preconditioner_interval=interval
    )
    gm = KfacGradientMaker(
        model, cfg, fisher_type="fisher_exact", damping_mode=mode, low_rank=low_rank
    )
    ref = plain_grads(model, x, t)
    step(gm, model, x, t)
    assert gm._capture.records["2"] is not None  # the factored path ran
    assert gm._capture.records["4"] is None  # narrow output: plain dW
    if interval == 1 and low_rank:
        assert gm.inverses["2"]["operators"]
        assert isinstance(gm.inverses["2"]["A"][0], GramInverse)
    else:
        assert gm.inverses["2"].get("cholesky", False) == (interval == 1)
    want = factored_want(ref, x, t, mode, lam)
    for name in ("0", "2", "4"):
        got = canonical_grad(dict(model.named_modules())[name])
        torch.testing.assert_close(got, want[name], rtol=1e-9, atol=1e-12)
    if interval == 2:  # next step: no curvature, stale inverses, factored again
        x2 = x.flip(0) * 2
        ref = plain_grads(model, x2, t)
        step(gm, model, x2, t)
        assert gm._capture.records["2"] is not None
        inv = gm.inverses["2"]
        want = inv["B"][0] @ canonical_grad(ref[2]) @ inv["A"][0]
        torch.testing.assert_close(canonical_grad(model[2]), want, rtol=1e-9, atol=0)


def test_accumulated_grad_is_preconditioned_whole():
    # .grad already holds a gradient: the preconditioned gradient is that of the
    # sum, as for loss.backward(); the factored path must step aside.
    model, lam = wide_mlp(), 1e-2
    x, t = batch((4, 6))
    gm = KfacGradientMaker(
        model, PreconditioningConfig(damping=lam), fisher_type="fisher_exact"
    )
    old = [torch.randn_like(p) for p in model.parameters()]
    for p, g in zip(model.parameters(), old, strict=True):
        p.grad = g.clone()
    y = gm.setup_model_call(model, x)
    gm.setup_loss_call(F.cross_entropy, y, t)
    gm.forward_and_backward()
    ref = plain_grads(model, x, t)
    for p, g in zip(ref.parameters(), old, strict=True):
        p.grad += g
    want = factored_want(ref, x, t, "pi", lam)
    for name in ("0", "2", "4"):
        got = canonical_grad(dict(model.named_modules())[name])
        torch.testing.assert_close(got, want[name], rtol=1e-9, atol=1e-12)


def test_inplace_activation_gives_the_same_preconditioned_gradient():
    # ReLU(inplace=True) rewrites layer "0"'s output after its hook: the output
    # gradient would belong to the rewritten tensor, so both the gradient capture
    # and the curvature pass fall back to parameter gradients.
    x, t = batch((4, 6))
    grads = []
    for inplace in (False, True):
        model = wide_mlp(inplace)
        gm = KfacGradientMaker(model, PreconditioningConfig(damping=1e-2))
        for _ in range(2):
            step(gm, model, x, t)
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_cholesky_state_dict_resume_is_bit_exact():
    cfg = PreconditioningConfig(ema_decay=0.9, damping=1e-2)  # interval 1: Cholesky
    data = [batch((4, 6)) for _ in range(4)]
    data = [(x * (1 + i), t) for i, (x, t) in enumerate(data)]

    def saved_cholesky(state):
        assert any(k.endswith("/cholesky") for k in state["extra"]["inverses"])

    def loaded_cholesky(gm):
        assert gm.inverses["2"]["cholesky"] is True

    assert_resume_bit_exact(
        lambda m: KfacGradientMaker(m, cfg),
        wide_mlp(),
        data,
        on_save=saved_cholesky,
        on_load=loaded_cholesky,
    )


@pytest.mark.parametrize("cholesky", [False, True])
def test_batched_damped_inverses_equal_one_at_a_time(cholesky):
    # Mixed shapes and dampings, groups interleaved, one float32 group with a
    # member that is indefinite after damping in float32 (the group is redone one
    # by one, through the single-matrix path's float64 retry): each result is the
    # single-matrix function's, in its place.
    from leantrain.precond._kron import damped_inverses
    from leantrain.precond.curv import damped_cholesky, damped_inverse

    gen = torch.Generator().manual_seed(2)

    def psd(n, dtype=torch.float64):
        m = torch.randn(n, n + 3, generator=gen, dtype=torch.float64)
        return (m @ m.T).to(dtype)

    # exact in float32; + 0.1 I is positive definite, but float32's Cholesky
    # rounds the rank-one update to a negative pivot, float64's does not
    v = torch.arange(1.0, 7.0)
    rank_one = torch.outer(v, v) * 2.0**20
    matrices = [psd(5), psd(3), psd(5), rank_one, psd(6, torch.float32), psd(3)]
    dampings = [1e-2, 3e-1, 2e-3, 1e-1, 5e-2, 1e-1]
    assert torch.linalg.cholesky_ex(rank_one + 0.1 * torch.eye(6))[1] != 0
    got = damped_inverses(matrices, dampings, cholesky=cholesky)
    single = damped_cholesky if cholesky else damped_inverse
    for m, d, g in zip(matrices, dampings, got, strict=True):
        want = single(m, d)
        assert g.dtype == m.dtype and g.is_contiguous()
        torch.testing.assert_close(g, want, rtol=1e-6, atol=0.0)
