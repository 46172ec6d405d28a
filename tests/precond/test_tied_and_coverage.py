"""Tied weights refused where no rule covers them, RMSNorm checked, coverage report.

Plain torch models (no ``transformers``); the Hugging Face parity tests are in
``tests/integrations/test_hf_precond.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leantrain.precond import (
    KbfgsGradientMaker,
    KfacGradientMaker,
    PreconditioningConfig,
    PsgdGradientMaker,
    curvature,
)
from leantrain.precond.curv import dense_empirical_fisher


class TiedLM(nn.Module):
    """Embedding (V, d) tied to a bias-free head; a broadcast position embedding."""

    def __init__(self, vocab=7, dim=3, seq=4, bias=False):
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(seq, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=bias)
        self.head.weight = self.wte.weight

    def forward(self, ids):
        pos = torch.arange(ids.shape[1]).unsqueeze(0)  # (1, T), broadcast
        h = self.wte(ids) + self.wpe(pos)
        return self.head(torch.tanh(self.mix(h)))


@pytest.mark.parametrize("bias", [False, True])
def test_tied_and_broadcast_full_curvature_matches_dense(bias):
    model = TiedLM(bias=bias).double()
    g = torch.Generator().manual_seed(0)
    ids, t = (
        torch.randint(0, 7, (5, 4), generator=g),
        torch.randint(0, 7, (5, 4), generator=g),
    )
    got = curvature(model, "cross_entropy", ids, t, kind="fisher_emp", shape="full")
    want = dense_empirical_fisher(model, "cross_entropy", ids, t)
    torch.testing.assert_close(got.to_dense(), want, rtol=1e-9, atol=1e-13)


@pytest.mark.parametrize("bias", [False, True])
def test_tied_kron_is_the_kronecker_of_sums(bias):
    """With a head bias (BERT's decoder) it is a last column: the head's input
    factor has its trailing 1, the embedding's is zero-padded there."""
    model = TiedLM(bias=bias).double()
    g = torch.Generator().manual_seed(0)
    ids, t = (
        torch.randint(0, 7, (5, 4), generator=g),
        torch.randint(0, 7, (5, 4), generator=g),
    )
    rec = {}

    def keep(name):
        def hook(m, args, out):
            rec[name] = [args[0]]
            out.register_hook(lambda gr: rec[name].append(gr))

        return hook

    for name in ("wte", "head"):
        getattr(model, name).register_forward_hook(keep(name))
    out = model(ids)
    loss = F.cross_entropy(out.flatten(0, 1), t.flatten(), reduction="sum")
    loss.backward()
    n = ids.shape[0]
    e_emb = rec["wte"][1].reshape(-1, 3)
    e_head = rec["head"][1].reshape(-1, 7)
    a_head = rec["head"][0].reshape(-1, 3).detach()
    if bias:
        a_head = torch.cat([a_head, torch.ones(a_head.shape[0], 1)], 1)
    counts = torch.bincount(ids.reshape(-1), minlength=7).double()
    rows = torch.diag(counts) / n + e_head.T @ e_head
    cols = a_head.T @ a_head / n
    cols[:3, :3] += e_emb.T @ e_emb
    spec = nn.CrossEntropyLoss(reduction="sum")
    got = curvature(model, spec, ids, t, kind="fisher_emp", shape="kron")
    part = got["wte"]
    torch.testing.assert_close(part.kron[0].B, rows, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(part.kron[0].A, cols, rtol=1e-10, atol=1e-13)
    # One site in the parameter's own (V, d) layout, the bias last.
    index = torch.arange(21).reshape(7, 3)
    if bias:
        index = torch.cat([index, 21 + torch.arange(7).unsqueeze(1)], 1)
    assert torch.equal(part.kron[0].index, index)


def test_a_tie_with_biases_is_refused_naming_the_modules():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3))
    model[2].weight = model[0].weight
    with pytest.raises(ValueError, match=r"'0', '2' share a parameter"):
        KfacGradientMaker(model)


def test_psgd_refuses_two_tied_linear_layers():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(3, 3, bias=False), nn.Tanh(), nn.Linear(3, 3, bias=False)
    )
    model[2].weight = model[0].weight
    with pytest.raises(
        ValueError, match=r"'0.weight' is used by the modules \['0', '2'\]"
    ):
        PsgdGradientMaker(model)


class FakeRMSNorm(nn.Module):
    """Named like RMSNorm but computes (1 + w) x / rms(x) (the Gemma form)."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.full((d,), 0.5))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        xhat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (1 + self.weight) * xhat


def test_an_rmsnorm_of_another_form_raises():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), FakeRMSNorm(4), nn.Linear(4, 2))
    gm = KfacGradientMaker(model)
    y = gm.setup_model_call(model, torch.randn(6, 3))
    gm.setup_loss_call(F.cross_entropy, y, torch.randint(0, 2, (6,)))
    with pytest.raises(
        ValueError, match=r"module '1' \(FakeRMSNorm\).*weight \* x / rms"
    ):
        gm.forward_and_backward()


def test_rmsnorm_diag_matches_dense():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.RMSNorm(4), nn.Linear(4, 2)).double()
    x, t = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 2, (6,))
    got = curvature(model, "cross_entropy", x, t, kind="fisher_emp", shape="full")
    want = dense_empirical_fisher(model, "cross_entropy", x, t)
    torch.testing.assert_close(got.to_dense(), want, rtol=1e-9, atol=1e-13)


def test_coverage_warns_once_and_ignore_modules_accepts():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gm = KbfgsGradientMaker(model)
    messages = [
        str(w.message) for w in caught if "does not precondition" in str(w.message)
    ]
    assert len(messages) == 1 and "1 (LayerNorm, 8 parameters)" in messages[0]
    report = gm.coverage()
    assert report.covered == {"0": 16, "2": 10} and report.not_covered == {"1": 8}
    assert report.fraction == pytest.approx(26 / 34)
    config = PreconditioningConfig(ignore_modules=(nn.LayerNorm,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gm = KbfgsGradientMaker(model, config)
    assert gm.coverage().ignored == {"1": 8} and not gm.coverage().not_covered


def test_a_tied_convolution_is_refused():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.Conv2d(2, 2, 3, padding=1))
    model[1].weight = model[0].weight
    with pytest.raises(ValueError, match=r"'0', '1' share a parameter"):
        KfacGradientMaker(model)
