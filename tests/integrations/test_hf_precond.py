"""Preconditioning on tiny Hugging Face GPT-2 and Llama, against dense definitions.

The references are computed here, independently of the curvature layer: per-site
inputs ``a`` and output-gradients ``e`` come from plain torch hooks on the modules,
per-example gradients from a loop over the examples, Shampoo's statistics from the
gradient. GPT-2 has HF ``Conv1D`` layers, a position embedding called with ids of
shape ``(1, T)`` and ``wte`` tied to ``lm_head``; Llama ties ``embed_tokens`` to
``lm_head``. Float64, one batch of 3 sequences of 12 tokens.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leantrain.precond import (
    DiagonalEmpiricalFisherGradientMaker,
    EkfacGradientMaker,
    HessianFreeGradientMaker,
    KbfgsGradientMaker,
    KfacGradientMaker,
    NaturalGradientMaker,
    NewtonGradientMaker,
    PreconditioningConfig,
    PsgdGradientMaker,
    SengGradientMaker,
    ShampooGradientMaker,
    SmwNgGradientMaker,
)
from leantrain.precond.curv import curvature, dense_empirical_fisher
from tests._helpers.hf_models import (
    VOCAB,
    image_batch,
    tiny_bert,
    tiny_gpt2,
    tiny_llama,
    tiny_vit,
    token_batch,
)

B, LAM = 3, 1e-2
MODELS = {"gpt2": tiny_gpt2, "llama": tiny_llama, "bert": tiny_bert}
TIED = {
    "gpt2": ("transformer.wte", "lm_head"),
    "llama": ("model.embed_tokens", "lm_head"),
    # The decoder also has a bias, which BertLMPredictionHead registers too.
    "bert": ("bert.embeddings.word_embeddings", "cls.predictions.decoder"),
}


def lm_loss(out, targets_flat):
    """The language-model loss as users write it: logits and targets flattened."""
    return F.cross_entropy(out.logits.flatten(0, 1), targets_flat)


def make(name):
    model = MODELS[name](dtype=torch.float64, layers=1)
    ids = token_batch(B)
    targets = token_batch(B, seed=1)
    return model, ids, targets


def run(gm, model, ids, targets):
    model.zero_grad()
    y = gm.setup_model_call(model, input_ids=ids)
    gm.setup_loss_call(lm_loss, y, targets.flatten())
    return gm.forward_and_backward()


def is_conv1d(m):
    return type(m).__name__ == "Conv1D"


def linear_sites(model):
    """Modules the references cover: Linear, Conv1D, Embedding (name -> module)."""
    return {
        n: m
        for n, m in model.named_modules()
        if isinstance(m, (nn.Linear, nn.Embedding)) or is_conv1d(m)
    }


def capture(model, ids, targets):
    """Inputs and output-gradients of every linear-form module for the empirical
    Fisher vector ``dL/dz / sqrt(r)``, plus the plain gradient; torch hooks only."""
    sites = linear_sites(model)
    rec = {}
    handles = []

    def hook(name):
        def fwd(mod, args, out):
            rec[name] = {"a": args[0].detach()}
            out.register_hook(lambda g: rec[name].__setitem__("e", g.detach()))

        return fwd

    for n, m in sites.items():
        handles.append(m.register_forward_hook(hook(n)))
    logits = model(input_ids=ids).logits
    for h in handles:
        h.remove()
    loss = lm_loss(type("O", (), {"logits": logits})(), targets.flatten())
    (dz,) = torch.autograd.grad(loss, logits, retain_graph=True)
    r = 1.0 / targets.numel()
    torch.autograd.grad(logits, [p for p in model.parameters()], dz / math.sqrt(r))
    return rec


def site_factors(module, a, e):
    """Untied K-FAC factors of one site in the parameter's row x column layout:
    ``(rows, cols)`` for the weight, with ``A = sum a a^T / N``, ``B = sum e e^T``."""
    n = e.shape[0]
    e2 = e.reshape(-1, e.shape[-1])
    if isinstance(module, nn.Embedding):  # weight (V, d): rows tokens, cols dims
        ids = a.expand(n, *a.shape[1:]).reshape(-1)  # broadcast (1, T) ids
        counts = torch.bincount(ids, minlength=module.num_embeddings).double()
        return torch.diag(counts) / n, e2.T @ e2
    x = a.reshape(-1, a.shape[-1])
    if getattr(module, "bias", None) is not None:
        x = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], 1)
    return e2.T @ e2, x.T @ x / n  # output rows x input (+bias) columns


def canonical_grad(module):
    """The gradient as the ``(out, in [+1])`` matrix of ``y = W a + b``."""
    w = module.weight.grad
    w = w.T if is_conv1d(module) else w
    if getattr(module, "bias", None) is not None:
        w = torch.cat([w, module.bias.grad.unsqueeze(1)], 1)
    return w


def reference_factors(model, ids, targets):
    """Per module (tied pair under the first name): ``(rows, cols)`` of the weight."""
    rec = capture(model, ids, targets)
    sites = linear_sites(model)
    out, owner = {}, {}
    for name, m in sites.items():
        e = rec[name]["e"]
        if isinstance(m, nn.Embedding) and e.shape[0] == 1:
            # A broadcast position embedding: its per-example output-gradient is
            # that of the hidden state it is added to (= the token embedding's).
            e = next(
                rec[k]["e"] for k, v in sites.items() if v.weight.shape[0] == VOCAB
            )
        rows, cols = site_factors(m, rec[name]["a"], e)
        key = owner.setdefault(id(m.weight), name)
        if key in out:  # tied: Kronecker of sums
            out[key] = (out[key][0] + rows, out[key][1] + cols)
        else:
            out[key] = (rows, cols)
    return out


def _kfac(model, **kw):
    cfg = PreconditioningConfig(damping=LAM, ema_decay=None)
    return KfacGradientMaker(
        model, cfg, fisher_type="fisher_emp", damping_mode="tikhonov", **kw
    )


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_kfac_matches_dense_factors_and_preconditioned_gradient(name):
    model, ids, targets = make(name)
    ref = reference_factors(model, ids, targets)
    model.zero_grad()
    plain = {}
    lm_loss(model(input_ids=ids), targets.flatten()).backward()
    sites = linear_sites(model)
    for n in ref:
        plain[n] = canonical_grad(sites[n]).clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every module is covered: no warning
        gm = _kfac(model, low_rank=False)
    assert not gm.coverage().not_covered
    run(gm, model, ids, targets)
    first, head = TIED[name]
    assert set(ref) <= set(gm.factors) and head not in gm.factors
    root = LAM**0.5
    for n, (rows, cols) in ref.items():
        f = gm.factors[n]
        emb = isinstance(sites[n], nn.Embedding) and n != first
        # K-FAC's canonical layout of an (untied) embedding is W^T: B = cols.
        got_rows, got_cols = (f["A"][0], f["B"][0]) if emb else (f["B"][0], f["A"][0])
        torch.testing.assert_close(got_rows, rows, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(got_cols, cols, rtol=1e-9, atol=1e-12)
        eye_r, eye_c = torch.eye(rows.shape[0]), torch.eye(cols.shape[0])
        want = torch.linalg.solve(rows + root * eye_r, plain[n])
        want = torch.linalg.solve(cols + root * eye_c, want.T).T
        scale = float(want.abs().max())  # damped inverses: conditioning ~1e6
        torch.testing.assert_close(
            canonical_grad(sites[n]), want, rtol=1e-6, atol=1e-8 * scale
        )
    # LayerNorm / RMSNorm: the exact unit blocks of [γ_i, β_i] (or [γ_i]), from
    # per-example gradients of each sequence.
    per_example = per_example_grads(model, ids, targets, scale=True)
    norms = {
        n: m for n, m in model.named_modules() if type(m).__name__.endswith("Norm")
    }
    assert norms
    for n, m in norms.items():
        own = [p for p in m.parameters(recurse=False)]
        u = torch.stack(
            [torch.stack([g[id(p)] for p in own], -1) for g in per_example]
        )  # (N, R, U)
        want = torch.einsum("nru,nrv->ruv", u, u)
        torch.testing.assert_close(gm.factors[n]["unit"], want, rtol=1e-9, atol=1e-14)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_ekfac_scaling_matches_per_example_gradients(name):
    model, ids, targets = make(name)
    ref = reference_factors(model, ids, targets)
    gm = EkfacGradientMaker(
        model,
        PreconditioningConfig(damping=LAM, ema_decay=None),
        fisher_type="fisher_emp",
    )
    run(gm, model, ids, targets)
    per_example = per_example_grads(model, ids, targets, scale=True)
    sites = linear_sites(model)
    first, _ = TIED[name]
    for n, (rows, cols) in ref.items():
        (qa, qb), s = gm.bases[n][0], gm.scaling[n][0]
        emb = isinstance(sites[n], nn.Embedding) and n != first
        # The bases diagonalise the dense factors.
        a, b = (rows, cols) if emb else (cols, rows)
        for q, m in ((qa, a), (qb, b)):
            d = q.T @ m @ q
            torch.testing.assert_close(d, torch.diag(d.diagonal()), atol=1e-9, rtol=0)
        g = torch.stack([canon(sites[n], gs) for gs in per_example])
        if emb:
            g = g.mT
        want = (qb.T @ g @ qa).square().sum(0)
        torch.testing.assert_close(s, want, rtol=1e-8, atol=1e-12)


def canon(module, grads):
    w = grads[id(module.weight)]
    w = w.T if is_conv1d(module) else w
    if getattr(module, "bias", None) is not None:
        w = torch.cat([w, grads[id(module.bias)].unsqueeze(1)], 1)
    return w


def per_example_grads(model, ids, targets, *, scale):
    """Gradients of each sequence's own mean loss, one backward per example
    (``scale``: times ``sqrt(r)``, the empirical Fisher's per-example vectors for
    the batch-mean loss, ``r = 1/(B T)``)."""
    out = []
    params = list(model.parameters())
    for i in range(B):
        logits = model(input_ids=ids[i : i + 1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), targets[i])
        grads = torch.autograd.grad(loss, params)
        k = math.sqrt(1.0 / (B * targets.shape[1])) * targets.shape[1] if scale else 1
        out.append({id(p): g * k for p, g in zip(params, grads, strict=True)})
    return out


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_diagonal_fisher_on_the_flattened_lm_loss(name):
    model, ids, targets = make(name)
    gm = DiagonalEmpiricalFisherGradientMaker(model, PreconditioningConfig(damping=LAM))
    _, loss = run(gm, model, ids, targets)
    per_example = per_example_grads(model, ids, targets, scale=False)
    named = dict(model.named_parameters())
    assert set(gm.curvature) == set(named)  # a tied weight once
    for pname, p in named.items():
        want = torch.stack([g[id(p)] for g in per_example]).square().mean(0)
        torch.testing.assert_close(gm.curvature[pname], want, rtol=1e-8, atol=1e-14)
    model.zero_grad()
    plain = lm_loss(model(input_ids=ids), targets.flatten())
    torch.testing.assert_close(loss, plain.detach())


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_shampoo_statistics_are_the_gradient_products(name):
    model, ids, targets = make(name)
    every_2 = dict(curvature_interval=2, preconditioner_interval=2)
    config = PreconditioningConfig(damping=LAM, ema_decay=None, **every_2)
    gm = ShampooGradientMaker(model, config)
    model.zero_grad()
    lm_loss(model(input_ids=ids), targets.flatten()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    run(gm, model, ids, targets)
    assert set(gm.statistics) == set(grads)  # the tied weight once, not twice
    for n, g in grads.items():
        stats = gm.statistics[n][0]
        m = g.reshape(-1, 1) if g.ndim == 1 else g.reshape(g.shape[0], -1)
        torch.testing.assert_close(stats[0], m @ m.T, rtol=1e-10, atol=1e-14)
        if g.ndim > 1:
            torch.testing.assert_close(stats[1], m.T @ m, rtol=1e-10, atol=1e-14)
    # A step between curvature updates (the head would skip its weight gradient
    # there, were it not tied): L^{-1/4} G R^{-1/4} with the full gradient.
    run(gm, model, ids, targets)
    for n, p in model.named_parameters():
        if p.ndim == 2:
            left, right = gm.roots[n][0]
            want = left @ grads[n] @ right
            torch.testing.assert_close(p.grad, want, rtol=1e-8, atol=1e-12)


def test_curvature_full_matches_dense_empirical_fisher_with_conv1d_and_tied():
    """``curvature()`` on GPT-2 (Conv1D, broadcast positions, tied head) against
    the dense per-example definition."""
    model, ids, targets = make("gpt2")

    class Logits(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x):
            return self.m(input_ids=x).logits

    wrapped = Logits(model)
    got = curvature(
        wrapped, "cross_entropy", ids, targets, kind="fisher_emp", shape="diag"
    )
    want = dense_empirical_fisher(wrapped, "cross_entropy", ids, targets)
    torch.testing.assert_close(
        got.to_dense().diagonal(), want.diagonal(), rtol=1e-8, atol=1e-14
    )


MAKERS = {
    "kfac": lambda m, c: KfacGradientMaker(m, c),
    "ekfac": lambda m, c: EkfacGradientMaker(m, c),
    "kbfgs": lambda m, c: KbfgsGradientMaker(m, c),
    "seng": lambda m, c: SengGradientMaker(m, c),
    "smw_ng": lambda m, c: SmwNgGradientMaker(m, c),
    "natural_gradient": lambda m, c: NaturalGradientMaker(m, c, shape="layer"),
    "psgd": lambda m, c: PsgdGradientMaker(m, c),
    "hessian_free": lambda m, c: HessianFreeGradientMaker(m, c),
}


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
@pytest.mark.parametrize("method", sorted(MAKERS))
def test_every_method_runs_and_reports_what_it_leaves_plain(name, method):
    model, ids, targets = make(name)
    cfg = PreconditioningConfig(damping=LAM, ema_decay=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gm = MAKERS[method](model, cfg)
    report = gm.coverage()
    uncovered = [w for w in caught if "does not precondition" in str(w.message)]
    assert len(uncovered) == (1 if report.not_covered else 0)
    plain_types = {report.types[n] for n in report.not_covered}
    if method in ("kbfgs", "psgd"):  # linear layers only: norms and embeddings plain
        assert plain_types and plain_types <= {
            "LayerNorm",
            "Embedding",
            "LlamaRMSNorm",
            "GPT2Attention",
        }
        message = str(uncovered[0].message)
        for n, count in report.not_covered.items():
            assert f"{n} ({report.types[n]}, {count} parameters)" in message
    else:
        assert not report.not_covered, report.not_covered
    tied = [w for w in caught if "tied weights" in str(w.message)]
    # K-BFGS has no rule for a weight with two sites and says so; the others do.
    assert len(tied) == (1 if method == "kbfgs" else 0)
    if tied:
        assert repr(list(TIED[name])) in str(tied[0].message)
    # Every trainable parameter counted once, in exactly one bucket.
    total = sum(p.numel() for p in model.parameters())
    counted = sum(sum(d.values()) for d in (report.covered, report.not_covered))
    assert counted + sum(report.ignored.values()) == total
    for _ in range(2):
        run(gm, model, ids, targets)
        grads = [p.grad for p in model.parameters()]
        assert all(g is not None and bool(g.isfinite().all()) for g in grads)


class _Net(nn.Module):
    """Two linear layers and a tanh, as nn.Linear or as HF Conv1D (same maps)."""

    def __init__(self, conv1d: bool):
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        torch.manual_seed(0)
        lin = [nn.Linear(4, 6), nn.Linear(6, 3)]
        if conv1d:
            layers = []
            for m in lin:
                c = Conv1D(m.out_features, m.in_features)
                with torch.no_grad():
                    c.weight.copy_(m.weight.T)
                    c.bias.copy_(m.bias)
                layers.append(c)
            lin = layers
        self.l1, self.l2 = lin
        self.double()

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


ALL_MAKERS = {
    **MAKERS,
    "natural_gradient_full": lambda m, c: NaturalGradientMaker(m, c),
    "shampoo": lambda m, c: ShampooGradientMaker(m, c),
    "diagonal_fisher": lambda m, c: DiagonalEmpiricalFisherGradientMaker(m, c),
    "newton": lambda m, c: NewtonGradientMaker(m, c),
}


@pytest.mark.parametrize("positions", [None, 5])
@pytest.mark.parametrize("method", sorted(ALL_MAKERS))
def test_conv1d_is_preconditioned_as_the_transposed_linear(method, positions):
    """Every method gives a Conv1D network the gradients of the same network built
    from nn.Linear, transposed: one example per row, or sequences of 5."""
    g = torch.Generator().manual_seed(0)
    shape = (6, 4) if positions is None else (6, positions, 4)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    t = torch.randint(0, 3, shape[:-1], generator=g)
    grads = []
    for conv1d in (False, True):
        model = _Net(conv1d)
        cfg = PreconditioningConfig(damping=LAM, ema_decay=None)
        gm = ALL_MAKERS[method](model, cfg)
        for _ in range(2):  # K-BFGS updates its curvature from the second step
            model.zero_grad()
            y = gm.setup_model_call(model, x)
            gm.setup_loss_call(F.cross_entropy, y.flatten(0, -2), t.flatten())
            gm.forward_and_backward()
        grads.append(
            [p.grad.T if conv1d and p.ndim == 2 else p.grad for p in model.parameters()]
        )
    # Conjugate gradients amplify the rounding of the two layouts (2e-7 seen); a
    # layout error would be of order one.
    rtol = 1e-5 if method == "hessian_free" else 1e-7
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(b, a, rtol=rtol, atol=1e-10)


@pytest.mark.parametrize("method", ["kfac", "natural_gradient", "seng"])
def test_vit_patch_convolution_inside_an_unsupported_container_is_tracked(method):
    """ViTEmbeddings owns the class token (no rule: reported) and holds the patch
    Conv2d (preconditioned): leaving the container alone must not drop its child."""
    model = tiny_vit(dtype=torch.float64, layers=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gm = MAKERS[method](model, PreconditioningConfig(damping=LAM, ema_decay=None))
    report = gm.coverage()
    assert report.not_covered == {"vit.embeddings": 16 + 5 * 16}  # cls, positions
    assert sum("vit.embeddings (ViTEmbeddings" in str(w.message) for w in caught) == 1
    conv = "vit.embeddings.patch_embeddings.projection"
    assert conv in report.covered and conv in gm.ops
    x, t = image_batch(4, dtype=torch.float64)
    model.zero_grad()
    y = gm.setup_model_call(model, pixel_values=x)
    gm.setup_loss_call(F.cross_entropy, y.logits, t)
    gm.forward_and_backward()
    ref = tiny_vit(dtype=torch.float64, layers=1)
    F.cross_entropy(ref(pixel_values=x).logits, t).backward()
    got = model.vit.embeddings.patch_embeddings.projection.weight.grad
    plain = ref.vit.embeddings.patch_embeddings.projection.weight.grad
    assert not torch.allclose(got, plain)  # preconditioned, not the plain gradient
    torch.testing.assert_close(  # the class token keeps its plain gradient
        model.vit.embeddings.cls_token.grad, ref.vit.embeddings.cls_token.grad
    )


def test_diagonal_fisher_with_the_models_own_loss():
    """``labels=`` and ``setup_loss_repr(y.loss)``: per-example losses of the model's
    own shifted LM loss; the output keeps its ModelOutput type."""
    model, ids, _ = make("gpt2")
    gm = DiagonalEmpiricalFisherGradientMaker(model, PreconditioningConfig(damping=LAM))
    y = gm.setup_model_call(model, input_ids=ids, labels=ids)
    gm.setup_loss_repr(y.loss)
    output, loss = gm.forward_and_backward()
    assert type(output).__name__ == "CausalLMOutputWithCrossAttentions"
    assert output.logits.shape == (B, ids.shape[1], VOCAB) and output.loss.shape == (B,)
    params = dict(model.named_parameters())
    per_example = []
    for i in range(B):
        own = model(input_ids=ids[i : i + 1], labels=ids[i : i + 1]).loss
        per_example.append(torch.autograd.grad(own, list(params.values())))
    for k, (pname, _) in enumerate(params.items()):
        want = torch.stack([g[k] for g in per_example]).square().mean(0)
        torch.testing.assert_close(gm.curvature[pname], want, rtol=1e-8, atol=1e-14)
    torch.testing.assert_close(loss, model(input_ids=ids, labels=ids).loss.detach())
