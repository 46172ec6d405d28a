"""K-FAC: preconditioned gradients against dense definitions, schedule, state."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leantrain.precond import PreconditioningConfig
from leantrain.precond.methods.kfac import KfacGradientMaker, kfac_precondition
from tests._helpers.kfac_models import (
    batch,
    cnn,
    factor_dampings,
    mlp,
    plain_grads,
    step,
)
from tests._helpers.kron_reference import (
    canonical_grad,
    dense_solve,
    kron_factors,
    per_example_grads,
)


def assert_exact_damping_equals_dense(model, x, t, names, kind, lam=1e-2):
    """One step of K-FAC with ``damping_mode="exact"`` gives, per module in ``names``,
    the dense ``(B ⊗ A + λ I)^{-1} g`` of the reference factors."""
    ref = plain_grads(model, x, t)
    factors = kron_factors(ref, x, t, list(names), kind)
    gm = KfacGradientMaker(
        model,
        PreconditioningConfig(damping=lam),
        fisher_type=kind,
        damping_mode="exact",
    )
    step(gm, model, x, t)
    for name in names:
        a, b = factors[name]
        want = dense_solve(
            a, b, canonical_grad(dict(ref.named_modules())[name]), damping=lam
        )
        got = canonical_grad(dict(model.named_modules())[name])
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("kind", ["fisher_exact", "fisher_emp"])
def test_exact_damping_equals_dense_inverse(kind):
    model, (x, t) = mlp(), batch()
    assert_exact_damping_equals_dense(model, x, t, ("0", "2"), kind)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("interval", [1, 2])
@pytest.mark.parametrize("mode", ["pi", "tikhonov"])
def test_factored_damping_equals_its_formula(mode, interval, bias):
    # interval 1 keeps Cholesky factors and solves; interval 2 caches the inverses
    # and takes the nn.Linear path that writes .grad without the canonical layout.
    model, (x, t), lam = mlp(), batch(), 1e-2
    if not bias:
        model[0].bias = None
    ref = plain_grads(model, x, t)
    factors = kron_factors(ref, x, t, ["0", "2"], "fisher_exact")
    gm = KfacGradientMaker(
        model,
        PreconditioningConfig(
            damping=lam, curvature_interval=interval, preconditioner_interval=interval
        ),
        fisher_type="fisher_exact",
        damping_mode=mode,
    )
    step(gm, model, x, t)
    for name in ("0", "2"):
        a, b = factors[name]
        damp_a, damp_b = factor_dampings(a, b, lam, mode)
        g = canonical_grad(dict(ref.named_modules())[name])
        want = dense_solve(a, b, g, damp_a=damp_a, damp_b=damp_b)
        got = canonical_grad(dict(model.named_modules())[name])
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
        # the reference function agrees too
        ours = kfac_precondition(g, a, b, lam, mode)
        torch.testing.assert_close(ours, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("interval", [1, 2])
def test_cnn_pi_damping_equals_its_formula(interval):
    # interval 2: cached inverses, the Conv2d written straight into .grad.
    model, (x, t), lam = cnn(), batch((6, 2, 4, 4)), 1e-2
    ref = plain_grads(model, x, t)
    factors = kron_factors(ref, x, t, ["0", "3"], "fisher_emp")
    config = PreconditioningConfig(
        damping=lam, curvature_interval=interval, preconditioner_interval=interval
    )
    gm = KfacGradientMaker(model, config, fisher_type="fisher_emp")
    step(gm, model, x, t)
    for name in ("0", "3"):
        a, b = factors[name]
        damp_a, damp_b = factor_dampings(a, b, lam, "pi")
        g = canonical_grad(dict(ref.named_modules())[name])
        want = dense_solve(a, b, g, damp_a=damp_a, damp_b=damp_b)
        got = canonical_grad(dict(model.named_modules())[name])
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_cnn_exact_damping_equals_dense():
    model, (x, t) = cnn(), batch((6, 2, 4, 4))
    assert_exact_damping_equals_dense(model, x, t, ("0", "3"), "fisher_emp")


def test_mc_fisher_averages_samples_towards_exact():
    model, (x, t) = mlp(), batch()
    exact = kron_factors(plain_grads(model, x, t), x, t, ["2"], "fisher_exact")
    gm = KfacGradientMaker(model, fisher_type="fisher_mc", n_mc_samples=1500, seed=3)
    step(gm, model, x, t)
    b_exact, b_mc = exact["2"][1], gm.factors["2"]["B"][0]
    # averaged, not scaled by 1/n: the Monte-Carlo B converges to the exact one
    assert (b_mc - b_exact).norm() / b_exact.norm() < 0.1
    torch.testing.assert_close(gm.factors["2"]["A"][0], exact["2"][0])


def test_ema_with_bias_correction():
    model, decay = mlp(), 0.6
    gm = KfacGradientMaker(
        model, PreconditioningConfig(ema_decay=decay), fisher_type="fisher_emp"
    )
    seen = []
    for seed in (1, 2, 3):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(8, 4, generator=g, dtype=torch.float64)
        t = torch.randint(0, 3, (8,), generator=g)
        seen.append(kron_factors(plain_grads(model, x, t), x, t, ["0"], "fisher_emp"))
        step(gm, model, x, t)
        with torch.no_grad():  # move the parameters, as training does
            for p in model.parameters():
                p -= 0.1 * p.grad
    for k, idx in (("A", 0), ("B", 1)):
        m = 0
        for f in seen:
            m = decay * m + (1 - decay) * f["0"][idx]
        want = m / (1 - decay**3)
        torch.testing.assert_close(gm.factors["0"][k][0], want, rtol=1e-10, atol=1e-12)


def test_layernorm_unit_blocks_are_exact_and_inverted():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Linear(5, 3)).double()
    (x, t), lam = batch(), 1e-3
    ref = plain_grads(model, x, t)
    ln = ref[1]
    gw, gb = per_example_grads(ref, F.cross_entropy, x, t, [ln.weight, ln.bias])
    gm = KfacGradientMaker(
        model, PreconditioningConfig(damping=lam), fisher_type="fisher_emp"
    )
    step(gm, model, x, t)
    n = x.shape[0]
    for i in range(5):
        g = torch.stack([gw[:, i], gb[:, i]], 1)  # (N, 2): per-example [γ_i, β_i]
        u = g.T @ g / n  # mean-loss empirical Fisher block
        want = torch.linalg.solve(
            u + lam * torch.eye(2, dtype=u.dtype),
            torch.stack([ln.weight.grad[i], ln.bias.grad[i]]),
        )
        got = torch.stack([model[1].weight.grad[i], model[1].bias.grad[i]])
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-12)


def test_embedding_and_attention_are_preconditioned():
    torch.manual_seed(0)

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(7, 4)
            self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
            self.head = nn.Linear(4, 7)

        def forward(self, idx):
            h = self.embed(idx)
            return self.head(self.attn(h, h, h, need_weights=False)[0])

    model = Tiny().double()
    idx = torch.randint(0, 7, (3, 5))
    gm = KfacGradientMaker(
        model, PreconditioningConfig(damping=1e-2), fisher_type="fisher_emp"
    )
    names = {n for n, _ in gm.modules()}
    assert names == {"embed", "attn", "attn.out_proj", "head"}
    y = gm.setup_model_call(model, idx)
    gm.setup_loss_call(
        lambda z, t: F.cross_entropy(z.reshape(-1, 7), t.reshape(-1)), y, idx
    )
    ref = copy.deepcopy(model)
    F.cross_entropy(ref(idx).reshape(-1, 7), idx.reshape(-1)).backward()
    gm.forward_and_backward()
    # Embedding: A is diagonal (token counts / N), so the K-FAC solve is exact here
    a = gm.factors["embed"]["A"][0]
    counts = torch.bincount(idx.reshape(-1), minlength=7).double() / 3
    torch.testing.assert_close(a, torch.diag(counts))
    b = gm.factors["embed"]["B"][0]
    g = ref.embed.weight.grad.T  # canonical: (dim, vocab)
    want = dense_solve(a, b, g, *factor_dampings(a, b, 1e-2, "pi"))
    torch.testing.assert_close(model.embed.weight.grad.T, want, rtol=1e-8, atol=1e-12)
    assert not torch.allclose(
        model.attn.in_proj_weight.grad, ref.attn.in_proj_weight.grad
    )


def test_interval_updates_on_due_steps_and_reuses_stale_inverse():
    model = mlp()
    cfg = PreconditioningConfig(
        curvature_interval=3, preconditioner_interval=3, warmup_steps=1, damping=1e-2
    )
    gm = KfacGradientMaker(model, cfg, fisher_type="fisher_emp")
    calls = {"curvature": [], "precond": []}
    orig_c, orig_p = gm.update_curvature, gm.update_preconditioner
    gm.update_curvature = lambda: (calls["curvature"].append(gm.step), orig_c())[1]
    gm.update_preconditioner = lambda: (calls["precond"].append(gm.step), orig_p())[1]
    for s in range(8):
        x, t = batch()
        x = x + s
        inv_before = [i.clone() for i in gm.inverses.get("0", {}).get("A", [])]
        ref = plain_grads(model, x, t)
        step(gm, model, x, t)
        if s not in (0, 1, 4, 7):  # stale: same inverse, applied to the new gradient
            inv = gm.inverses["0"]
            torch.testing.assert_close(inv["A"][0], inv_before[0], rtol=0, atol=0)
            want = inv["B"][0] @ canonical_grad(ref[0]) @ inv["A"][0]
            torch.testing.assert_close(canonical_grad(model[0]), want)
    assert calls["curvature"] == [0, 1, 4, 7] and calls["precond"] == [0, 1, 4, 7]
    assert gm.curvature_updates == 4 and gm.preconditioner_updates == 4


def test_state_dict_resume_is_bit_exact():
    model = mlp()
    cfg = PreconditioningConfig(
        curvature_interval=2, preconditioner_interval=2, ema_decay=0.9, damping=1e-2
    )
    data = [batch() for _ in range(6)]
    data = [(x * (1 + i), t) for i, (x, t) in enumerate(data)]

    def train(gm, model, opt, chunk):
        for x, t in chunk:
            opt.zero_grad()
            step(gm, model, x, t)
            opt.step()

    gm = KfacGradientMaker(model, cfg, fisher_type="fisher_mc")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train(gm, model, opt, data[:3])
    buf = io.BytesIO()
    torch.save({"gm": gm.state_dict(), "model": model.state_dict()}, buf)
    train(gm, model, opt, data[3:])
    buf.seek(0)
    saved = torch.load(buf)
    model2 = mlp()
    model2.load_state_dict(saved["model"])
    gm2 = KfacGradientMaker(model2, cfg, fisher_type="fisher_mc", seed=99)
    gm2.load_state_dict(saved["gm"])
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    train(gm2, model2, opt2, data[3:])
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)


def test_ignored_module_keeps_plain_gradient():
    model, (x, t) = mlp(), batch()
    ref = plain_grads(model, x, t)
    gm = KfacGradientMaker(model, PreconditioningConfig(ignore_modules=("2",)))
    step(gm, model, x, t)
    assert [n for n, _ in gm.modules()] == ["0"]
    torch.testing.assert_close(model[2].weight.grad, ref[2].weight.grad)
    assert not torch.allclose(model[0].weight.grad, ref[0].weight.grad)


@pytest.mark.parametrize(
    ("kwargs", "err"),
    [
        ({"fisher_type": "fisher"}, ValueError),
        ({"damping_mode": "none"}, ValueError),
        ({"n_mc_samples": 0}, ValueError),
        ({"n_mc_samples": 1.5}, TypeError),
        ({"loss_type": "nll"}, ValueError),
        ({"loss_reduction": "none"}, ValueError),
        ({"logits_fn": 3}, TypeError),
    ],
)
def test_bad_arguments_raise(kwargs, err):
    with pytest.raises(err, match=str(next(iter(kwargs.values())))[:3]):
        KfacGradientMaker(mlp(), **kwargs)


def test_root_parameter_keeps_plain_gradient_and_children_are_preconditioned():
    class WithPosition(nn.Module):  # like a ViT: a parameter owned by the root
        def __init__(self):
            super().__init__()
            self.pos = nn.Parameter(torch.randn(4, dtype=torch.float64))
            self.body = mlp()

        def forward(self, x):
            return self.body(x + self.pos)

    model, (x, t) = WithPosition(), batch()
    ref = plain_grads(model, x, t)
    gm = KfacGradientMaker(model, fisher_type="fisher_emp", damping_mode="exact")
    assert [n for n, _ in gm.modules()] == ["body.0", "body.2"]
    step(gm, model, x, t)
    torch.testing.assert_close(model.pos.grad, ref.pos.grad)
    factors = kron_factors(ref, x, t, ["body.2"], "fisher_emp")
    a, b = factors["body.2"]
    want = dense_solve(a, b, canonical_grad(ref.body[2]), damping=1e-7)
    torch.testing.assert_close(
        canonical_grad(model.body[2]), want, rtol=1e-6, atol=1e-10
    )
