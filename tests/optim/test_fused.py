"""Tests of Gefen's fused step: the C kernel and the chunked PyTorch fallback.

Every path is compared with ``_step.reference_step`` (the definition) and with an
independent brute-force reading of docs/CONTRACTS.md written here.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from leantrain.optim import _fused, _native, _quant_table, _torch_step
from leantrain.optim._options import StepOptions
from leantrain.optim._state import new_state
from leantrain.optim._step import reference_step
from leantrain.optim.quant import NearestCode
from tests._helpers.fused_states import (
    HYPER,
    SHAPES,
    codebook,
    codes_of,
    copy_state,
    exact_nearest,
    random_state,
    spaced_codebook,
    ulps,
)


@pytest.mark.parametrize("update_clip", [None, 1.0])
@pytest.mark.parametrize("bits", [8, 4, None])
@pytest.mark.parametrize("n,period", SHAPES)
def test_matches_reference_step(backend, bits, n, period, update_clip):
    """fused_step == reference_step to fp32 rounding, step after step (with
    ``update_clip`` 1.0 the clip binds on 5-55 % of the elements of the first
    step, but for the single element)."""
    torch.manual_seed(n + period)
    param = torch.randn(n)
    state = random_state(n, period, bits, seed=n)
    mismatches = 0
    for step in range(3):
        hyper = dict(
            HYPER,
            maximize=step == 1,
            weight_decay=0.1 * (step != 2),
            update_clip=update_clip,
        )
        grad = torch.randn(n) * (1 + torch.arange(n) % 5)
        mine, ref = copy_state(state), copy_state(state)
        p_mine, p_ref = param.clone(), param.clone()
        _fused.fused_step(p_mine, grad, mine, **hyper)
        reference_step(p_ref, grad, ref, **hyper)
        assert float(mine["step"]) == float(ref["step"]) == float(state["step"]) + 1
        torch.testing.assert_close(
            mine["exp_avg_sq"], ref["exp_avg_sq"], rtol=1e-6, atol=0
        )
        agree = torch.ones(n, dtype=torch.bool)
        if bits is None:
            torch.testing.assert_close(
                mine["exp_avg"], ref["exp_avg"], rtol=1e-6, atol=1e-7
            )
        else:
            torch.testing.assert_close(
                mine["exp_avg_absmax"], ref["exp_avg_absmax"], rtol=1e-6, atol=0
            )
            diff = codes_of(mine, n).int() - codes_of(ref, n).int()
            assert int(diff.abs().max()) <= 1
            mismatches += int((diff != 0).sum())
            agree = diff == 0
        # where the codes agree, the update agrees up to a few roundings
        scale = torch.maximum(p_ref.abs(), (p_ref - param).abs())
        if agree.any():
            assert ulps(p_mine[agree], p_ref[agree], scale[agree]) <= 8
        param, state = p_ref, ref  # next step from the reference's result
    # codes may differ only where m / absmax sits within rounding of a midpoint
    assert mismatches <= max(1, 3 * n // 10_000)


def contract_step(
    param,
    grad,
    state,
    *,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    maximize,
    update_clip=None,
):
    """docs/CONTRACTS.md read literally: brute-force nearest code in float64."""
    n, p = param.numel(), int(state["period"])
    g = -grad if maximize else grad
    state["step"] += 1
    t = float(state["step"])
    blocks = torch.arange(n) // p
    sums = torch.zeros(state["exp_avg_sq"].numel(), dtype=torch.float64)
    sums.index_add_(0, blocks, (g * g).double())
    counts = torch.bincount(blocks).double()
    v = state["exp_avg_sq"] * beta2 + (1 - beta2) * (sums / counts).float()
    state["exp_avg_sq"] = v
    param.mul_(1 - lr * weight_decay)
    cb = state["codebook"]
    qb = torch.arange(n) // int(state["qblock"])
    m = torch.lerp(
        cb[codes_of(state, n).long()] * state["exp_avg_absmax"][qb], g, 1 - beta1
    )
    absmax = torch.zeros_like(state["exp_avg_absmax"]).scatter_reduce_(
        0, qb, m.abs(), "amax", include_self=False
    )
    x = torch.where(absmax[qb] > 0, m / absmax[qb], torch.zeros_like(m))
    codes = exact_nearest(x, cb)  # ties go to the lower code; only stored
    denom = (
        v.sqrt()[blocks if p > 1 else torch.arange(n)] / math.sqrt(1 - beta2**t) + eps
    )
    step = lr / (1 - beta1**t) * m / denom  # the update uses the exact new m
    if update_clip is not None:
        step = step.clamp(-lr * update_clip, lr * update_clip)
    param.sub_(step)
    return codes, absmax


@pytest.mark.parametrize("update_clip", [None, 1.0])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n,period", [(1001, 7), (999, 1), (777, 777)])
def test_matches_contract_brute_force(backend, bits, n, period, update_clip):
    """An independent reading of the contract: codes equal, params within roundings."""
    state = random_state(n, period, bits, seed=7)
    param, grad = torch.randn(n), torch.randn(n)
    mine, ref = copy_state(state), copy_state(state)
    p_mine, p_ref = param.clone(), param.clone()
    hyper = dict(HYPER, update_clip=update_clip)
    _fused.fused_step(p_mine, grad, mine, **hyper)
    free = param.clone()  # the same step without a clip
    contract_step(free, grad, copy_state(state), **HYPER)
    codes, absmax = contract_step(p_ref, grad, ref, **hyper)
    if update_clip is not None:  # the clip binds on some elements, not all
        clipped = float((free != p_ref).float().mean())
        assert 0 < clipped < 0.9, clipped
    torch.testing.assert_close(mine["exp_avg_absmax"], absmax, rtol=1e-6, atol=0)
    assert int((codes_of(mine, n).long() != codes).sum()) <= 1
    torch.testing.assert_close(mine["exp_avg_sq"], ref["exp_avg_sq"], rtol=1e-6, atol=0)
    torch.testing.assert_close(p_mine, p_ref, rtol=1e-5, atol=1e-6)


def crowded_codebook() -> torch.Tensor:
    """254 of 256 codes within 2e-3 of 0: many midpoints per lookup cell."""
    inner = torch.rand(254, generator=torch.Generator().manual_seed(0)) * 2e-3 - 1e-3
    return torch.cat([torch.tensor([-1.0]), inner.sort().values, torch.tensor([1.0])])


@pytest.mark.parametrize(
    "bits,kind", [(8, "power"), (4, "power"), (8, "spaced"), (8, "crowded")]
)
def test_nearest_code_exact_at_midpoints(backend, bits, kind):
    """With beta1 = 0, m = g and absmax = 1, so codes = nearest(g) exactly: values on
    midpoints (ties go to the lower code) and one ulp to either side. "crowded"
    codes put several midpoints in one lookup cell (several comparisons)."""
    books = {"power": codebook, "spaced": spaced_codebook}
    cb = crowded_codebook() if kind == "crowded" else books[kind](bits)
    steps = _quant_table.build_table(cb).steps
    assert steps > 1 if kind == "crowded" else steps <= 1
    mids = ((cb[:-1].double() + cb[1:].double()) / 2).float()
    up, down = torch.tensor(np.inf), torch.tensor(-np.inf)
    x = torch.cat(
        [mids, mids.nextafter(up), mids.nextafter(down), cb, torch.rand(500) * 2 - 1]
    )
    x = torch.cat([x, torch.tensor([1.0])])  # absmax 1: m / absmax == m
    n = x.numel()
    state = new_state(torch.empty(n), n, bits, cb)
    hyper = dict(HYPER, beta1=0.0, weight_decay=0.0)
    _fused.fused_step(torch.zeros(n), x, state, **hyper)
    exact = exact_nearest(x, cb)
    assert torch.equal(codes_of(state, n).long(), exact)
    assert torch.equal(NearestCode(cb)(x).long(), exact)  # the reference's quantizer


def test_backends_agree(monkeypatch):
    """C kernel and PyTorch fallback: same codes, absmax and v; params to an ulp."""
    if _native.load() is None:
        pytest.skip(f"native kernel unavailable: {_native.status()}")
    for bits, n, period in [
        (8, 5003, 61),
        (4, 5003, 61),
        (4, 4000, 1),
        (None, 5003, 61),
    ]:
        state = random_state(n, period, bits, seed=3)
        param, grad = torch.randn(n), torch.randn(n)
        h = StepOptions(**HYPER).scalars(4.0)
        c_state, t_state = copy_state(state), copy_state(state)
        p_c, p_t = param.clone(), param.clone()
        _fused.c_step(p_c, grad, c_state, h)
        _torch_step.torch_step(p_t, grad, t_state, h)
        for key in state:
            if key != "exp_avg_sq" and key != "exp_avg":
                assert torch.equal(c_state[key], t_state[key]), key
        torch.testing.assert_close(
            c_state["exp_avg_sq"], t_state["exp_avg_sq"], rtol=2e-7, atol=0
        )
        assert ulps(p_c, p_t, torch.maximum(p_t.abs(), (p_t - param).abs())) <= 2


@pytest.mark.parametrize("bits", [8, 4, None])
def test_long_blocks_and_threads_are_bitwise_identical(bits):
    """Blocks longer than the C buffer (recomputed m), several threads, odd periods
    with 4-bit codes (pairs of blocks per thread): all give the same bits."""
    if _native.load() is None:
        pytest.skip(f"native kernel unavailable: {_native.status()}")
    cases = [(30001, 333, None), (20001, 7, 1.0), (9999, 9999, None), (9999, 9999, 1.0)]
    for n, period, update_clip in cases:
        h = StepOptions(**HYPER, update_clip=update_clip).scalars(4.0)
        state = random_state(n, period, bits, seed=period)
        param, grad = torch.randn(n), torch.randn(n)
        results = []
        for chunk, threads in [(None, 1), (16, 1), (None, 2), (17, 2)]:
            s, p = copy_state(state), param.clone()
            _fused.c_step(p, grad, s, h, chunk=chunk, threads=threads)
            results.append((p, s))
        for p, s in results[1:]:
            assert torch.equal(p, results[0][0])
            for key in state:
                assert torch.equal(s[key], results[0][1][key]), key


def test_torch_long_blocks_match_whole_blocks(monkeypatch):
    """The fallback's two-pass path for blocks longer than a chunk."""
    n, period = 3001, 1000
    for bits, update_clip in [(8, None), (4, 1.0), (None, None), (None, 1.0)]:
        h = StepOptions(**HYPER, update_clip=update_clip).scalars(4.0)
        state = random_state(n, period, bits, seed=11)
        param, grad = torch.randn(n), torch.randn(n)
        s1, s2 = copy_state(state), copy_state(state)
        p1, p2 = param.clone(), param.clone()
        _torch_step.torch_step(p1, grad, s1, h)
        monkeypatch.setattr(_torch_step, "TORCH_CHUNK", 64)
        _torch_step.torch_step(p2, grad, s2, h)
        monkeypatch.undo()
        for key in state:
            torch.testing.assert_close(s1[key], s2[key], rtol=2e-7, atol=0)
        assert ulps(p1, p2, torch.maximum(p1.abs(), (p1 - param).abs())) <= 2


def test_low_precision_and_strided_params_match_the_reference(backend):
    """bf16 and fp16 parameters rounded to nearest, and strided views (the
    fallback): the reference's result."""
    n, period = 1200, 40
    for param in [
        torch.randn(n).bfloat16(),
        torch.randn(n).half(),
        torch.randn(2 * n).view(n, 2)[:, 0],
    ]:
        state = random_state(n, period, 8, seed=5)
        grad = torch.randn(n, dtype=param.dtype).view(param.shape)
        mine, ref = copy_state(state), copy_state(state)
        p_mine, p_ref = param.clone(), param.clone()
        hyper = dict(HYPER, update_clip=1.0)  # binds on some elements
        _fused.fused_step(p_mine, grad, mine, **hyper, stochastic_rounding=False)
        reference_step(p_ref, grad, ref, **hyper)
        assert torch.equal(codes_of(mine, n), codes_of(ref, n))
        torch.testing.assert_close(p_mine.float(), p_ref.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("update_clip", [None, 1.0])
@pytest.mark.parametrize("bits", [8, 4, None])
def test_cuda_compiled_step_matches_reference(bits, update_clip):
    """On CUDA fused_step runs the Triton step (``_triton_step``; the compiled
    chunk function where triton is absent): the reference's result."""
    n, period = 50_001, 97
    state = random_state(n, period, bits, seed=2)
    param, grad = torch.randn(n), torch.randn(n)
    cuda_state = {k: v.cuda() for k, v in state.items()}
    p_cuda = param.cuda()
    hyper = dict(HYPER, update_clip=update_clip)
    _fused.fused_step(p_cuda, grad.cuda(), cuda_state, **hyper)
    ref = copy_state(state)
    reference_step(param, grad, ref, **hyper)
    if bits:
        diff = codes_of(cuda_state, n).cpu().int() - codes_of(ref, n).int()
        assert int(diff.abs().max()) <= 1 and int((diff != 0).sum()) <= 5
    torch.testing.assert_close(
        cuda_state["exp_avg_sq"].cpu(), ref["exp_avg_sq"], rtol=1e-5, atol=0
    )
    torch.testing.assert_close(p_cuda.cpu(), param, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("bits,stochastic", [(8, False), (8, True), (4, True)])
def test_cuda_factored_step_matches_reference(bits, stochastic):
    """The 4-bit default on CUDA: a factored second moment and stochastic codes
    (searched for 8-bit codes) through the Triton step; the reference's result."""
    from leantrain.optim.codebook import with_exact_zero
    from leantrain.optim.factored import factor_shape

    torch.manual_seed(3)
    shape = (313, 160)
    cb = with_exact_zero(codebook(bits))
    param = torch.randn(shape)
    state = new_state(param, 160, bits, cb, factor_shape(shape))
    rounding = {"stochastic_codes": stochastic, "seed": 5}
    cuda_state = {k: v.cuda() for k, v in state.items()}
    p_cuda = param.cuda()
    ref = copy_state(state)
    for _ in range(3):
        grad = torch.randn(shape)
        _fused.fused_step(p_cuda, grad.cuda(), cuda_state, **HYPER, **rounding)
        reference_step(param, grad, ref, **HYPER, **rounding)
    n = param.numel()
    diff = codes_of(cuda_state, n).cpu().int() - codes_of(ref, n).int()
    assert int(diff.abs().max()) <= 1 and int((diff != 0).sum()) <= 10
    torch.testing.assert_close(
        cuda_state["exp_avg_sq"].cpu(), ref["exp_avg_sq"], rtol=1e-5, atol=0
    )
    torch.testing.assert_close(p_cuda.cpu(), param, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bits", [8, 4, None])
def test_gefen_trains_the_same_with_the_fused_step(backend, bits):
    """Along a real Gefen run (the states gefen.py builds: learned codebook,
    automatic periods, p = 1 biases), every step of step_many (the C kernel's one
    call for all parameters, or fused_step each) equals reference_step from the
    same state: codes equal but for a tie or two per tensor, parameters and v to
    fp32 rounding. (Whole trajectories may part: a code flipped at a tie moves the
    stored momentum by one code for the steps after, as any rounding would.)"""
    from leantrain.optim import Gefen

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(24, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3)
    )
    opt = Gefen(model.parameters(), lr=1e-2, weight_decay=0.01, momentum_bits=bits)
    x, y = torch.randn(128, 24), torch.randn(128, 3)
    losses = []
    for step in range(15):
        opt.zero_grad()
        loss = (model(x) - y).square().mean()
        loss.backward()
        losses.append(float(loss.detach()))
        refs = []
        if step > 0:  # the first step builds the state
            for seed, p in enumerate(model.parameters()):
                st = copy_state(opt.state[p])
                q = p.detach().clone()
                reference_step(
                    q,
                    p.grad,
                    st,
                    lr=1e-2,
                    beta1=0.9,
                    beta2=0.999,
                    eps=1e-8,
                    weight_decay=0.01,
                    maximize=False,
                    # momentum_rounding="auto": 4-bit codes stochastically, and
                    # 8-bit ones on a factored or per-element v, each parameter on
                    # the stream of its index in the optimizer
                    stochastic_codes=bits == 4
                    or (bits == 8 and ("factored" in st or int(st["period"]) == 1)),
                    seed=seed,
                    # update_clip="auto": 4-bit steps on a factored or
                    # per-element v clipped to lr per element
                    update_clip=(
                        1.0
                        if bits == 4 and ("factored" in st or int(st["period"]) == 1)
                        else None
                    ),
                )
                refs.append((q, st))
        opt.step()
        for p, (q, st) in zip(model.parameters() if refs else [], refs, strict=True):
            mine = opt.state[p]
            n = p.numel()
            flipped = 0
            if bits is None:
                torch.testing.assert_close(mine["exp_avg"], st["exp_avg"])
            else:
                flipped = int((codes_of(mine, n) != codes_of(st, n)).sum())
            assert flipped <= 2, (step, tuple(p.shape), flipped)
            torch.testing.assert_close(
                mine["exp_avg_sq"], st["exp_avg_sq"], rtol=1e-6, atol=0
            )
            if not flipped:
                torch.testing.assert_close(p.detach(), q, rtol=1e-6, atol=1e-7)
    assert losses[-1] < 0.9 * losses[0]  # it trains


def unpack(state: dict, n: int, shape) -> dict:
    """The same 4-bit state with one code per byte, shaped like the parameter."""
    out = copy_state(state)
    out["exp_avg_codes"] = codes_of(state, n).to(torch.uint8).view(shape).clone()
    return out


@pytest.mark.parametrize("shape,period", [((37, 31), 31), ((64, 10), 1), ((7,), 7)])
def test_unpacked_and_shaped_codes_give_the_same_step(backend, shape, period):
    """4-bit codes stored one per byte (odd last dim, 1-D) or packed along an even
    last dim, 8-bit codes in the parameter's shape: the flat order is the same, so
    the step is the same as with flat packed codes."""
    n = math.prod(shape)
    for bits in (4, 8):
        state = random_state(n, period, bits, seed=n)
        param, grad = torch.randn(shape), torch.randn(shape)
        variants = {"flat": copy_state(state)}
        if bits == 4:
            variants["unpacked"] = unpack(state, n, shape)
            if shape[-1] % 2 == 0:
                packed = copy_state(state)
                rows = (*shape[:-1], shape[-1] // 2)
                packed["exp_avg_codes"] = packed["exp_avg_codes"].view(rows).clone()
                variants["packed, shaped"] = packed
        else:
            shaped = copy_state(state)
            shaped["exp_avg_codes"] = shaped["exp_avg_codes"].view(shape).clone()
            variants["shaped"] = shaped
        results = {}
        for name, st in variants.items():
            p = param.clone()
            _fused.fused_step(p, grad, st, **HYPER)
            results[name] = (p, codes_of_any(st, n))
        p0, c0 = results["flat"]
        for name, (p, c) in results.items():
            assert torch.equal(p, p0), name
            assert torch.equal(c, c0), name
        if bits == 4:  # unpacked storage keeps one code per byte, high nibble 0
            raw = variants["unpacked"]["exp_avg_codes"]
            assert raw.shape == shape and int(raw.max()) < 16


def codes_of_any(state: dict, n: int) -> torch.Tensor:
    raw = state["exp_avg_codes"].reshape(-1)
    if state["codebook"].numel() == 256 or raw.numel() == n:
        return raw.clone()
    return torch.stack([raw & 15, raw >> 4], dim=1).reshape(-1)[:n]


def test_codes_of_the_wrong_size_are_rejected():
    n = 10
    state = random_state(n, 5, 4, seed=0)
    state["exp_avg_codes"] = torch.zeros(7, dtype=torch.uint8)
    with pytest.raises(ValueError, match="needs 5 or 10"):
        _fused.fused_step(torch.randn(n), torch.randn(n), state, **HYPER)
