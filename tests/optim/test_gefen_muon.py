"""GefenMuon against torch.optim.Muon (fp32 momentum), the quantized momentum against
a brute-force quantizer, the AdamW side against Gefen, routing and memory. The
Newton–Schulz iteration is in test_muon_newton_schulz.py, the optimizer contract
(checkpoints, errors, closures, groups) in test_gefen_muon_contract.py."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from leantrain.optim import Gefen, optimizer_state_nbytes
from leantrain.optim.muon import (
    GefenMuon,
    muon_param_groups,
)
from tests._helpers.muon_models import matrix_mlp as _matrix_mlp
from tests._helpers.muon_models import rel as _rel

# --- parity with torch.optim.Muon (fp32 momentum) ----------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"nesterov": False},
        {"adjust_lr_fn": "match_rms_adamw", "weight_decay": 0.0},
        {"adjust_lr_fn": "original", "momentum": 0.8, "ns_steps": 3},
    ],
)
def test_unquantized_gefen_muon_is_torch_muon(options, kit):
    x, y = kit.make_data()
    model = _matrix_mlp()
    reference = copy.deepcopy(model)
    lr = 0.01 if options.get("adjust_lr_fn") == "match_rms_adamw" else 0.02
    ours = GefenMuon(
        model.parameters(),
        lr=lr,
        momentum_bits=None,
        ns_dtype=torch.bfloat16,
        **options,
    )
    theirs = torch.optim.Muon(reference.parameters(), lr=lr, **options)
    kit.train(model, ours, x, y, 50)
    kit.train(reference, theirs, x, y, 50)
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert _rel(a, b) < 1e-6
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        momentum = ours.state[a]["exp_avg"]
        assert _rel(momentum, theirs.state[b]["momentum_buffer"]) < 1e-6


# --- quantized momentum against a brute-force reference ----------------------------


def _unpack(codes: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    if bits == 8:
        return codes.long()
    pairs = torch.stack([codes & 0xF, codes >> 4], dim=1).reshape(-1)
    return pairs[:n].long()


def _reference_momentum(state: dict, grad: torch.Tensor, momentum: float, bits: int):
    """Dequantize, lerp, per-block absmax, nearest code by brute-force argmin."""
    codebook, qblock, n = state["codebook"], int(state["qblock"]), grad.numel()
    codes = _unpack(state["exp_avg_codes"], n, bits)
    scale = state["exp_avg_absmax"].repeat_interleave(qblock)[:n]
    m = codebook[codes] * scale
    m = m.lerp(grad.reshape(-1).float(), 1 - momentum)
    absmax = torch.stack([b.abs().max() for b in m.split(qblock)])
    blocks = absmax.repeat_interleave(qblock)[:n]
    normed = torch.where(blocks > 0, m / blocks, torch.zeros_like(m))
    new_codes = (normed[:, None] - codebook[None, :]).abs().argmin(dim=1)
    return new_codes, absmax, normed


def _step_after_snapshot(opt, model, kit, x, y) -> dict:
    """One training step; returns every parameter's state as it was before it."""
    opt.zero_grad()
    kit.loss_fn(model, x, y).backward()
    before = {p: copy.deepcopy(opt.state[p]) for p in model.parameters()}
    opt.step()
    return before


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("partition", ["auto", 7])
def test_quantized_momentum_matches_brute_force(bits, partition, kit):
    x, y = kit.make_data()
    model = _matrix_mlp()
    opt = GefenMuon(
        model.parameters(),
        lr=0.02,
        momentum_bits=bits,
        partition=partition,
        momentum_rounding="nearest",  # the stochastic codes: the test below
    )
    kit.train(model, opt, x, y, 1)  # learns the codebook
    for _ in range(4):
        before = _step_after_snapshot(opt, model, kit, x, y)
        for p in model.parameters():
            state = opt.state[p]
            codes, absmax, normed = _reference_momentum(before[p], p.grad, 0.95, bits)
            assert torch.allclose(state["exp_avg_absmax"], absmax, rtol=1e-6, atol=0)
            got = _unpack(state["exp_avg_codes"], p.numel(), bits)
            # A value within rounding of a midpoint may go either way.
            cb = state["codebook"]
            differ = got != codes
            gap = (normed[differ] - cb[got[differ]]).abs() - (
                normed[differ] - cb[codes[differ]]
            ).abs()
            assert bool((gap.abs() < 1e-6).all())
            assert int(state["step"]) == int(before[p]["step"]) + 1


@pytest.mark.parametrize("bits,rounding", [(4, "auto"), (8, "stochastic")])
def test_stochastic_codes_are_the_rules(kit, bits, rounding):
    """Stochastic codes (the 4-bit default; 8-bit on request): each stored code is
    ``code_rounding.stochastic_codes`` of the brute-force momentum, keyed by the
    parameter's position and the step (a value within rounding of a threshold may
    go either way: at most a few per step)."""
    from leantrain.optim.code_rounding import code_key, stochastic_codes, uniform

    x, y = kit.make_data()
    model = _matrix_mlp()
    opt = GefenMuon(
        model.parameters(), lr=0.02, momentum_bits=bits, momentum_rounding=rounding
    )
    position = {
        id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])
    }
    kit.train(model, opt, x, y, 1)
    flipped = 0
    for _ in range(4):
        before = _step_after_snapshot(opt, model, kit, x, y)
        for p in model.parameters():
            nearest, _, normed = _reference_momentum(before[p], p.grad, 0.95, bits)
            key = code_key(position[id(p)], int(opt.state[p]["step"]))
            r = uniform(key, 0, p.numel())
            expected = stochastic_codes(normed, opt.state[p]["codebook"], r).long()
            got = _unpack(opt.state[p]["exp_avg_codes"], p.numel(), bits)
            flipped += int((got != expected).sum())
            assert int((got != nearest).sum()) > 0  # the rounding ran
    assert flipped <= 4


def test_quantized_muon_trains_like_fp32_muon(kit):
    # Trajectories themselves diverge (Newton-Schulz boosts the small singular
    # directions that quantization noise perturbs), so compare what training reaches.
    x, y = kit.make_data()
    final = {}
    for bits in (None, 8, 4):
        model = _matrix_mlp()
        opt = GefenMuon(model.parameters(), lr=0.02, momentum_bits=bits)
        losses = kit.train(model, opt, x, y, 30)
        final[bits] = losses[-1]
        assert losses[-1] < 0.3 * losses[0]
    assert final[8] < 1.2 * final[None]


# --- routing, the AdamW side, and memory -------------------------------------------


def test_mixed_model_routes_matrices_to_muon_and_the_rest_to_adamw(kit):
    x, y = kit.make_data()
    model = kit.make_mlp()  # Linear weights 2-D; biases and LayerNorm 1-D
    before = copy.deepcopy(model)
    opt = GefenMuon(model.parameters(), lr=0.02, adamw_lr=1e-2)
    assert [g["use_muon"] for g in opt.param_groups] == [True, False]
    assert all(p.ndim == 2 for p in opt.param_groups[0]["params"])
    assert all(p.ndim == 1 for p in opt.param_groups[1]["params"])
    assert opt.param_groups[1]["lr"] == 1e-2
    assert opt.param_groups[1]["betas"] == (0.9, 0.95)
    losses = kit.train(model, opt, x, y, 30)
    assert losses[-1] < 0.5 * losses[0]
    for p, q in zip(model.parameters(), before.parameters(), strict=True):
        assert not torch.equal(p, q)
        assert ("exp_avg_sq" in opt.state[p]) == (p.ndim != 2)
    codebooks = {id(s["codebook"]) for s in opt.state.values()}
    assert len(codebooks) == 1  # one codebook for both sides


@pytest.mark.parametrize("bits", [8, 4, None])
def test_adamw_side_is_gefen(bits, kit):
    x, y = kit.make_data()
    model = kit.make_mlp()
    reference = copy.deepcopy(model)
    hyper = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}
    ours = GefenMuon(
        [{"params": model.parameters(), "use_muon": False, **hyper}],
        momentum_bits=bits,
    )
    # GefenMuon's AdamW side keeps blocks whatever the bits
    theirs = Gefen(
        reference.parameters(), momentum_bits=bits, second_moment="blocks", **hyper
    )
    kit.train(model, ours, x, y, 8)
    kit.train(reference, theirs, x, y, 8)
    assert kit.max_diff(model, reference) == 0.0


def test_muon_param_groups_route_embeddings_and_head_to_adamw():
    from leantrain.models.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(block_size=8, n_layer=1, n_head=2, d_model=16))
    groups = muon_param_groups(model, adamw_modules=[model.lm_head])
    muon, adamw = (set(map(id, g["params"])) for g in groups)
    for name, p in model.named_parameters():
        to_adamw = p.ndim != 2 or name.startswith(("wte", "wpe", "lm_head"))
        assert (id(p) in adamw) == to_adamw, name
        assert (id(p) in muon) != to_adamw, name


def test_gpt_trains_with_default_construction():
    from leantrain.models.gpt import GPT, GPTConfig, lm_loss

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, n_layer=2, n_head=2, d_model=16))
    opt = GefenMuon(model.parameters(), lr=0.02, adamw_lr=3e-3)
    idx = torch.randint(0, 256, (4, 9))
    losses = []
    for _ in range(15):
        opt.zero_grad()
        loss = lm_loss(model(idx[:, :-1]), idx[:, 1:])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


def test_muon_state_is_about_one_byte_per_parameter():
    w = nn.Parameter(torch.randn(64, 256))
    opt = GefenMuon([w], partition=256)
    w.grad = torch.randn(64, 256)
    opt.step()
    state = opt.state[w]
    assert sorted(state) == sorted(
        ["step", "period", "exp_avg_codes", "exp_avg_absmax", "qblock", "codebook"]
    )
    n = w.numel()
    expected = n + 4 * (n // 256) + 4 * 256 + 4 + 8 + 8
    assert optimizer_state_nbytes(opt) == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_torch_muon_and_quantizes_on_device(kit):
    x, y = (t.cuda() for t in kit.make_data())
    model = _matrix_mlp().cuda()
    reference = copy.deepcopy(model)
    # ns_dtype=None is bfloat16 on CUDA: torch.optim.Muon's own iteration.
    ours = GefenMuon(model.parameters(), lr=0.02, momentum_bits=None)
    kit.train(model, ours, x, y, 50)
    kit.train(reference, torch.optim.Muon(reference.parameters(), lr=0.02), x, y, 50)
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert _rel(a, b) < 1e-6
    quantized = GefenMuon(model.parameters(), lr=0.02)
    kit.train(model, quantized, x, y, 3)
    state = quantized.state[next(model.parameters())]
    assert state["exp_avg_codes"].is_cuda and state["codebook"].is_cuda
