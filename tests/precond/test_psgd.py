"""Kronecker PSGD: the fitting rule against a dense one-step computation, and its
fixed points (Hessian inverse for HVP pairs, whitening for gradient pairs)."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leantrain.precond import PreconditioningConfig
from leantrain.precond.methods.psgd import PsgdGradientMaker, psgd_kron_update


def dense_update(ql, qr, dx, dg, lr):
    """Li (2018) Kronecker update written with explicit inverses."""
    rho = (ql.diagonal().max() / qr.diagonal().max()).sqrt()
    ql, qr = ql / rho, qr * rho
    a = ql @ dg @ qr.T
    b = torch.linalg.inv(ql).T @ dx @ torch.linalg.inv(qr)
    gl = torch.triu(a @ a.T - b @ b.T)
    gr = torch.triu(a.T @ a - b.T @ b)
    return ql - lr / gl.abs().max() * gl @ ql, qr - lr / gr.abs().max() * gr @ qr


def spd(n, seed):
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(n, n, generator=g, dtype=torch.float64)
    return m @ m.T / n + 0.5 * torch.eye(n, dtype=torch.float64)


def test_one_step_matches_dense_formula():
    g = torch.Generator().manual_seed(0)
    ql = torch.triu(
        torch.randn(3, 3, generator=g, dtype=torch.float64)
    ) + 2 * torch.eye(3)
    qr = torch.triu(
        torch.randn(4, 4, generator=g, dtype=torch.float64)
    ) + 3 * torch.eye(4)
    dx = torch.randn(3, 4, generator=g, dtype=torch.float64)
    dg = torch.randn(3, 4, generator=g, dtype=torch.float64)
    got = psgd_kron_update(ql, qr, dx, dg, 0.07)
    want = dense_update(ql, qr, dx, dg, 0.07)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        assert torch.equal(a, torch.triu(a))  # stays on the triangular group


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_hvp_fit_converges_to_inverse_kronecker_hessian():
    hl, hr = spd(3, 1), spd(4, 2)
    torch.manual_seed(0)
    model = nn.Linear(4, 3, bias=False).double()

    def quadratic(y):  # loss 1/2 vec(W)^T (H_l ⊗ H_r) vec(W); y only ties the graph
        w = model.weight
        return 0.5 * (w * (hl @ w @ hr)).sum() + 0 * y.sum()

    gm = PsgdGradientMaker(model, mode="hvp", precond_lr=0.05)
    x = torch.randn(2, 4, dtype=torch.float64)
    errors = []
    for _ in range(600):
        model.zero_grad()
        y = gm.setup_model_call(model, x)
        gm.setup_loss_call(quadratic, y)
        gm.forward_and_backward()
        pl, pr = gm.products[""]  # the root module
        errors.append(
            _rel(
                torch.kron(pl, pr),
                torch.kron(torch.linalg.inv(hl), torch.linalg.inv(hr)),
            )
        )
    assert errors[0] > 0.5 and errors[-1] < 0.1
    # and the preconditioned gradient is then nearly the Newton step W
    torch.testing.assert_close(
        model.weight.grad, model.weight.detach(), rtol=0.15, atol=0.05
    )


def test_whitening_fit_converges_to_inverse_sqrt_covariance():
    cl, cr = spd(3, 3), spd(4, 4)

    def root(m):
        vals, vecs = torch.linalg.eigh(m)
        return vecs @ torch.diag(vals.sqrt()) @ vecs.T

    sl, sr = root(cl), root(cr)
    g = torch.Generator().manual_seed(5)
    ql, qr = torch.eye(3, dtype=torch.float64), torch.eye(4, dtype=torch.float64)
    for i in range(3000):
        lr = 0.1 if i < 2000 else 0.02
        dx = torch.randn(3, 4, generator=g, dtype=torch.float64)
        dg = sl @ torch.randn(3, 4, generator=g, dtype=torch.float64) @ sr
        ql, qr = psgd_kron_update(ql, qr, dx, dg, lr)
    p = torch.kron(ql.T @ ql, qr.T @ qr)
    want = torch.linalg.inv(torch.kron(sl, sr))  # C^{-1/2}, C = C_l ⊗ C_r
    assert _rel(p, want) < 0.15


def test_maker_step_uses_seeded_probe_and_exact_hvp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    ref = copy.deepcopy(model)
    x = torch.randn(6, 3, dtype=torch.float64)
    t = torch.randint(0, 2, (6,))
    gm = PsgdGradientMaker(model, mode="hvp", precond_lr=0.2, seed=7)
    y = gm.setup_model_call(model, x)
    gm.setup_loss_call(F.cross_entropy, y, t)
    gm.forward_and_backward()
    gen = torch.Generator().manual_seed(7)
    probes = [
        torch.randn(4, 4, generator=gen, dtype=torch.float64),
        torch.randn(2, 5, generator=gen, dtype=torch.float64),
    ]
    params = list(ref.parameters())
    tangents = [probes[0][:, :3], probes[0][:, 3], probes[1][:, :4], probes[1][:, 4]]
    _, hv = torch.autograd.functional.hvp(
        lambda *ps: F.cross_entropy(
            torch.func.functional_call(
                ref,
                dict(zip([n for n, _ in ref.named_parameters()], ps, strict=True)),
                (x,),
            ),
            t,
        ),
        tuple(p.detach() for p in params),
        tuple(tangents),
    )
    loss = F.cross_entropy(ref(x), t)
    loss.backward()
    for k, (name, layer) in enumerate([("0", ref[0]), ("2", ref[2])]):
        dg = torch.cat([hv[2 * k], hv[2 * k + 1].unsqueeze(1)], 1)
        cols = dg.shape[1]
        eye_l = torch.eye(dg.shape[0], dtype=torch.float64)
        eye_r = torch.eye(cols, dtype=torch.float64)
        ql, qr = dense_update(eye_l, eye_r, probes[k], dg, 0.2)
        torch.testing.assert_close(gm.factors[name][0], ql)
        torch.testing.assert_close(gm.factors[name][1], qr)
        g = torch.cat([layer.weight.grad, layer.bias.grad.unsqueeze(1)], 1)
        want = ql.T @ ql @ g @ qr.T @ qr
        got = torch.cat(
            [
                model.get_submodule(name).weight.grad,
                model.get_submodule(name).bias.grad.unsqueeze(1),
            ],
            1,
        )
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("mode", ["hvp", "whitening"])
def test_state_dict_resume_is_bit_exact(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    data = [(torch.randn(5, 3), torch.randint(0, 2, (5,))) for _ in range(6)]

    def run(gm, model, chunk):
        for x, t in chunk:
            model.zero_grad()
            y = gm.setup_model_call(model, x)
            gm.setup_loss_call(F.cross_entropy, y, t)
            gm.forward_and_backward()

    gm = PsgdGradientMaker(model, mode=mode, precond_lr=0.1)
    run(gm, model, data[:3])
    buf = io.BytesIO()
    torch.save(gm.state_dict(), buf)
    model2 = copy.deepcopy(model)
    run(gm, model, data[3:])
    buf.seek(0)
    gm2 = PsgdGradientMaker(model2, mode=mode, precond_lr=0.1, seed=1)
    gm2.load_state_dict(torch.load(buf))
    run(gm2, model2, data[3:])
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize(
    ("kwargs", "err"),
    [
        ({"mode": "newton"}, ValueError),
        ({"precond_lr": 0.0}, ValueError),
        ({"precond_lr": "a"}, TypeError),
        ({"init_scale": -1.0}, ValueError),
        ({"config": PreconditioningConfig(ema_decay=0.9)}, ValueError),
    ],
)
def test_bad_arguments_raise(kwargs, err):
    with pytest.raises(err):
        PsgdGradientMaker(nn.Linear(2, 2), **kwargs)
