"""Stochastic rounding of momentum codes (leantrain/optim/code_rounding.py): the
4-bit default, and 8-bit codes with ``momentum_rounding="stochastic"``.

The rule is checked against a brute-force reading of its definition (numpy fp32,
one element at a time) and for its purpose (the stored value is unbiased); the C
kernel and the PyTorch fallback are checked against ``reference_step`` with the same
arguments, bit for bit where their momenta agree.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from leantrain.optim import Gefen, _fused, _native, _torch_step
from leantrain.optim._options import StepOptions, resolved
from leantrain.optim._step import reference_step
from leantrain.optim.code_rounding import (
    code_key,
    stochastic_codes,
    uniform,
)
from leantrain.optim.precision import random_bits, rounding_key
from tests._helpers.fused_states import (
    HYPER,
    codebook,
    codes_of,
    copy_state,
    random_state,
)


def brute_force(x: np.ndarray, cb: np.ndarray, r: np.ndarray) -> np.ndarray:
    """The rule read literally: find x's interval [u_i, u_i+1) among the distinct
    values, take the upper end iff fl(x - u_i) > fl(r * (u_i+1 - u_i)), store the
    lowest code holding the value."""
    uniq = np.unique(cb)
    out = np.empty(x.shape, dtype=np.int64)
    for e, (xe, re) in enumerate(zip(x, r, strict=True)):
        i = int(np.searchsorted(uniq, xe, side="right")) - 1
        i = min(max(i, 0), len(uniq) - 1)
        k = i
        if i + 1 < len(uniq):
            gap = np.float32(uniq[i + 1] - uniq[i])
            if np.float32(xe - uniq[i]) > np.float32(re * gap):
                k = i + 1
        out[e] = int(np.flatnonzero(cb == uniq[k])[0])
    return out


@pytest.mark.parametrize(
    "kind", ["spaced", "duplicates", "uniform", "8-bit", "8-bit duplicates"]
)
def test_matches_brute_force(kind):
    torch.manual_seed(0)
    if kind == "spaced":
        cb = codebook(4)
    elif kind == "duplicates":  # equal codes: the lowest code holding a value
        cb = torch.tensor([-1.0, -1.0, -0.5, 0.0, 0.0, 0.0, 0.25, 1.0])
    elif kind == "uniform":
        cb = torch.linspace(-1, 1, 16)
    elif kind == "8-bit":  # 255 gaps: searched, not counted
        cb = codebook(8)
    else:  # a learned 8-bit codebook can repeat values (a histogram's empty bins)
        cb = codebook(8).clone()
        cb[100:110] = cb[100]
        cb[200:203] = cb[202]
    x = torch.cat(
        [
            torch.rand(3000) * 2 - 1,
            cb,  # values equal to a code keep it
            torch.nextafter(cb, torch.tensor(2.0)).clamp(max=1),
            torch.nextafter(cb, torch.tensor(-2.0)).clamp(min=-1),
        ]
    )
    r = uniform(rounding_key(5, 1), 0, x.numel())
    r[:5] = torch.tensor([0.0, 1 - 2**-24, 0.5, 0.0, 1 - 2**-24])
    mine = stochastic_codes(x, cb, r).long().numpy()
    expected = brute_force(x.numpy(), cb.numpy(), r.numpy())
    np.testing.assert_array_equal(mine, expected)


def test_codes_stay_exact_and_only_neighbours_are_chosen():
    cb = codebook(4)
    r = uniform(7, 0, 16)
    assert torch.equal(stochastic_codes(cb, cb, r).long(), torch.arange(16))
    x = torch.rand(5000) * 2 - 1
    codes = stochastic_codes(x, cb, uniform(9, 0, 5000)).long()
    below = torch.searchsorted(cb, x, right=True) - 1
    assert bool(((codes == below) | (codes == below + 1)).all())


@pytest.mark.parametrize("bits", [4, 8])
def test_stored_value_is_unbiased(bits):
    """E[codebook[code(x)]] = x: mean of 200k draws within 5 standard errors, where
    nearest rounding is off by the distance to the nearest code."""
    cb = codebook(bits)
    n = 200_000
    for x0 in [0.013, -0.31, 0.5, 0.97]:
        x = torch.full((n,), x0)
        values = cb[stochastic_codes(x, cb, uniform(code_key(1, 3), 0, n)).long()]
        lo = float(cb[cb <= x0].max())
        hi = float(cb[cb > x0].min())
        p = (x0 - lo) / (hi - lo)
        stderr = (hi - lo) * (p * (1 - p) / n) ** 0.5
        assert abs(float(values.double().mean()) - x0) < 5 * stderr + 1e-7


def test_uniform_bits_and_keys():
    key = code_key(3, 10)
    r = uniform(key, 100, 1000)
    assert r.dtype == torch.float32 and float(r.min()) >= 0 and float(r.max()) < 1
    expected = (random_bits(key, 100, 1000) >> 8).double() / 2**24
    assert torch.equal(r.double(), expected)
    # its own stream: not the parameter rounding's key, and new every step and seed
    keys = {code_key(s, t) for s in range(4) for t in range(1, 5)}
    assert len(keys) == 16 and rounding_key(3, 10) not in keys


def test_resolved_and_bad_values():
    assert resolved("auto", 4) and not resolved("auto", 8)
    assert not resolved("auto", None) and not resolved("nearest", 4)
    assert resolved("stochastic", 4) and resolved("stochastic", 8)
    assert not resolved("nearest", 8) and not resolved("stochastic", None)
    with pytest.raises(ValueError, match="'up'"):
        resolved("up", 4)


SR_SHAPES = [(1, 1), (1001, 7), (999, 1), (4096, 64), (3001, 3001), (20000, 100)]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,period", SR_SHAPES)
def test_fused_step_matches_reference(backend, n, period, bits):
    """Both paths store the reference's codes (up to an ulp of m near a
    threshold), and those codes differ from the nearest ones: the rounding runs."""
    torch.manual_seed(n)
    param, grad = torch.randn(n), torch.randn(n)
    state = random_state(n, period, bits, seed=n)
    mine, ref, near = copy_state(state), copy_state(state), copy_state(state)
    p_mine, p_ref = param.clone(), param.clone()
    kw = dict(HYPER, stochastic_codes=True, seed=11)
    _fused.fused_step(p_mine, grad, mine, **kw)
    reference_step(p_ref, grad, ref, **kw)
    reference_step(param.clone(), grad, near, **HYPER)
    diff = codes_of(mine, n).int() - codes_of(ref, n).int()
    assert int(diff.abs().max()) <= 1 and int((diff != 0).sum()) <= max(1, n // 2000)
    assert torch.equal(mine["exp_avg_absmax"], ref["exp_avg_absmax"])
    torch.testing.assert_close(p_mine, p_ref, rtol=1e-6, atol=1e-7)
    if n > 100:
        changed = codes_of(ref, n) != codes_of(near, n)
        assert 0.1 < float(changed.float().mean()) < 0.9


@pytest.mark.parametrize("bits", [4, 8])
def test_backends_agree_bit_for_bit(bits):
    """C kernel and fallback: identical codes, the kernel's AVX paths included
    (odd starts, packed and one code per byte), with a shard's index0."""
    if _native.load() is None:
        pytest.skip(f"native kernel unavailable: {_native.status()}")
    h = StepOptions(**HYPER).scalars(4.0)
    key = code_key(2, 4)
    for n, period, index0 in [
        (5003, 61, 0),
        (4000, 1, 0),
        (777, 777, 12345),
        (3001, 13, 2**33 + 5),
    ]:
        state = random_state(n, period, bits, seed=3)
        param, grad = torch.randn(n), torch.randn(n)
        c_state, t_state = copy_state(state), copy_state(state)
        _fused.c_step(param.clone(), grad, c_state, h, code_key=key, index0=index0)
        _torch_step.torch_step(
            param.clone(), grad, t_state, h, code_key=key, index0=index0
        )
        assert torch.equal(c_state["exp_avg_codes"], t_state["exp_avg_codes"])
        assert torch.equal(c_state["exp_avg_absmax"], t_state["exp_avg_absmax"])


def test_eight_bit_learned_codebook_takes_the_fused_pass_with_the_same_bits():
    """A learned codebook (every code its own value, at most one midpoint per cell)
    sends 8-bit codes through the kernel's fused lookup-and-update pass, which
    applies the stochastic rule in-register: the fallback's codes and parameter."""
    if _native.load() is None:
        pytest.skip(f"native kernel unavailable: {_native.status()}")
    from leantrain.optim._quant_table import quant_table
    from leantrain.optim.codebook import histogram, learn_codebook, with_exact_zero

    n, period = 20_011, 257
    g0 = torch.randn(n) * torch.rand(n).pow(3)
    cb = with_exact_zero(learn_codebook(histogram(g0, period), 256)).float()
    assert quant_table(cb).steps <= 1 and cb.unique().numel() == 256
    state = random_state(n, period, 8, seed=6)
    state["codebook"] = cb
    h = StepOptions(**HYPER).scalars(4.0)
    for index0 in (0, 2**33 + 7):
        key = code_key(6, 4)
        param, grad = torch.randn(n), torch.randn(n)
        c_state, t_state = copy_state(state), copy_state(state)
        p_c, p_t = param.clone(), param.clone()
        _fused.c_step(p_c, grad, c_state, h, code_key=key, index0=index0)
        _torch_step.torch_step(p_t, grad, t_state, h, code_key=key, index0=index0)
        assert torch.equal(c_state["exp_avg_codes"], t_state["exp_avg_codes"])
        near = copy_state(state)
        _fused.c_step(param.clone(), grad, near, h, index0=index0)
        changed = c_state["exp_avg_codes"] != near["exp_avg_codes"]
        assert 0.05 < float(changed.float().mean()) < 0.95  # the rounding ran
        torch.testing.assert_close(p_c, p_t, rtol=1e-6, atol=1e-7)


def test_eight_bit_codebook_with_repeated_values_gives_the_same_bits():
    """A codebook whose codes repeat values (as a learned one can): the kernel maps
    codes to values and back through tables; the fallback counts distinct values."""
    if _native.load() is None:
        pytest.skip(f"native kernel unavailable: {_native.status()}")
    n, period = 6001, 97
    state = random_state(n, period, 8, seed=5)
    cb = state["codebook"].clone()
    cb[100:110] = cb[100]
    cb[200:203] = cb[202]
    state["codebook"] = cb
    h = StepOptions(**HYPER).scalars(4.0)
    key = code_key(4, 4)
    param, grad = torch.randn(n), torch.randn(n)
    c_state, t_state = copy_state(state), copy_state(state)
    _fused.c_step(param.clone(), grad, c_state, h, code_key=key)
    _torch_step.torch_step(param.clone(), grad, t_state, h, code_key=key)
    assert torch.equal(c_state["exp_avg_codes"], t_state["exp_avg_codes"])
    stored = set(c_state["exp_avg_codes"].tolist())
    assert {100, 200} <= stored  # the repeated values are stored, by their lowest
    assert not stored & (set(range(101, 110)) | {201, 202})  # code only


@pytest.mark.parametrize("bits", [4, 8])
def test_threads_chunks_and_long_blocks_give_the_same_bits(monkeypatch, bits):
    if _native.load() is None:
        pytest.skip(f"native kernel unavailable: {_native.status()}")
    h = StepOptions(**HYPER).scalars(4.0)
    key = code_key(0, 4)
    for n, period in [(30001, 333), (20001, 7), (9999, 9999)]:
        state = random_state(n, period, bits, seed=period)
        param, grad = torch.randn(n), torch.randn(n)
        results = []
        for chunk, threads in [(None, 1), (16, 1), (None, 2), (17, 2)]:
            s = copy_state(state)
            _fused.c_step(
                param.clone(), grad, s, h, chunk=chunk, threads=threads, code_key=key
            )
            results.append(s["exp_avg_codes"])
        # the fallback's two-pass path for blocks longer than its chunk
        monkeypatch.setattr(_torch_step, "TORCH_CHUNK", 64)
        s = copy_state(state)
        _torch_step.torch_step(param.clone(), grad, s, h, code_key=key)
        monkeypatch.undo()
        results.append(s["exp_avg_codes"])
        for codes in results[1:]:
            assert torch.equal(codes, results[0])


@pytest.mark.parametrize("bits", [4, 8])
def test_a_shard_draws_the_bits_of_its_global_elements(backend, bits):
    """A shard stepped with index0 = its offset stores the codes the whole tensor
    stores there (blocks aligned with the shard)."""
    n, period, cut = 4096, 64, 1024
    per_byte = 2 if bits == 4 else 1
    state = random_state(n, period, bits, seed=1)
    param, grad = torch.randn(n), torch.randn(n)
    whole = copy_state(state)
    _fused.fused_step(param.clone(), grad, whole, **HYPER, stochastic_codes=True)
    shard = {
        "step": state["step"].clone(),
        "period": state["period"],
        "qblock": state["qblock"],
        "codebook": state["codebook"],
        "exp_avg_sq": state["exp_avg_sq"][cut // period :].clone(),
        "exp_avg_absmax": state["exp_avg_absmax"][cut // period :].clone(),
        "exp_avg_codes": state["exp_avg_codes"][cut // per_byte :].clone(),
    }
    _fused.fused_step(
        param[cut:].clone(),
        grad[cut:],
        shard,
        **HYPER,
        stochastic_codes=True,
        index0=cut,
    )
    assert torch.equal(
        shard["exp_avg_codes"], whole["exp_avg_codes"][cut // per_byte :]
    )


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_eight_bit_momentum_of_a_stopped_gradient_decays_to_zero_only_if_unbiased(
    rounding,
):
    """The dead band of nearest 8-bit codes (docs/gefen.md): with a zero gradient,
    0.9 c rounds back to c for the codes near 0, so small momenta never decay and
    their weights keep moving. Stochastic codes decay them to exactly 0."""
    p = torch.nn.Parameter(torch.zeros(256))
    opt = Gefen(
        [p], lr=1e-3, partition=256, weight_decay=0.0, momentum_rounding=rounding
    )
    first = torch.randn(256, generator=torch.Generator().manual_seed(0)) * 0.01
    first[0] = 1.0
    for t in range(200):
        p.grad = first.clone() if t == 0 else torch.zeros(256)
        p.grad[0] = 1.0  # keeps the block's absmax, so the others' codes are small
        before = p.detach().clone()
        opt.step()
    moving = int(((p.detach() - before)[1:] != 0).sum())
    if rounding == "nearest":
        assert moving > 100
    else:
        assert moving == 0


@pytest.mark.parametrize("name", ["Gefen", "GefenMuon"])
def test_option_is_validated(name):
    from leantrain import optim

    cls = getattr(optim, name)
    model = torch.nn.Linear(8, 4)
    for bad in ["up", 4, None]:
        with pytest.raises(ValueError, match="momentum_rounding"):
            cls(model.parameters(), momentum_bits=4, momentum_rounding=bad)
    opt = cls([model.weight], momentum_bits=4)
    with pytest.raises(ValueError, match="momentum_rounding"):
        opt.add_param_group({"params": [model.bias], "momentum_rounding": "up"})
    assert len(opt.param_groups) == 1
    opt.add_param_group(  # 8-bit codes may be stochastic too
        {"params": [model.bias], "momentum_bits": 8, "momentum_rounding": "stochastic"}
    )
    assert len(opt.param_groups) == 2


@pytest.mark.parametrize(
    "bits,rounding", [(4, "auto"), (4, "nearest"), (8, "stochastic"), (8, "auto")]
)
def test_gefen_follows_the_option(bits, rounding):
    """Gefen's codes are the reference's with stochastic_codes = (rounding, bits),
    and for 8-bit "auto" stochastic on a second moment of the weight's own (the
    default factors the 30 x 40 weight; the bias keeps blocks and nearest codes)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(40, 30)
    opt = Gefen(
        model.parameters(), lr=1e-2, momentum_bits=bits, momentum_rounding=rounding
    )
    x = torch.randn(64, 40)
    for step in range(4):
        opt.zero_grad()
        model(x).square().mean().backward()
        if step == 0:
            opt.step()
            continue
        refs = []
        for seed, p in enumerate(model.parameters()):
            st, q = copy_state(opt.state[p]), p.detach().clone()
            reference_step(
                q,
                p.grad,
                st,
                **dict(HYPER, beta2=0.999, weight_decay=0.01),
                stochastic_codes=resolved(rounding, bits)
                or (rounding == "auto" and "factored" in st),
                seed=seed,
            )
            refs.append(st)
        opt.step()
        for p, st in zip(model.parameters(), refs, strict=True):
            n = p.numel()
            diff = codes_of(opt.state[p], n) != codes_of(st, n)
            assert int(diff.sum()) <= 2


@pytest.mark.parametrize("options", [{}, {"partition": "element"}])
def test_eight_bit_auto_codes_on_a_weights_own_v_let_stopped_weights_stop(options):
    """On a second moment of the weight's own (a 256 x 256 matrix, which "auto"
    factors, or partition="element"), a weight whose gradients stopped steps by its
    momentum residue over its own sqrt(v), which keeps decaying: with nearest codes
    the residue stays and the step grows. "auto" rounds such 8-bit codes
    stochastically, so the stopped weights come to rest, as in AdamW."""

    def stopped_steps(rounding):
        p = torch.nn.Parameter(torch.zeros(256, 256))
        opt = Gefen(
            [p], lr=1e-3, weight_decay=0.0, momentum_rounding=rounding, **options
        )
        g = torch.Generator().manual_seed(0)
        steps = []
        for t in range(1500):
            grad = torch.randn(256, 256, generator=g) * 1e-3
            if t >= 50:
                grad[:, :32] = 0.0  # inputs 0-31 of every row get no more gradient
            p.grad = grad
            before = p.detach()[:, :32].clone()
            opt.step()
            steps.append(float((p.detach()[:, :32] - before).abs().max()) / 1e-3)
        return opt.state[p], steps

    state, auto = stopped_steps("auto")
    assert ("factored" in state) == (not options)
    assert (int(state["period"]) == 1) == bool(options)
    _, nearest = stopped_steps("nearest")
    assert auto[-1] == 0.0 and max(auto[1000:]) == 0.0
    assert nearest[-1] > 1.3 * nearest[600] > 0.0  # the stopped weights' steps grow
