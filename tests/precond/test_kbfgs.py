"""K-BFGS: the BFGS update and damping against dense formulas, and one maker step
recomputed from the definition (secant pair on one batch at two parameter points)."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leantrain.precond import PreconditioningConfig
from leantrain.precond.methods.kbfgs import (
    KbfgsGradientMaker,
    bfgs_inverse_update,
    powell_lm_damping,
)
from tests._helpers.kron_reference import canonical_grad, layer_data


def spd(n, seed):
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(n, n, generator=g, dtype=torch.float64)
    return m @ m.T / n + 0.3 * torch.eye(n, dtype=torch.float64)


def dense_bfgs(h, s, y):
    """Direct BFGS on B = H^{-1}, inverted back."""
    b = torch.linalg.inv(h)
    bs = b @ s
    b_new = b - torch.outer(bs, bs) / (s @ bs) + torch.outer(y, y) / (y @ s)
    return torch.linalg.inv(b_new)


def test_bfgs_update_matches_dense_and_satisfies_secant():
    g = torch.Generator().manual_seed(0)
    h = spd(5, 1)
    s = torch.randn(5, generator=g, dtype=torch.float64)
    y = spd(5, 2) @ s  # curvature pair of an SPD Hessian: s^T y > 0
    new = bfgs_inverse_update(h, s, y)
    torch.testing.assert_close(new, dense_bfgs(h, s, y), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(new @ y, s, rtol=1e-10, atol=1e-12)  # secant
    torch.testing.assert_close(new, new.T)
    assert torch.linalg.eigvalsh(new).min() > 0


def test_powell_lm_damping_restores_curvature_condition():
    h, mu1, mu2 = spd(4, 3), 0.2, 0.1
    g = torch.Generator().manual_seed(4)
    s = torch.randn(4, generator=g, dtype=torch.float64)
    y = -s  # negative curvature: s^T y < 0
    s2, y2 = powell_lm_damping(h, s, y, mu1, mu2)
    hy = h @ y
    torch.testing.assert_close(s2 @ y, mu1 * (y @ hy))  # Powell: exactly the bound
    torch.testing.assert_close(y2, y + mu2 * s2)
    assert s2 @ y2 > 0
    # a pair that already has enough curvature is left alone (before LM damping)
    y_ok = spd(4, 5) @ s
    s3, y3 = powell_lm_damping(
        torch.eye(4, dtype=torch.float64) * 1e-3, s, y_ok, mu1, mu2
    )
    assert torch.equal(s3, s)
    torch.testing.assert_close(y3, y_ok + mu2 * s)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()


def data(seed):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(8, 3, generator=g, dtype=torch.float64),
        torch.randint(0, 2, (8,), generator=g),
    )


def step(gm, model, x, t):
    model.zero_grad()
    y = gm.setup_model_call(model, x)
    gm.setup_loss_call(F.cross_entropy, y, t)
    gm.forward_and_backward()


def means(model, x, t, name):
    """Mean pre-activation and summed pre-activation gradient of layer ``name``."""
    logits, store = layer_data(model, x, [name])
    out = store[name][1]
    (g,) = torch.autograd.grad(F.cross_entropy(logits, t), out)
    return out.detach().mean(0), g.sum(0)


def test_second_step_equals_definition():
    lam, mu1 = 1e-2, 0.2
    model = mlp()
    before = copy.deepcopy(model)
    gm = KbfgsGradientMaker(model, PreconditioningConfig(damping=lam), mu1=mu1)
    x1, t1 = data(1)
    step(gm, model, x1, t1)
    assert gm.h_inverse == {} and gm.bfgs_updates == 0
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.5 * p.grad
    after = copy.deepcopy(model)
    x2, t2 = data(2)
    step(gm, model, x2, t2)
    assert gm.bfgs_updates == 1
    F.cross_entropy(after(x2), t2).backward()
    for name in ("0", "2"):
        layer = dict(after.named_modules())[name]
        h_now, g_now = means(after, x2, t2, name)
        h_old, g_old = means(before, x2, t2, name)
        s, y = h_now - h_old, g_now - g_old
        eye = torch.eye(s.shape[0], dtype=torch.float64)
        # Powell (on H = I) then LM, written out
        hy = eye @ y
        if s @ y < mu1 * (y @ hy):
            theta = (1 - mu1) * (y @ hy) / (y @ hy - s @ y)
            s = theta * s + (1 - theta) * hy
        y = y + lam**0.5 * s
        h = dense_bfgs(eye, s, y)
        inp = layer_data(after, x2, [name])[1][name][0].detach()
        a = torch.cat([inp, torch.ones(8, 1, dtype=torch.float64)], 1)
        a = a.T @ a / 8
        want = (
            h
            @ canonical_grad(layer)
            @ torch.linalg.inv(
                a + lam**0.5 * torch.eye(a.shape[0], dtype=torch.float64)
            )
        )
        got = canonical_grad(dict(model.named_modules())[name])
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-12)
        torch.testing.assert_close(gm.h_inverse[name] @ y, s)  # secant on the pair
    # the parameters are restored after the pass at the previous point
    for p, q in zip(model.parameters(), after.parameters(), strict=True):
        assert torch.equal(p, q)


def test_state_dict_resume_is_bit_exact():
    cfg = PreconditioningConfig(
        damping=1e-2, ema_decay=0.8, curvature_interval=2, preconditioner_interval=2
    )
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    batches = [data(s) for s in range(7)]
    gm = KbfgsGradientMaker(model, cfg)

    def run(gm, model, opt, chunk):
        for x, t in chunk:
            step(gm, model, x, t)
            opt.step()

    run(gm, model, opt, batches[:3])
    buf = io.BytesIO()
    torch.save({"gm": gm.state_dict(), "model": model.state_dict()}, buf)
    run(gm, model, opt, batches[3:])
    buf.seek(0)
    saved = torch.load(buf)
    model2 = mlp()
    model2.load_state_dict(saved["model"])
    gm2 = KbfgsGradientMaker(model2, cfg)
    gm2.load_state_dict(saved["gm"])
    run(gm2, model2, torch.optim.SGD(model2.parameters(), lr=0.2), batches[3:])
    assert gm2.bfgs_updates == gm.bfgs_updates >= 2
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    ("mu1", "err"), [(0.0, ValueError), (1.0, ValueError), ("x", TypeError)]
)
def test_bad_mu1_raises(mu1, err):
    with pytest.raises(err, match="mu1"):
        KbfgsGradientMaker(mlp(), mu1=mu1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unchanged_weights_skip_the_bfgs_update_and_stay_finite(dtype):
    # Two curvature steps with no optimizer step between them (a step GradScaler
    # skipped, lr 0): s = 0, so the pair is skipped instead of dividing by s^T y = 0.
    # A bf16 model runs its statistics in float32.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3)).to(dtype)
    gm = KbfgsGradientMaker(net, PreconditioningConfig(damping=1e-2))
    x, t = torch.randn(16, 6, dtype=dtype), torch.randint(0, 3, (16,))
    for _ in range(3):
        for p in net.parameters():
            p.grad = None
        gm.setup_loss_call(F.cross_entropy, gm.setup_model_call(net, x), t)
        gm.forward_and_backward()
        assert all(torch.isfinite(p.grad.float()).all() for p in net.parameters())
        assert all(p.grad.dtype == dtype for p in net.parameters())
    assert gm.bfgs_updates == 0 and not gm.h_inverse
