"""Gram-matrix (Woodbury) inverses of low-rank K-FAC factors against dense inverses."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leantrain.precond import PreconditioningConfig
from leantrain.precond._gram import (
    CholeskyInverse,
    GramInverse,
    LowRankFactor,
    factor_inverse,
)
from leantrain.precond.methods.kfac import KfacGradientMaker


def dense_inverse(factor: LowRankFactor, damping: float) -> torch.Tensor:
    rows = factor.rows.double()
    d = rows.shape[1]
    eye = torch.eye(d, dtype=torch.float64)
    return torch.linalg.inv(factor.scale * rows.T @ rows + damping * eye)


# 128 rows: the Gram matrix is padded with zero rows (the oneMKL size rule).
@pytest.mark.parametrize(("rows", "width"), [(5, 9), (40, 64), (128, 200)])
@pytest.mark.parametrize("scale", [1.0, 1 / 7])
def test_gram_inverse_equals_dense_inverse(rows, width, scale):
    gen = torch.Generator().manual_seed(rows)
    z = torch.randn(rows, width, generator=gen, dtype=torch.float64)
    factor, damping = LowRankFactor(z, scale), 0.3
    inv = factor_inverse(factor, damping)
    assert isinstance(inv, GramInverse)
    want = dense_inverse(factor, damping)
    m = torch.randn(6, width, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(inv.right(m), m @ want, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(inv.left(m.T), want @ m.T, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(
        inv.rows_times_inverse(), z @ want, rtol=1e-9, atol=1e-12
    )


def test_tall_factor_takes_the_cholesky_inverse():
    z = torch.randn(30, 8, dtype=torch.float64)
    factor = LowRankFactor(z, 0.5)
    inv = factor_inverse(factor, 0.1)
    assert isinstance(inv, CholeskyInverse)
    want = dense_inverse(factor, 0.1)
    m = torch.randn(3, 8, dtype=torch.float64)
    torch.testing.assert_close(inv.right(m), m @ want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(inv.left(m.T), want @ m.T, rtol=1e-10, atol=1e-12)


def test_low_rank_factor_forms_traces_and_shapes():
    z = torch.randn(4, 6, dtype=torch.float64)
    factor = LowRankFactor(z, 0.25)
    dense = 0.25 * z.T @ z
    torch.testing.assert_close(factor.dense(), dense)
    assert factor.shape == (6, 6)
    assert factor.trace_mean() == pytest.approx(float(dense.trace()) / 6, rel=1e-12)


def test_gram_inverse_falls_back_to_float64_when_float32_fails():
    # Three equal rows and damping 1e-9: c I + Z Z^T is numerically indefinite in
    # float32, so the operator is built and applied in float64 (a float32 solve
    # against a float64 factor would return noise of order 1e2 here).
    z = torch.full((3, 5), 10.0)
    gram = z @ z.T
    gram.diagonal().add_(1e-9)
    assert torch.linalg.cholesky_ex(gram).info != 0  # the premise
    factor = LowRankFactor(z, 1.0)
    inv = GramInverse(factor, 1e-9)
    want = z.double() @ dense_inverse(factor, 1e-9)  # 10 / 300 everywhere
    torch.testing.assert_close(inv.rows_times_inverse().float(), want.float())
    m = torch.randn(2, 5)
    got = inv.right(m)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()


def wide_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3)
    ).double()


def train(low_rank: bool, steps: int = 3, **cfg):
    model = wide_mlp()
    config = PreconditioningConfig(damping=1e-2, **cfg)
    gm = KfacGradientMaker(model, config, low_rank=low_rank, seed=5)
    gen = torch.Generator().manual_seed(1)
    grads = []
    for _ in range(steps):
        x = torch.randn(8, 6, generator=gen, dtype=torch.float64)
        t = torch.randint(0, 3, (8,), generator=gen)
        for p in model.parameters():
            p.grad = None
        y = gm.setup_model_call(model, x)
        gm.setup_loss_call(F.cross_entropy, y, t)
        gm.forward_and_backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    return gm, grads


def test_low_rank_kfac_equals_the_dense_factor_path():
    # Monte-Carlo Fisher, every step, each factor replacing the last: batch 8 <
    # width 32, so every wide side goes through its Gram matrix; same draws.
    gm, grads = train(low_rank=True)
    ref, want = train(low_rank=False)
    kinds = {type(inv["A"][0]).__name__ for inv in gm.inverses.values()}
    assert "GramInverse" in kinds
    assert not any(inv.get("operators") for inv in ref.inverses.values())
    for got_step, want_step in zip(grads, want, strict=True):
        for got, exp in zip(got_step, want_step, strict=True):
            torch.testing.assert_close(got, exp, rtol=1e-9, atol=1e-12)
    # The factors read as tensors, equal to the dense path's.
    for name, f in ref.factors.items():
        for key in ("A", "B"):
            torch.testing.assert_close(gm.factors[name][key][0], f[key][0])


def test_low_rank_needs_replaced_factors_rebuilt_every_step():
    # An EMA or a preconditioner reused on later batches is full rank: dense path.
    gm, _ = train(low_rank=True, ema_decay=0.9)
    assert not any(inv.get("operators") for inv in gm.inverses.values())
    gm, _ = train(
        low_rank=True, curvature_interval=2, preconditioner_interval=2, steps=2
    )
    assert not any(inv.get("operators") for inv in gm.inverses.values())


def test_low_rank_state_dict_resume_is_bit_exact():
    gm, _ = train(low_rank=True, steps=2)
    state = copy.deepcopy(gm.state_dict())
    assert all(isinstance(t, torch.Tensor) for t in state["extra"]["factors"].values())
    model = copy.deepcopy(gm.model)
    resumed = KfacGradientMaker(model, gm.config, low_rank=True, seed=5)
    resumed.load_state_dict(state)
    x = torch.randn(8, 6, dtype=torch.float64)
    t = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    out = []
    for maker in (gm, resumed):
        m = maker.model
        for p in m.parameters():
            p.grad = None
        maker.setup_loss_call(F.cross_entropy, maker.setup_model_call(m, x), t)
        maker.forward_and_backward()
        out.append([p.grad for p in m.parameters()])
    for a, b in zip(*out, strict=True):
        assert torch.equal(a, b)


def test_low_rank_must_be_a_bool():
    with pytest.raises(TypeError, match="low_rank"):
        KfacGradientMaker(wide_mlp(), low_rank="yes")


@pytest.mark.parametrize(("interval", "low_rank"), [(1, True), (1, False), (2, True)])
def test_bfloat16_model_is_preconditioned_like_its_float32_copy(interval, low_rank):
    # LAPACK has no bfloat16: factors are float32 and the solves run there, so a
    # bf16 model is preconditioned at the default interval 1 too.
    torch.manual_seed(0)
    net32 = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3))
    net16 = copy.deepcopy(net32).to(torch.bfloat16)
    x, t = torch.randn(4, 6), torch.tensor([0, 1, 2, 0])
    cfg = PreconditioningConfig(
        damping=1e-1, curvature_interval=interval, preconditioner_interval=interval
    )
    grads = []
    for net, inputs in ((net32, x), (net16, x.bfloat16())):
        gm = KfacGradientMaker(net, cfg, fisher_type="fisher_exact", low_rank=low_rank)
        gm.setup_loss_call(F.cross_entropy, gm.setup_model_call(net, inputs), t)
        gm.forward_and_backward()
        grads.append([p.grad for p in net.parameters()])
    for g32, g16 in zip(*grads, strict=True):
        assert g16.dtype == torch.bfloat16
        err = (g16.float() - g32).norm() / g32.norm()
        assert err < 5e-2, err
