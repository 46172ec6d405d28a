"""Gefen's factored second moment (``second_moment="factored"``, factored.py).

The factors are checked against a dense float64 computation, the reference step
against an independent float64 AdamW with ``v = r c / mean(c)``, and the C kernel
and the PyTorch fallback against the reference; then the option through Gefen:
state, checkpoints, errors.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from leantrain.optim import Gefen, _fused, _native, _torch_step, factored
from leantrain.optim._options import StepOptions
from leantrain.optim._state import new_state
from leantrain.optim._step import reference_step
from leantrain.optim.codebook import with_exact_zero
from tests._helpers.fused_states import HYPER, codebook, codes_of, copy_state, ulps


def test_factor_shape():
    assert factored.factor_shape((64, 3, 3, 3)) == (64, 27)
    assert factored.factor_shape((5, 7)) == (5, 7)
    for shape in [(10,), (1, 9), (9, 1), (1, 1, 1), ()]:
        assert factored.factor_shape(shape) is None


def test_factor_update_matches_dense_float64(monkeypatch):
    torch.manual_seed(0)
    rows, cols, beta2 = 37, 21, 0.95
    factors = torch.zeros(rows + cols)
    r, c = np.zeros(rows), np.zeros(cols)
    for _ in range(4):
        g = torch.randn(rows, 3, 7) * torch.rand(rows, 1, 1)
        factored.update_factors(g, factors, rows, beta2)
        sq = g.double().reshape(rows, cols).numpy() ** 2
        r = beta2 * r + (1 - beta2) * sq.mean(1)
        c = beta2 * c + (1 - beta2) * sq.mean(0)
    np.testing.assert_allclose(factors[:rows].numpy(), r, rtol=2e-6)
    np.testing.assert_allclose(factors[rows:].numpy(), c, rtol=2e-6)
    cbar = factored.mean_column(factors, rows)
    assert cbar == pytest.approx(c.mean(), rel=1e-6)
    sqrt_bc2, eps = 0.3, 1e-8
    a, b = factored.denominator_factors(factors, rows, cbar, sqrt_bc2)
    den = factored.factored_denominator(a, b, eps, 5, 300)
    v = (r[:, None] * c[None, :] / c.mean()).reshape(-1)[5:300]
    np.testing.assert_allclose(den.numpy(), np.sqrt(v) / sqrt_bc2 + eps, rtol=1e-5)
    # while cbar is 0 (no gradient yet) v is 0 and the denominator is eps
    a, b = factored.denominator_factors(torch.zeros(5), 2, 0.0, sqrt_bc2)
    assert bool((factored.factored_denominator(a, b, eps, 0, 6) == eps).all())


def test_reference_step_is_adamw_with_the_factored_v():
    """fp32 momentum: the reference equals AdamW (float64, written here) with
    v_ij = r_i c_j / mean(c)."""
    torch.manual_seed(1)
    shape, rows, cols = (12, 2, 5), 12, 10
    h = dict(HYPER, weight_decay=0.05)
    param = torch.randn(shape)
    state = new_state(param, 10, None, None, (rows, cols))
    w = param.double().clone()
    m = torch.zeros(shape, dtype=torch.float64)
    r, c = (
        torch.zeros(rows, dtype=torch.float64),
        torch.zeros(cols, dtype=torch.float64),
    )
    b1, b2 = h["beta1"], h["beta2"]
    for t in range(1, 6):
        g = torch.randn(shape) * (1 + torch.arange(rows)[:, None, None])
        reference_step(param, g, state, **h)
        g64 = g.double()
        sq = g64.reshape(rows, cols) ** 2
        r = b2 * r + (1 - b2) * sq.mean(1)
        c = b2 * c + (1 - b2) * sq.mean(0)
        v = (r[:, None] * c[None, :] / c.mean()).reshape(shape)
        w *= 1 - h["lr"] * h["weight_decay"]
        m = b1 * m + (1 - b1) * g64
        denom = (v / (1 - b2**t)).sqrt() + h["eps"]
        w -= h["lr"] / (1 - b1**t) * m / denom
    torch.testing.assert_close(param.double(), w, rtol=1e-5, atol=1e-6)


CASES = [((64, 48), 256, 8), ((33, 7), 7, 4), ((128, 300), 1, 8), ((5, 4, 3), 20, None)]


@pytest.mark.parametrize("shape,period,bits", CASES + [((300, 200), 20000, 4)])
def test_fused_step_matches_reference(backend, shape, period, bits):
    torch.manual_seed(period)
    n = int(np.prod(shape))
    factors = factored.factor_shape(shape)
    cb = with_exact_zero(codebook(bits)) if bits else None
    param = torch.randn(shape)
    state = new_state(param, period, bits, cb, factors)
    mine, ref = copy_state(state), copy_state(state)
    p_mine, p_ref = param.clone(), param.clone()
    for step in range(4):
        grad = torch.randn(shape) * torch.rand(shape[0], *([1] * (len(shape) - 1)))
        hyper = dict(HYPER, maximize=step == 2)
        _fused.fused_step(p_mine, grad, mine, **hyper, stochastic_codes=bits == 4)
        reference_step(p_ref, grad, ref, **hyper, stochastic_codes=bits == 4)
        torch.testing.assert_close(
            mine["exp_avg_sq"], ref["exp_avg_sq"], rtol=1e-6, atol=0
        )
        if bits:
            diff = codes_of(mine, n).int() - codes_of(ref, n).int()
            assert int((diff != 0).sum()) <= 1
        scale = torch.maximum(p_ref.abs(), (p_ref - param).abs())
        assert ulps(p_mine, p_ref, scale) <= 8
        # next step from the reference's result, measured against it
        p_mine.copy_(p_ref)
        param = p_ref.clone()
        mine = copy_state(ref)


def test_backends_and_threads_give_the_same_bits():
    if _native.load() is None:
        pytest.skip(f"native kernel unavailable: {_native.status()}")
    torch.manual_seed(3)
    for shape, period, bits in CASES:
        param, grad = torch.randn(shape), torch.randn(shape)
        cb = with_exact_zero(codebook(bits)) if bits else None
        state = new_state(param, period, bits, cb, factored.factor_shape(shape))
        state["step"] += 1
        cbar = _fused.advance_factors(grad, state, HYPER["beta2"])
        h = StepOptions(**HYPER).scalars(1.0)
        results = []
        for chunk, threads in [(None, 1), (16, 2)]:
            s, p = copy_state(state), param.clone()
            _fused.c_step(p, grad, s, h, chunk=chunk, threads=threads, cbar=cbar)
            results.append((p, s))
        s, p = copy_state(state), param.clone()
        _torch_step.torch_step(p, grad, s, h, cbar=cbar)
        assert torch.equal(results[0][0], results[1][0])
        for key in state:
            assert torch.equal(results[0][1][key], results[1][1][key]), key
            if key not in ("exp_avg",):
                assert torch.equal(results[0][1][key], s[key]), key
        scale = torch.maximum(p.abs(), (p - param).abs())
        assert ulps(p, results[0][0], scale) <= 8  # sqrt: torch's may be 1 ulp off


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3)
    )


def _train(model, opt, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(128, 20, generator=g), torch.randn(128, 3, generator=g)
    x[:, :3] = 0.0  # inputs that are never lit: their weights' gradients are 0
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = (model(x) - y).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("bits", [8, 4])
def test_gefen_factors_matrices_only_and_trains(bits):
    model = _mlp()
    start = model[0].weight.detach().clone()
    opt = Gefen(
        model.parameters(), lr=1e-2, momentum_bits=bits, second_moment="factored"
    )
    losses = _train(model, opt, 30)
    assert losses[-1] < 0.8 * losses[0]
    w, b = opt.state[model[0].weight], opt.state[model[0].bias]
    assert int(w["factored"]) == 64 and w["exp_avg_sq"].shape == (64 + 20,)
    assert "factored" not in b  # 1-D: blocks
    # never-lit inputs: the factor, the stored momentum and the update are exactly 0
    assert bool((w["exp_avg_sq"][64:67] == 0).all())
    decay = (1 - 1e-2 * 1e-2) ** 30
    torch.testing.assert_close(
        model[0].weight.detach()[:, :3], start[:, :3] * decay, rtol=1e-5, atol=0
    )
    assert 0.0 in w["codebook"].tolist()


def test_gefen_resumes_bit_exactly(kit):
    model = _mlp()
    opt = Gefen(model.parameters(), lr=1e-2, momentum_bits=4, second_moment="factored")
    _train(model, opt, 5)
    saved = kit.roundtrip(opt.state_dict())
    twin = copy.deepcopy(model)
    opt2 = Gefen(twin.parameters(), lr=1e-2, momentum_bits=4, second_moment="factored")
    opt2.load_state_dict(saved)
    _train(model, opt, 4, seed=1)
    _train(twin, opt2, 4, seed=1)
    assert kit.max_diff(model, twin) == 0.0
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        for key, value in opt.state[p].items():
            assert torch.equal(value, opt2.state[q][key]), key


def test_bad_options_and_mismatched_checkpoints(kit):
    model = _mlp()
    with pytest.raises(ValueError, match="second_moment"):
        Gefen(model.parameters(), second_moment="rows")
    with pytest.raises(ValueError, match="partition='element'"):
        Gefen(model.parameters(), second_moment="factored", partition="element")
    opt = Gefen(model.parameters(), lr=1e-2, second_moment="factored")
    _train(model, opt, 2)
    saved = kit.roundtrip(opt.state_dict())
    with pytest.raises(ValueError, match="second_moment='factored'"):
        Gefen(
            copy.deepcopy(model).parameters(), second_moment="blocks"
        ).load_state_dict(saved)
    # "auto" takes either layout, and the group then says what the checkpoint says
    resumed = Gefen(copy.deepcopy(model).parameters())
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["second_moment"] == "factored"
    assert all("factored" in s for p, s in resumed.state.items() if p.ndim == 2)
    # a blocks state under a group that says factored: named, nothing loaded
    other = copy.deepcopy(model)
    blocks = Gefen(other.parameters(), lr=1e-2, second_moment="blocks")
    _train(other, blocks, 1)
    bad = kit.roundtrip(blocks.state_dict())
    for group in bad["param_groups"]:
        group["second_moment"] = "factored"
    target = Gefen(copy.deepcopy(model).parameters(), lr=1e-2, second_moment="factored")
    with pytest.raises(ValueError, match="second moment is blocks"):
        target.load_state_dict(bad)
    assert not target.state
    # the learned codebook holds an exact 0; an older checkpoint's may not, and a
    # factored or per-element group added to such an optimizer cannot use it
    other = _mlp()
    mixed = Gefen(list(other[0].parameters()), lr=1e-2, second_moment="blocks")
    _train(other, mixed, 1)
    assert 0.0 in mixed.state[other[0].weight]["codebook"].tolist()
    old = codebook(8)
    assert 0.0 not in old.tolist()
    for state in mixed.state.values():
        state["codebook"] = old
    for extra in ({"second_moment": "factored"}, {"partition": "element"}):
        trial = copy.deepcopy(mixed)
        trial.add_param_group({"params": [other[2].weight], **extra})
        with pytest.raises(ValueError, match="exact 0 code"):
            trial.step()
    # changing the option after the first step
    opt.param_groups[0]["second_moment"] = "blocks"
    with pytest.raises(ValueError, match="factored with 64 rows"):
        _train(model, opt, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_parameters_match_the_reference(backend, dtype):
    """bf16 (the kernel) and fp16 (the fallback) parameters and gradients, written
    back to nearest: the reference's result."""
    torch.manual_seed(4)
    shape = (40, 30)
    cb = with_exact_zero(codebook(8))
    param = torch.randn(shape).to(dtype)
    state = new_state(param, 256, 8, cb, factored.factor_shape(shape))
    mine, ref = copy_state(state), copy_state(state)
    p_mine, p_ref = param.clone(), param.clone()
    for _ in range(3):
        grad = torch.randn(shape).to(dtype)
        _fused.fused_step(p_mine, grad, mine, **HYPER, stochastic_rounding=False)
        reference_step(p_ref, grad, ref, **HYPER)
    torch.testing.assert_close(mine["exp_avg_sq"], ref["exp_avg_sq"], rtol=1e-6, atol=0)
    torch.testing.assert_close(p_mine.float(), p_ref.float(), rtol=1e-2, atol=1e-3)
    assert int((p_mine != p_ref).sum()) <= 2  # an ulp of the update at a tie


def test_dcp_checkpoint_resumes_bit_exactly(tmp_path):
    """torch.distributed.checkpoint in one process: the template DCP builds (a
    zero-gradient, lr-0 step) has the factored checkpoint's keys and shapes, and the
    loaded run continues bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def build():
        model = _mlp()
        opt = Gefen(
            model.parameters(), lr=1e-2, momentum_bits=4, second_moment="factored"
        )
        return model, opt

    model, opt = build()
    _train(model, opt, 4)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path))
    twin, twin_opt = build()
    model_sd, optim_sd = get_state_dict(twin, twin_opt)  # the template
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(tmp_path))
    set_state_dict(
        twin, twin_opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    _train(model, opt, 3, seed=2)
    _train(twin, twin_opt, 3, seed=2)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)


def test_with_exact_zero_moves_only_the_code_nearest_zero():
    for cb in (
        torch.tensor([-1.0, -0.3, 2.4e-4, 0.5, 1.0]),
        torch.tensor([-1.0, -1e-4, 3e-4, 1.0]),
        torch.tensor([-1.0, 0.0, 1.0]),
    ):
        out = with_exact_zero(cb)
        assert 0.0 in out.tolist() and bool((out[1:] > out[:-1]).all())
        assert int((out != cb).sum()) <= 1 and out is not cb
        assert out[0] == -1 and out[-1] == 1


def _wide_mlp():
    torch.manual_seed(0)  # matrices 256 x 20, 256 x 256 and 3 x 256; biases 1-D
    return torch.nn.Sequential(
        torch.nn.Linear(20, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 3),
    )


def test_auto_factors_every_matrix_whatever_the_bits():
    """second_moment="auto" (the default), with the automatic partition: factors
    every matrix, small ones too, for 4-bit, 8-bit and fp32 momentum; blocks for
    1-D tensors, an explicit partition and second_moment="blocks"."""
    cases = [
        ({"momentum_bits": 4}, "all"),
        ({"momentum_bits": 8}, "all"),
        ({"momentum_bits": None}, "all"),
        ({}, "all"),
        ({"momentum_bits": 4, "partition": 64}, "none"),
        ({"momentum_bits": 8, "partition": 64}, "none"),
        ({"momentum_bits": 4, "partition": "tensor"}, "none"),
        ({"momentum_bits": 8, "second_moment": "factored"}, "all"),
        ({"momentum_bits": 4, "second_moment": "blocks"}, "none"),
        ({"momentum_bits": 8, "second_moment": "blocks"}, "none"),
    ]
    for options, which in cases:
        model = _wide_mlp()
        opt = Gefen(model.parameters(), lr=1e-2, **options)
        g = torch.Generator().manual_seed(0)
        model(torch.randn(16, 20, generator=g)).square().mean().backward()
        opt.step()
        for p, state in opt.state.items():
            want = {"all": p.ndim == 2, "none": False}[which]
            assert ("factored" in state) == want, (options, tuple(p.shape))
    # per group: the 8-bit and the 4-bit group factor their small matrices (64 x 20,
    # 3 x 64), a group with an explicit partition keeps blocks
    model = torch.nn.Sequential(
        torch.nn.Linear(20, 64), torch.nn.Linear(64, 3), torch.nn.Linear(3, 3)
    )
    opt = Gefen(
        [
            {"params": model[0].parameters(), "momentum_bits": 8},
            {"params": model[1].parameters(), "momentum_bits": 4},
            {"params": model[2].parameters(), "partition": 3},
        ],
        lr=1e-2,
    )
    model(torch.randn(8, 20)).square().mean().backward()
    opt.step()
    assert "factored" in opt.state[model[0].weight]
    assert "factored" in opt.state[model[1].weight]
    assert "factored" not in opt.state[model[2].weight]


def test_auto_four_bit_is_the_factored_step_bit_for_bit(kit):
    model = _mlp()
    twin = copy.deepcopy(model)
    auto = Gefen(model.parameters(), lr=1e-2, momentum_bits=4)
    explicit = Gefen(
        twin.parameters(), lr=1e-2, momentum_bits=4, second_moment="factored"
    )
    _train(model, auto, 6)
    _train(twin, explicit, 6)
    assert kit.max_diff(model, twin) == 0.0


def test_auto_resumes_a_blocks_checkpoint_as_blocks(kit):
    """A 4-bit checkpoint with blocks (saved with second_moment="blocks", or from
    before the option existed) resumes bit-exactly under the "auto" default."""
    model = _mlp()
    opt = Gefen(model.parameters(), lr=1e-2, momentum_bits=4, second_moment="blocks")
    _train(model, opt, 3)
    saved = kit.roundtrip(opt.state_dict())
    older = copy.deepcopy(saved)
    for group in older["param_groups"]:
        del group["second_moment"]
    for checkpoint in (saved, older):
        twin = copy.deepcopy(model)
        resumed = Gefen(twin.parameters(), lr=1e-2, momentum_bits=4)
        resumed.load_state_dict(checkpoint)
        reference = copy.deepcopy(model)
        ref_opt = Gefen(
            reference.parameters(), lr=1e-2, momentum_bits=4, second_moment="blocks"
        )
        ref_opt.load_state_dict(saved)
        _train(twin, resumed, 3, seed=1)
        _train(reference, ref_opt, 3, seed=1)
        assert kit.max_diff(twin, reference) == 0.0
        assert not any("factored" in s for s in resumed.state.values())
    # an "auto" checkpoint whose matrices factor does not load as explicit blocks
    opt4 = Gefen(model.parameters(), lr=1e-2, momentum_bits=4)
    _train(model, opt4, 1)
    target = Gefen(
        copy.deepcopy(model).parameters(), momentum_bits=4, second_moment="blocks"
    )
    with pytest.raises(ValueError, match="factored"):
        target.load_state_dict(kit.roundtrip(opt4.state_dict()))
