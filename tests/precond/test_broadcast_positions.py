"""nanoGPT's position embedding: ``wpe(torch.arange(T))``, ids without a batch
dimension broadcast over the batch, against the dense definitions (float64).

The rule (``leantrain/precond/curv/_broadcast.py``): the shared lookup is recorded
as one lookup per example, so per-example gradients, K-FAC's ``A`` (position
counts of one example) and ``B`` (per-example output-gradients) are those of the
definition. Checked through ``curvature()``, the gradient makers and the in-loop
form, for every method that records module inputs (K-FAC, EKFAC, the hook-based
natural gradient, SMW-NG, SENG); Shampoo, SOAP and PSGD read ``.grad`` only.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leantrain.precond import (
    KfacGradientMaker,
    NaturalGradientMaker,
    PreconditioningConfig,
    curvature,
    make_gradient_maker,
    precondition_in_loop,
)
from leantrain.precond.curv import dense_empirical_fisher, dense_ggn
from tests._helpers.kfac_models import factor_dampings
from tests._helpers.kron_reference import dense_solve

VOCAB, DIM = 11, 4


class NanoLM(nn.Module):
    """nanoGPT's embedding: ``wte(idx) + wpe(torch.arange(T))`` (or ``(1, T)``)."""

    def __init__(self, seq: int, batched_positions: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(VOCAB, DIM)
        self.wpe = nn.Embedding(seq, DIM)
        self.mix = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.batched_positions = batched_positions

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)  # (T,), as nanoGPT
        if self.batched_positions:
            pos = pos.unsqueeze(0)  # (1, T), as Hugging Face
        return self.head(torch.tanh(self.mix(self.wte(idx) + self.wpe(pos))))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def data(n: int, seq: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, VOCAB, (n, seq), generator=g),
        torch.randint(0, VOCAB, (n, seq), generator=g),
    )


# (batch, sequence): T != N, and T == N, where the ids 0..T-1 tell positions from a
# batch of single ids.
SIZES = [(3, 5), (4, 4)]


@pytest.mark.parametrize(("n", "seq"), SIZES)
@pytest.mark.parametrize("kind", ["fisher_emp", "ggn"])
def test_full_curvature_matches_dense(n, seq, kind):
    model = NanoLM(seq).double()
    ids, t = data(n, seq)
    got = curvature(model, "cross_entropy", ids, t, kind=kind, shape="full")
    dense = dense_empirical_fisher if kind == "fisher_emp" else dense_ggn
    want = dense(model, "cross_entropy", ids, t)
    torch.testing.assert_close(got.to_dense(), want, rtol=1e-9, atol=1e-13)


def wpe_factors(model: NanoLM, ids: torch.Tensor, t: torch.Tensor):
    """K-FAC's empirical-Fisher factors of ``wpe`` from their definition, one
    example at a time: ``A = sum_{n,t} a a^T / N`` (one-hot positions) and
    ``B = r sum_{n,t} e e^T`` with ``e`` example ``n``'s gradient of its summed loss
    at the position embedding's output, ``r = 1 / (N T)`` the mean's factor."""
    n, seq = ids.shape
    a = torch.zeros(seq, seq, dtype=torch.float64)
    b = torch.zeros(DIM, DIM, dtype=torch.float64)
    out = {}
    model.wpe.register_forward_hook(lambda m, args, o: out.__setitem__("o", o))
    for i in range(n):
        logits = model(ids[i : i + 1])
        loss = F.cross_entropy(
            logits.reshape(-1, VOCAB), t[i].reshape(-1), reduction="sum"
        )
        (e,) = torch.autograd.grad(loss, out["o"])  # (T, d): this example only
        b += e.T @ e / (n * seq)
        a += torch.eye(seq, dtype=torch.float64) / n
    return a, b


def kfac_step_in_loop(model, ids, t, config, **kwargs):
    opt = precondition_in_loop(
        torch.optim.SGD(model.parameters(), lr=0.0),
        model,
        "kfac",
        config=config,
        **kwargs,
    )
    lm_loss(model(ids), t).backward()
    opt.step()
    opt.close()
    return opt.maker


def kfac_step_maker(model, ids, t, config, **kwargs):
    gm = KfacGradientMaker(model, PreconditioningConfig(**config), **kwargs)
    y = gm.setup_model_call(model, ids)
    gm.setup_loss_call(lm_loss, y, t)
    gm.forward_and_backward()
    return gm


@pytest.mark.parametrize(("n", "seq"), SIZES)
@pytest.mark.parametrize("run", [kfac_step_maker, kfac_step_in_loop])
def test_kfac_factors_and_step_match_the_definition(n, seq, run):
    model = NanoLM(seq).double()
    ids, t = data(n, seq)
    ref = copy.deepcopy(model)
    lm_loss(ref(ids), t).backward()
    a, b = wpe_factors(copy.deepcopy(model), ids, t)
    lam = 1e-2
    maker = run(model, ids, t, {"damping": lam}, fisher_type="fisher_emp")
    factors = maker.factors["wpe"]
    torch.testing.assert_close(factors["A"][0], a, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(factors["B"][0], b, rtol=1e-10, atol=1e-13)
    g = ref.wpe.weight.grad.T  # canonical: (dim, positions)
    want = dense_solve(a, b, g, *factor_dampings(a, b, lam, "pi"))
    torch.testing.assert_close(model.wpe.weight.grad.T, want, rtol=1e-8, atol=1e-12)


def test_natural_gradient_full_matches_the_dense_solve():
    """Per-example gradients: the hook-based full natural gradient with the
    empirical Fisher is ``(F + λ I)^{-1} g`` of the dense empirical Fisher."""
    model = NanoLM(5).double()
    ids, t = data(3, 5)
    ref = copy.deepcopy(model)
    lm_loss(ref(ids), t).backward()
    g = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
    fisher = dense_empirical_fisher(model, "cross_entropy", ids, t)
    want = torch.linalg.solve(fisher + 1e-2 * torch.eye(len(g), dtype=g.dtype), g)
    gm = NaturalGradientMaker(
        model,
        PreconditioningConfig(damping=1e-2),
        fisher_type="fisher_emp",
        shape="full",
    )
    y = gm.setup_model_call(model, ids)
    gm.setup_loss_call(lm_loss, y, t)
    gm.forward_and_backward()
    got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


# Every registered method whose statistics come from module inputs, in-loop capable.
HOOKED = {
    "kfac": {"fisher_type": "fisher_emp"},
    "kfac_mc": {},
    "ekfac": {"fisher_type": "fisher_emp"},
    "ng_layer": {"fisher_type": "fisher_emp"},
    "ng_unit": {},
    "smw_ng": {},
    "seng": {"sketching_size": 8, "truncated_rank": 4},
}


def preconditioned(method, kwargs, model, ids, t, in_loop):
    """The preconditioned gradients of one step, by parameter name."""
    method = method.replace("kfac_mc", "kfac")
    config = {"damping": 1e-1, "kl_clip": None}
    if in_loop:
        opt = precondition_in_loop(
            torch.optim.SGD(model.parameters(), lr=0.0),
            model,
            method,
            config=config,
            **kwargs,
        )
        lm_loss(model(ids), t).backward()
        opt.step()
        opt.close()
    else:
        gm = make_gradient_maker(method, model, config=config, **kwargs)
        y = gm.setup_model_call(model, ids)
        gm.setup_loss_call(lm_loss, y, t)
        gm.forward_and_backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("method", sorted(HOOKED))
def test_arange_positions_precondition_as_batched_positions(method):
    """``wpe(torch.arange(T))`` gives, in the loop and through the maker, the
    preconditioned gradient of ``wpe(torch.arange(T)[None])`` (whose expansion
    the Hugging Face parity tests check against the dense definitions)."""
    ids, t = data(3, 5)
    want = preconditioned(
        method,
        HOOKED[method],
        NanoLM(5, batched_positions=True).double(),
        ids,
        t,
        in_loop=False,
    )
    for in_loop in (False, True):
        got = preconditioned(
            method, HOOKED[method], NanoLM(5).double(), ids, t, in_loop=in_loop
        )
        for name, w in want.items():
            torch.testing.assert_close(got[name], w, rtol=1e-9, atol=1e-12)
    plain = NanoLM(5).double()
    lm_loss(plain(ids), t).backward()
    assert not torch.allclose(want["wpe.weight"], plain.wpe.weight.grad)


def test_a_batch_of_single_ids_is_not_read_as_positions():
    """1-D ids of the batch's length that are not 0..T-1 are one id per example
    (a class embedding), recorded as such."""

    class ClassConditioned(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.wte = nn.Embedding(VOCAB, DIM)
            self.cls = nn.Embedding(3, DIM)
            self.head = nn.Linear(DIM, VOCAB)

        def forward(self, idx, label):
            h = self.wte(idx) + self.cls(label)[:, None, :]  # (N, T, d) + (N, 1, d)
            return self.head(torch.tanh(h))

    model = ClassConditioned().double()
    ids, t = data(4, 4)
    label = torch.tensor([2, 0, 1, 1])
    got = curvature(
        model, "cross_entropy", (ids, label), t, kind="fisher_emp", shape="full"
    )
    want = dense_empirical_fisher(model, "cross_entropy", (ids, label), t)
    torch.testing.assert_close(got.to_dense(), want, rtol=1e-9, atol=1e-13)


def test_micro_batches_of_different_sizes_in_the_loop():
    """Each model call expands its positions to its own batch (a smaller last
    micro-batch); the statistics are those of the union batch."""
    ids, t = data(5, 4)
    want = preconditioned(
        "kfac", {"fisher_type": "fisher_emp"}, NanoLM(4).double(), ids, t, in_loop=False
    )
    model = NanoLM(4).double()
    opt = precondition_in_loop(
        torch.optim.SGD(model.parameters(), lr=0.0),
        model,
        "kfac",
        config={"damping": 1e-1, "kl_clip": None},
        fisher_type="fisher_emp",
    )
    for part in (slice(0, 3), slice(3, 5)):
        k = part.stop - part.start
        (lm_loss(model(ids[part]), t[part]) * k / 5).backward()
    opt.step()
    opt.close()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-9, atol=1e-12)
