"""Shampoo against an eigh computation of L^{-1/4} G R^{-1/4} written in the test."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leantrain.precond import PreconditioningConfig
from leantrain.precond.methods.shampoo import (
    ShampooGradientMaker,
    inverse_root,
    inverse_roots,
)


def root(m: torch.Tensor, p: float, eps: float) -> torch.Tensor:
    vals, vecs = torch.linalg.eigh(m)
    return vecs @ torch.diag((vals.clamp(min=0) + eps) ** (-1.0 / p)) @ vecs.T


def model_and_data(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    g = torch.Generator().manual_seed(seed + 1)
    data = [
        (
            torch.randn(7, 5, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (7,), generator=g),
        )
        for _ in range(4)
    ]
    return model, data


def run(gm, model, data, opt=None):
    for x, t in data:
        model.zero_grad()
        y = gm.setup_model_call(model, x)
        gm.setup_loss_call(F.cross_entropy, y, t)
        gm.forward_and_backward()
        if opt is not None:
            opt.step()


def plain_grads(model, data):
    """Per step, the plain gradients a fresh copy computes on the same trajectory."""
    out = []
    for x, t in data:
        model.zero_grad()
        F.cross_entropy(model(x), t).backward()
        out.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return out


@pytest.mark.parametrize("ema", [None, 0.7])
def test_matches_eigh_inverse_roots(ema):
    eps = 1e-3
    model, data = model_and_data()
    ref = copy.deepcopy(model)
    gm = ShampooGradientMaker(model, PreconditioningConfig(damping=eps, ema_decay=ema))
    run(gm, model, data)  # parameters do not move: same point each step
    grads = plain_grads(ref, data)
    for name, p in model.named_parameters():
        gs = [g[name] for g in grads]
        mats = [
            g.reshape(g.shape[0], -1) if g.ndim > 1 else g.reshape(-1, 1) for g in gs
        ]
        if ema is None:
            weights = [1.0] * len(mats)
        else:
            k = len(mats)
            weights = [(1 - ema) * ema ** (k - 1 - i) / (1 - ema**k) for i in range(k)]
        left = sum(w * m @ m.T for w, m in zip(weights, mats, strict=True))
        if p.ndim > 1:
            right = sum(w * m.T @ m for w, m in zip(weights, mats, strict=True))
            want = root(left, 4, eps) @ mats[-1] @ root(right, 4, eps)
        else:  # one-sided: exponent -1/2
            want = (root(left, 2, eps) @ mats[-1]).reshape(-1)
        torch.testing.assert_close(p.grad, want.reshape(p.shape), rtol=1e-8, atol=1e-12)


def test_damping_never_accumulates_into_statistics():
    model, data = model_and_data()
    ref = copy.deepcopy(model)
    gm = ShampooGradientMaker(model, PreconditioningConfig(damping=0.5))
    run(gm, model, data)
    grads = plain_grads(ref, data)
    g = [x["0.weight"] for x in grads]
    torch.testing.assert_close(gm.statistics["0.weight"][0][0], sum(m @ m.T for m in g))
    torch.testing.assert_close(gm.statistics["0.weight"][0][1], sum(m.T @ m for m in g))


def test_block_size_and_conv_weights():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 5, 2), nn.Flatten(), nn.Linear(45, 3)).double()
    x = torch.randn(4, 2, 4, 4, dtype=torch.float64)
    t = torch.randint(0, 3, (4,))
    ref = copy.deepcopy(model)
    F.cross_entropy(ref(x), t).backward()
    gm = ShampooGradientMaker(model, PreconditioningConfig(damping=1e-3), block_size=3)
    run(gm, model, [(x, t)])
    # conv weight (5, 2, 2, 2) -> (5, 8) -> row blocks {0:3, 3:5}, col blocks {0:3, ...}
    g = ref[0].weight.grad.reshape(5, 8)
    want = torch.empty_like(g)
    for rs in (slice(0, 3), slice(3, 5)):
        for cs in (slice(0, 3), slice(3, 6), slice(6, 8)):
            b = g[rs, cs]
            want[rs, cs] = root(b @ b.T, 4, 1e-3) @ b @ root(b.T @ b, 4, 1e-3)
    torch.testing.assert_close(model[0].weight.grad.reshape(5, 8), want)
    assert len(gm.statistics["0.weight"]) == 6
    assert all(
        s.shape[0] <= 3 for blocks in gm.statistics.values() for b in blocks for s in b
    )


def test_ignore_modules_respected():
    model, data = model_and_data()
    ref = copy.deepcopy(model)
    gm = ShampooGradientMaker(model, PreconditioningConfig(ignore_modules=("2",)))
    run(gm, model, data[:1])
    F.cross_entropy(ref(data[0][0]), data[0][1]).backward()
    assert set(gm.statistics) == {"0.weight", "0.bias"}
    torch.testing.assert_close(model[2].weight.grad, ref[2].weight.grad)
    torch.testing.assert_close(model[2].bias.grad, ref[2].bias.grad)


def test_interval_reuses_stale_roots():
    model, data = model_and_data()
    cfg = PreconditioningConfig(curvature_interval=2, preconditioner_interval=2)
    gm = ShampooGradientMaker(model, cfg)
    run(gm, model, data[:1])
    roots = [r.clone() for r in gm.roots["0.weight"][0]]
    run(gm, model, data[1:2])
    assert gm.curvature_updates == 1 and gm.preconditioner_updates == 1
    assert all(
        torch.equal(a, b) for a, b in zip(roots, gm.roots["0.weight"][0], strict=True)
    )
    run(gm, model, data[2:3])
    assert gm.curvature_updates == 2 and gm.preconditioner_updates == 2


def test_state_dict_resume_is_bit_exact():
    model, data = model_and_data()
    cfg = PreconditioningConfig(damping=1e-3, ema_decay=0.9)
    gm = ShampooGradientMaker(model, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run(gm, model, data[:2], opt)
    buf = io.BytesIO()
    torch.save({"gm": gm.state_dict(), "model": model.state_dict()}, buf)
    run(gm, model, data[2:], opt)
    buf.seek(0)
    saved = torch.load(buf)
    model2, _ = model_and_data()
    model2.load_state_dict(saved["model"])
    gm2 = ShampooGradientMaker(model2, cfg)
    gm2.load_state_dict(saved["gm"])
    run(gm2, model2, data[2:], torch.optim.SGD(model2.parameters(), lr=0.1))
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)


def test_bad_block_size_raises():
    with pytest.raises(ValueError, match="block_size"):
        ShampooGradientMaker(nn.Linear(2, 2), block_size=0)
    with pytest.raises(TypeError, match="block_size"):
        ShampooGradientMaker(nn.Linear(2, 2), block_size=2.5)


def test_wide_layer_between_curvature_steps_matches_stale_roots():
    # batch 3 < width 12: between curvature steps layer "2" skips its weight
    # gradient and forms L^{-1/4} (E^T X) R^{-1/4} from its output-gradients.
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3)
    ).double()
    cfg = PreconditioningConfig(
        damping=1e-3, curvature_interval=2, preconditioner_interval=2, ema_decay=0.9
    )
    gm = ShampooGradientMaker(model, cfg)
    g = torch.Generator().manual_seed(3)
    data = [
        (
            torch.randn(3, 5, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (3,), generator=g),
        )
        for _ in range(2)
    ]
    run(gm, model, data[:1])  # curvature step: plain backward
    assert gm._capture.records == {}
    ref = plain_grads(copy.deepcopy(model), data[1:])[0]
    run(gm, model, data[1:])
    assert gm._capture.records["2"] is not None  # the factored path ran
    for name, p in model.named_parameters():
        roots = gm.roots[name][0]
        want = roots[0] @ ref[name].reshape(p.shape[0], -1)
        if len(roots) == 2:
            want = want @ roots[1]
        torch.testing.assert_close(p.grad, want.reshape(p.shape), rtol=1e-9, atol=0)


def test_batched_inverse_roots_equal_one_at_a_time():
    # Statistics of mixed shapes and exponents, in an order that interleaves the
    # groups: each root equals inverse_root of its own matrix, in its own place.
    gen = torch.Generator().manual_seed(3)

    def psd(n):
        m = torch.randn(n, n + 2, generator=gen, dtype=torch.float64)
        return m @ m.T

    stats = [psd(4), psd(3), psd(4), psd(4), psd(3)]
    exponents = [4.0, 4.0, 2.0, 4.0, 2.0]
    got = inverse_roots(stats, exponents, 1e-3)
    for s, e, r in zip(stats, exponents, got, strict=True):
        torch.testing.assert_close(r, inverse_root(s, e, 1e-3), rtol=1e-10, atol=1e-12)
