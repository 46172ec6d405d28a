"""GefenMuon: Newton–Schulz against torch and an SVD reference, the optimizer against
torch.optim.Muon (fp32 momentum), the quantized momentum against a brute-force
quantizer, the AdamW side against Gefen, and the optimizer contract (checkpoints,
errors, closures, groups)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as sched
from torch.optim._muon import _adjust_lr as torch_adjust_lr
from torch.optim._muon import _zeropower_via_newtonschulz as torch_zeropower

from leantrain.optim import Gefen, optimizer_state_nbytes
from leantrain.optim.muon import (
    GefenMuon,
    adjust_lr,
    muon_param_groups,
    newton_schulz,
    newton_schulz_reference,
)

COEFFS = (3.4445, -4.775, 2.0315)
SHAPES = [(16, 24), (40, 12), (9, 9)]


def _matrix_mlp(seed: int = 0) -> nn.Module:
    """Only 2-D parameters (no biases): every parameter is a Muon parameter."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(12, 32, bias=False),
        nn.Tanh(),
        nn.Linear(32, 24, bias=False),
        nn.Tanh(),
        nn.Linear(24, 5, bias=False),
    )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


# --- Newton–Schulz and the lr adjustment -------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_newton_schulz_bf16_is_torch_muon_bit_for_bit(shape):
    G = torch.randn(shape)
    ours = newton_schulz(G, 5, COEFFS, 1e-7, dtype=torch.bfloat16)
    theirs = torch_zeropower(G, COEFFS, 5, 1e-7).float()
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("steps", [0, 1, 5])
def test_newton_schulz_equals_polynomial_of_singular_values(shape, steps):
    G = torch.randn(shape, dtype=torch.float64)
    reference = newton_schulz_reference(G, steps, COEFFS, 1e-7)
    assert _rel(newton_schulz(G, steps, dtype=torch.float64), reference) < 1e-10
    assert _rel(newton_schulz(G.float(), steps, dtype=torch.float32), reference) < 1e-5
    assert _rel(newton_schulz(G.float(), steps), reference) < 3e-2  # bf16


def test_newton_schulz_orthogonalizes():
    # Keller Jordan's coefficients push every singular value into ~[0.68, 1.13].
    G = torch.randn(32, 64, dtype=torch.float64)
    s = torch.linalg.svdvals(newton_schulz(G, dtype=torch.float64))
    assert s.min() > 0.6 and s.max() < 1.2


def test_newton_schulz_zero_matrix_stays_zero():
    assert torch.equal(newton_schulz(torch.zeros(4, 6)), torch.zeros(4, 6))


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ((torch.zeros(5),), ValueError, r"2-D matrix, got shape \(5,\)"),
        ((torch.zeros(2, 3, 4),), ValueError, r"got shape \(2, 3, 4\)"),
        ((torch.zeros(3, 3), 100), ValueError, "Invalid ns_steps: 100"),
        ((torch.zeros(3, 3), 2.5), TypeError, "ns_steps must be an int, got 2.5"),
        ((torch.zeros(3, 3), 5, (1.0, 2.0)), ValueError, "Invalid ns_coefficients"),
        ((torch.zeros(3, 3), 5, COEFFS, -1.0), ValueError, "Invalid epsilon value"),
    ],
)
def test_newton_schulz_rejects_bad_input(args, error, message):
    with pytest.raises(error, match=message):
        newton_schulz(*args)


@pytest.mark.parametrize("fn", [None, "original", "match_rms_adamw"])
@pytest.mark.parametrize("shape", [(64, 16), (16, 64), (30, 30)])
def test_adjust_lr_matches_torch(fn, shape):
    assert adjust_lr(0.02, fn, torch.Size(shape)) == torch_adjust_lr(
        0.02, fn, torch.Size(shape)
    )


def test_adjust_lr_rejects_unknown_name():
    with pytest.raises(ValueError, match="Invalid adjust_lr_fn: 'sqrt'"):
        adjust_lr(0.1, "sqrt", torch.Size((3, 3)))


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


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("partition", ["auto", 7])
def test_quantized_momentum_matches_brute_force(bits, partition, kit):
    x, y = kit.make_data()
    model = _matrix_mlp()
    opt = GefenMuon(
        model.parameters(), lr=0.02, momentum_bits=bits, partition=partition
    )
    kit.train(model, opt, x, y, 1)  # learns the codebook
    for _ in range(4):
        opt.zero_grad()
        kit.loss_fn(model, x, y).backward()
        before = {p: copy.deepcopy(opt.state[p]) for p in model.parameters()}
        opt.step()
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
    theirs = Gefen(reference.parameters(), momentum_bits=bits, **hyper)
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


# --- optimizer contract ------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4, None])
def test_state_dict_round_trip_resumes_bit_exactly(bits, kit):
    x, y = kit.make_data()
    model = kit.make_mlp()
    options = {"lr": 0.02, "adamw_lr": 1e-2, "momentum_bits": bits}
    options["ns_dtype"] = torch.float64 if bits is None else None
    opt = GefenMuon(model.parameters(), **options)
    kit.train(model, opt, x, y, 4)
    resumed_model = kit.clone(model)
    resumed = GefenMuon(resumed_model.parameters(), **options)
    resumed.load_state_dict(kit.roundtrip(opt.state_dict()))
    for p in resumed_model.parameters():
        assert resumed.state[p]["step"].dtype == torch.float32
        if bits is not None:
            assert resumed.state[p]["exp_avg_codes"].dtype == torch.uint8
    if bits is not None:
        assert len({id(s["codebook"]) for s in resumed.state.values()}) == 1
    kit.train(model, opt, x, y, 4)
    kit.train(resumed_model, resumed, x, y, 4)
    assert kit.max_diff(model, resumed_model) == 0.0


def test_load_state_dict_rejects_other_layouts(kit):
    x, y = kit.make_data()
    model = kit.make_mlp()
    opt = GefenMuon(model.parameters())
    kit.train(model, opt, x, y, 1)
    other = GefenMuon(kit.clone(model).parameters(), momentum_bits=4)
    with pytest.raises(ValueError, match="momentum_bits"):
        other.load_state_dict(opt.state_dict())
    matrices = _matrix_mlp()  # one param group in both optimizers
    adamw = torch.optim.AdamW(matrices.parameters())
    kit.train(matrices, adamw, x, y, 1)
    with pytest.raises(ValueError, match="not a GefenMuon state dict"):
        GefenMuon(matrices.parameters()).load_state_dict(adamw.state_dict())


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"lr": -1.0}, ValueError, "Invalid learning rate: -1.0"),
        ({"weight_decay": -0.5}, ValueError, "Invalid weight_decay value: -0.5"),
        ({"momentum": 1.0}, ValueError, "Invalid momentum value: 1.0"),
        ({"nesterov": 1}, TypeError, "nesterov must be a bool, got 1"),
        ({"ns_steps": 100}, ValueError, "Invalid ns_steps: 100"),
        ({"ns_coefficients": (1.0, 2.0)}, ValueError, "Invalid ns_coefficients"),
        ({"eps": -1.0}, ValueError, "Invalid epsilon value: -1.0"),
        ({"adjust_lr_fn": "x"}, ValueError, "Invalid adjust_lr_fn: 'x'"),
        ({"momentum_bits": 3}, ValueError, "Invalid momentum_bits: 3"),
        ({"partition": "rows"}, ValueError, "Invalid partition: 'rows'"),
        ({"ns_dtype": torch.int32}, ValueError, "Invalid ns_dtype: torch.int32"),
        ({"adamw_lr": -1.0}, ValueError, "Invalid learning rate: -1.0"),
        ({"adamw_betas": (1.0, 0.9)}, ValueError, "beta parameter at index 0: 1.0"),
        ({"adamw_eps": -1.0}, ValueError, "Invalid epsilon value: -1.0"),
        ({"adamw_weight_decay": -1.0}, ValueError, "Invalid weight_decay value"),
        ({"nonfinite": "ignore"}, ValueError, "Invalid nonfinite: 'ignore'"),
    ],
)
def test_invalid_options_raise(kwargs, error, message):
    with pytest.raises(error, match=message):
        GefenMuon([nn.Parameter(torch.zeros(3, 3))], **kwargs)


def test_invalid_groups_raise():
    vector = nn.Parameter(torch.zeros(5))
    with pytest.raises(ValueError, match=r"shape \(5,\).*use_muon=True.*2-D"):
        GefenMuon([{"params": [vector], "use_muon": True}])
    with pytest.raises(ValueError, match="Invalid use_muon: 'yes'"):
        GefenMuon([{"params": [vector], "use_muon": "yes"}])
    with pytest.raises(ValueError, match="Invalid use_muon: 1"):
        GefenMuon([{"params": [vector], "use_muon": 1}])
    with pytest.raises(ValueError, match="Invalid momentum value: 2"):
        GefenMuon([{"params": [nn.Parameter(torch.zeros(2, 2))], "momentum": 2}])
    with pytest.raises(TypeError, match="complex"):
        GefenMuon([nn.Parameter(torch.zeros(2, 2, dtype=torch.complex64))])
    with pytest.raises(ValueError, match="beta parameter at index 1: 1.5"):
        GefenMuon([{"params": [vector], "use_muon": False, "betas": (0.9, 1.5)}])


def test_adamw_group_options_come_from_the_group_or_adamw_defaults():
    w, v = nn.Parameter(torch.zeros(3, 3)), nn.Parameter(torch.zeros(3))
    opt = GefenMuon(
        [{"params": [w], "use_muon": False, "lr": 0.5}, {"params": [v]}],
        adamw_lr=0.1,
        adamw_weight_decay=0.2,
    )
    explicit, split = opt.param_groups
    assert (explicit["lr"], explicit["weight_decay"]) == (0.5, 0.2)
    assert (split["lr"], split["use_muon"]) == (0.1, False)


@pytest.mark.parametrize("bits", [8, None])
def test_lr_zero_changes_nothing(bits, kit):
    x, y = kit.make_data()
    model = kit.make_mlp()
    before = kit.clone(model)
    opt = GefenMuon(model.parameters(), lr=0.0, adamw_lr=0.0, momentum_bits=bits)
    kit.train(model, opt, x, y, 3)
    assert kit.max_diff(model, before) == 0.0
    assert len(opt.state) == len(list(model.parameters()))


def test_closure_on_the_first_step_equals_explicit_backward(kit):
    x, y = kit.make_data()
    model = kit.make_mlp()
    explicit_model = kit.clone(model)
    opt = GefenMuon(model.parameters(), lr=0.02)
    explicit = GefenMuon(explicit_model.parameters(), lr=0.02)

    def closure():
        opt.zero_grad()
        loss = kit.loss_fn(model, x, y)
        loss.backward()
        return loss

    for _ in range(3):
        returned = opt.step(closure)
        explicit.zero_grad()
        expected = kit.loss_fn(explicit_model, x, y)
        expected.backward()
        explicit.step()
        assert returned.item() == expected.item()
    assert kit.max_diff(model, explicit_model) == 0.0


def test_add_param_group_and_late_parameters_share_the_codebook(kit):
    x, y = kit.make_data()
    model = kit.make_mlp()
    first, *rest = list(model.children())
    opt = GefenMuon(first.parameters(), lr=0.02)
    kit.train(model, opt, x, y, 2)
    codebook = opt.state[first.weight]["codebook"]
    opt.add_param_group({"params": [p for m in rest for p in m.parameters()]})
    assert [g["use_muon"] for g in opt.param_groups] == [True, False, True, False]
    late = [p for m in rest for p in m.parameters()]
    snapshot = [p.detach().clone() for p in late]
    kit.train(model, opt, x, y, 2)
    for p, old in zip(late, snapshot, strict=True):
        assert not torch.equal(p, old)
        assert opt.state[p]["codebook"] is codebook


def test_nonfinite_gradient_skips_the_step(kit):
    x, y = kit.make_data()
    model = kit.make_mlp()
    opt = GefenMuon(model.parameters(), lr=0.02)
    kit.train(model, opt, x, y, 2)
    params, state = kit.clone(model), copy.deepcopy(opt.state_dict())
    opt.zero_grad()
    kit.loss_fn(model, x, y).backward()
    next(model.parameters()).grad[0, 0] = math.nan
    with pytest.warns(RuntimeWarning, match="non-finite gradient"):
        opt.step()
    assert kit.max_diff(model, params) == 0.0
    assert opt.nonfinite_steps == 1
    for key, saved in state["state"].items():
        for name, value in saved.items():
            live = opt.state_dict()["state"][key][name]
            assert torch.equal(live, value), name
    strict = GefenMuon(model.parameters(), nonfinite="raise")
    with pytest.raises(FloatingPointError, match="non-finite gradient"):
        strict.step()


def test_scheduler_scales_both_sides(kit):
    model = kit.make_mlp()
    opt = GefenMuon(model.parameters(), lr=0.02, adamw_lr=1e-2)
    scheduler = sched.StepLR(opt, step_size=1, gamma=0.5)
    opt.step()
    scheduler.step()
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.005]


def test_bf16_parameters_are_updated_in_fp32_and_stored_back(kit):
    x, y = kit.make_data()
    model = _matrix_mlp().to(torch.bfloat16)
    exact = _matrix_mlp()
    kit.train(model, GefenMuon(model.parameters(), lr=0.02), x, y, 5)
    kit.train(exact, GefenMuon(exact.parameters(), lr=0.02), x, y, 5)
    for a, b in zip(model.parameters(), exact.parameters(), strict=True):
        assert a.dtype == torch.bfloat16
        assert _rel(a.float(), b) < 0.05


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
