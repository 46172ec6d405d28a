"""bf16/fp16 parameters: stochastic rounding (reference and kernels), GradScaler."""

from __future__ import annotations

import pytest
import torch

from leantrain.optim import _fused, _native
from leantrain.optim._state import new_state
from leantrain.optim._step import reference_step
from leantrain.optim.precision import (
    random_bits,
    rounding_key,
    stochastic_round,
)

LOW = [torch.bfloat16, torch.float16]
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, maximize=False)


def all_finite_values(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of a 16-bit dtype, ascending, as float64 (brute force)."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    v = bits.view(dtype).double()
    return torch.unique(v[torch.isfinite(v)])  # sorted; -0 and +0 merge


def neighbours(x: torch.Tensor, dtype: torch.dtype):
    """The representable values just toward and just away from zero of each x,
    found by searching the table of all values (independent of the bit tricks)."""
    table = all_finite_values(dtype)
    xd = x.double()
    hi = torch.searchsorted(table, xd, right=False).clamp(max=table.numel() - 1)
    exact = table[hi] == xd
    lo = (hi - 1).clamp(min=0)
    below, above = table[lo], table[hi]
    toward = torch.where(xd >= 0, below, above)
    away = torch.where(xd >= 0, above, below)
    return torch.where(exact, xd, toward), torch.where(exact, xd, away)


# --------------------------------------------------------------- the pure reference
def python_hash(i: int, key: int) -> int:
    """hash32(i, key) with Python ints (independent of the tensor implementation)."""

    def fmix(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x85EBCA6B) & 0xFFFFFFFF
        x ^= x >> 13
        x = (x * 0xC2B2AE35) & 0xFFFFFFFF
        return x ^ (x >> 16)

    m = 0xFFFFFFFF
    return fmix((i & m) ^ (key & m) ^ fmix((i >> 32) ^ ((key >> 32) & m)))


def test_random_bits_match_plain_python_and_look_uniform():
    key = rounding_key(7, 3)
    for start in (0, 2**32 - 5, 3 * 2**32 + 11):
        got = random_bits(key, start, 10).tolist()
        assert got == [python_hash(start + j, key) for j in range(10)]
    r = random_bits(key, 0, 1 << 16)
    assert 0 <= int(r.min()) and int(r.max()) < 2**32
    bits = (r[:, None] >> torch.arange(32)) & 1  # every bit is a fair coin
    assert float((bits.double().mean(0) - 0.5).abs().max()) < 0.01
    assert r.unique().numel() > 0.999 * r.numel()


def test_random_bits_of_neighbouring_elements_and_steps_are_uncorrelated():
    """One element's bits at consecutive steps, and neighbouring elements' bits at
    one step, are uncorrelated (|rho| < 0.02 over 65,536 pairs: sd 0.004)."""
    n = 1 << 16
    now = random_bits(rounding_key(7, 3), 0, n + 1).double()
    later = random_bits(rounding_key(7, 4), 0, n).double()
    for a, b in ((now[:n], later), (now[:n], now[1:])):
        rho = torch.corrcoef(torch.stack([a, b]))[0, 1]
        assert abs(float(rho)) < 0.02


@pytest.mark.parametrize("dtype", LOW)
def test_only_the_two_neighbours_are_produced(dtype):
    torch.manual_seed(0)
    scale = 2.0 ** torch.randint(-30, 15, (20000,)).float()
    x = torch.randn(20000) * scale
    x[:100] = x[:100].to(dtype).float()  # representable: kept exactly
    toward, away = neighbours(x, dtype)
    y = stochastic_round(x, dtype, rounding_key(1, 1)).double()
    assert torch.all((y == toward) | (y == away))
    assert torch.equal(y[:100], x[:100].double())
    # both neighbours occur where x is not representable
    inexact = toward != away
    assert bool((y[inexact] == away[inexact]).any())
    assert bool((y[inexact] == toward[inexact]).any())


@pytest.mark.parametrize("dtype", LOW)
def test_unbiased(dtype):
    """The mean of many roundings of one value is the value (within 5 sigma), for
    several positions between the neighbours, signs and magnitudes (subnormal too)."""
    n = 40000
    smallest = 2.0**-133 if dtype == torch.bfloat16 else 2.0**-24
    for base in (1.0, -3.0, 1e-3, 40 * smallest):
        toward, away = neighbours(torch.tensor([base]), dtype)
        if toward == away:
            away = neighbours(torch.tensor([float(base) * 1.0001]), dtype)[1]
        lo, hi = float(toward), float(away)
        for f in (0.1, 0.5, 0.77):
            value = torch.tensor(lo + f * (hi - lo), dtype=torch.float32)
            p = (float(value) - lo) / (hi - lo)
            x = value.expand(n).contiguous()
            y = stochastic_round(x, dtype, rounding_key(11, int(f * 100))).double()
            freq = float((y == hi).double().mean())
            sigma = (p * (1 - p) / n) ** 0.5
            assert abs(freq - p) < 5 * sigma + 1e-12, (base, f)


@pytest.mark.parametrize("dtype", LOW)
def test_deterministic_per_seed_and_independent_of_chunking(dtype):
    x = torch.randn(5000) * 1e-2
    key = rounding_key(3, 9)
    a = stochastic_round(x, dtype, key)
    assert torch.equal(
        a.view(torch.int16), stochastic_round(x, dtype, key).view(torch.int16)
    )
    pieces = [
        stochastic_round(x[s : s + 700], dtype, key, offset=s)
        for s in range(0, 5000, 700)
    ]
    assert torch.equal(torch.cat(pieces).view(torch.int16), a.view(torch.int16))
    b = stochastic_round(x, dtype, rounding_key(3, 10))
    assert not torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("dtype", LOW)
def test_specials_and_saturation(dtype):
    big = torch.finfo(dtype).max
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0])
    x = (
        torch.cat([x, torch.tensor([big * 1.001, -big * 1.001])])
        if dtype == torch.float16
        else x
    )
    y = stochastic_round(x.float(), dtype, 5)
    assert torch.isnan(y[0]) and y[1] == float("inf") and y[2] == -float("inf")
    assert torch.equal(y[3:5].float(), x[3:5])
    if dtype == torch.float16:  # past the largest finite value: saturates
        assert y[5] == big and y[6] == -big
    with pytest.raises(TypeError, match="fp32"):
        stochastic_round(x.double(), dtype, 0)
    with pytest.raises(TypeError, match="bfloat16 or torch.float16"):
        stochastic_round(x.float(), torch.float32, 0)
    with pytest.raises(TypeError, match="seed"):
        rounding_key(1.5, 1)


# ------------------------------------------------------------------- in the step
@pytest.fixture(params=["c", "torch"])
def backend(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setenv("LEANTRAIN_NO_NATIVE", "1")
    elif _native.load() is None:
        pytest.skip(f"native kernel unavailable: {_native.status()}")
    return request.param


def codebook(bits: int) -> torch.Tensor:
    t = torch.linspace(-1, 1, 2**bits, dtype=torch.float64)
    return (t.sign() * t.abs() ** 1.7).float()


def fresh(n: int, period: int, bits: int | None) -> dict:
    return new_state(torch.empty(n), period, bits, codebook(bits) if bits else None)


def copy_state(state: dict) -> dict:
    return {k: (v if k == "codebook" else v.clone()) for k, v in state.items()}


@pytest.mark.parametrize("bits", [8, 4, None])
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("grad_dtype", ["same", torch.float32])
def test_stochastic_step_is_the_reference_then_stochastic_round(
    backend, bits, dtype, grad_dtype
):
    """fused_step(bf16/fp16 param, stochastic) == stochastic_round(reference step of
    the same parameter in fp32), element for element."""
    n, period, seed = 6001, 97, 12345
    torch.manual_seed(bits or 0)
    param = (torch.randn(n) * 0.1).to(dtype)
    grad = torch.randn(n).to(dtype if grad_dtype == "same" else grad_dtype)
    state = fresh(n, period, bits)
    for _ in range(3):
        mine, ref = copy_state(state), copy_state(state)
        p_mine, p_ref = param.clone(), param.float()
        _fused.fused_step(
            p_mine, grad, mine, **HYPER, stochastic_rounding=True, seed=seed
        )
        reference_step(p_ref, grad, ref, **HYPER)
        expected = stochastic_round(p_ref, dtype, rounding_key(seed, int(ref["step"])))
        # The fp32 results may differ by an ulp (sqrt, sums), which moves the rounding
        # threshold by ~2**-16 of a bf16 ulp: a rare flip at most.
        same = p_mine.view(torch.int16) == expected.view(torch.int16)
        assert int((~same).sum()) <= 2
        param, state = p_mine, mine
    # Rounding to nearest instead differs in about half the elements.
    nearest = p_ref.to(dtype)
    assert float((nearest != expected).double().mean()) > 0.2


@pytest.mark.parametrize("bits", [8, 4])
def test_c_and_torch_round_the_same_bits(monkeypatch, bits):
    if _native.load() is None:
        pytest.skip(f"native kernel unavailable: {_native.status()}")
    n, period = 20001, 333
    param, grad = torch.randn(n).bfloat16(), torch.randn(n).bfloat16()
    state = fresh(n, period, bits)
    results = []
    for native in ("0", "1"):
        monkeypatch.setenv("LEANTRAIN_NO_NATIVE", native)
        p, s = param.clone(), copy_state(state)
        for _ in range(2):
            _fused.fused_step(p, grad, s, **HYPER, seed=5)  # bf16: stochastic
        results.append((p, s))
    (p_c, s_c), (p_t, s_t) = results
    assert int((p_c.view(torch.int16) != p_t.view(torch.int16)).sum()) <= 2
    assert torch.equal(s_c["exp_avg_codes"], s_t["exp_avg_codes"])


def test_stochastic_rounding_keeps_small_updates(backend):
    """lr far below a bf16 ulp: rounding to nearest never moves the weights, the
    stochastic one follows the fp32 trajectory on average."""
    n = 20000
    start = torch.ones(n)
    grad = torch.full((n,), 1.0)
    hyper = dict(HYPER, lr=1e-4, weight_decay=0.0)
    runs = {}
    for sr in (False, True):
        p, s = start.bfloat16(), fresh(n, 100, 8)
        for _ in range(20):
            _fused.fused_step(p, grad, s, **hyper, stochastic_rounding=sr, seed=1)
        runs[sr] = p.float()
    p32, s32 = start.clone(), fresh(n, 100, 8)
    for _ in range(20):
        _fused.fused_step(p32, grad, s32, **hyper)
    moved = float((1 - p32).mean())  # ~20 * 1e-4
    assert torch.equal(runs[False], start)  # every update lost
    assert float((1 - runs[True]).mean()) == pytest.approx(moved, rel=0.05)


def test_resume_is_bit_exact(backend):
    """The random bits depend on (seed, step, index) only: a run restarted from a
    copy of its state and parameter continues exactly as the uninterrupted one."""
    n = 3000
    torch.manual_seed(0)
    grads = [torch.randn(n).bfloat16() for _ in range(6)]
    p, s = torch.randn(n).bfloat16(), fresh(n, 50, 8)
    for g in grads[:3]:
        _fused.fused_step(p, g, s, **HYPER, seed=9)
    p2, s2 = p.clone(), copy_state(s)  # the "checkpoint"
    for g in grads[3:]:
        _fused.fused_step(p, g, s, **HYPER, seed=9)
        _fused.fused_step(p2, g, s2, **HYPER, seed=9)
    assert torch.equal(p.view(torch.int16), p2.view(torch.int16))
    p3, s3 = p.clone(), copy_state(s)
    _fused.fused_step(p3, grads[0], s3, **HYPER, seed=10)  # another seed differs
    _fused.fused_step(p, grads[0], s, **HYPER, seed=9)
    assert not torch.equal(p.view(torch.int16), p3.view(torch.int16))


def test_stochastic_rounding_option_checks(backend):
    p, g = torch.randn(10), torch.randn(10)
    s = fresh(10, 5, 8)
    with pytest.raises(TypeError, match="stochastic_rounding"):
        _fused.fused_step(p, g, s, **HYPER, stochastic_rounding="yes")
    with pytest.raises(TypeError, match="seed"):
        _fused.fused_step(p, g, s, **HYPER, seed=1.5)
    assert float(s["step"]) == 0  # nothing changed
    # fp32 parameters: the option changes nothing
    a, b = p.clone(), p.clone()
    _fused.fused_step(a, g, fresh(10, 5, 8), **HYPER, stochastic_rounding=True)
    _fused.fused_step(b, g, fresh(10, 5, 8), **HYPER, stochastic_rounding=False)
    assert torch.equal(a, b)


# ------------------------------------------------------------------- GradScaler
def test_grad_scaler_skips_inf_steps_and_leaves_state_untouched():
    """fp32 parameters, fp16 autocast on CPU, torch.amp.GradScaler: a step whose
    scaled gradients overflow is skipped (parameters and Gefen state unchanged),
    the scale backs off, and training proceeds."""
    from leantrain.optim import Gefen

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)
    )
    opt = Gefen(model.parameters(), lr=1e-2)
    # A first scale of 2**40 makes fp16 activations' gradients overflow.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, growth_interval=1000)
    x, y = torch.randn(64, 16), torch.randn(64, 4)
    skipped, losses = 0, []
    for _ in range(40):
        before = [p.detach().clone() for p in model.parameters()]
        state_before = {
            p: {k: v.clone() for k, v in opt.state[p].items()} for p in opt.state
        }
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = (model(x).float() - y).square().mean()
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if scaler.get_scale() < scale:  # the overflow was found: step skipped
            skipped += 1
            for p, q in zip(model.parameters(), before, strict=True):
                assert torch.equal(p, q)
            assert set(opt.state) == set(state_before)
            for p, st in state_before.items():
                for k, v in st.items():
                    assert torch.equal(opt.state[p][k], v), k
        else:
            losses.append(float(loss.detach()))
    assert skipped >= 1
    assert len(losses) > 10 and losses[-1] < 0.8 * losses[0]
