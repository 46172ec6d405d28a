"""The factored second moment inside the one kernel call, and the cached step plan.

The kernel's first phase (``_kernels/gefen_prepass.h``) sums g^2 by rows and
columns, checks every gradient for NaN and infinities and advances the steps; the
step plan (``_fused_plan``) hands a steady step to it in one call. Checked here:
the plan's steps equal the full path's bit for bit (through option, gradient and
state changes), the kernel's factors equal the PyTorch path's and do not depend on
the thread count, Gefen with factored 8-bit and 4-bit momentum matches the
reference step, and a non-finite gradient changes nothing on the plan path.
"""

from __future__ import annotations

import copy

import pytest
import torch

from leantrain.optim import Gefen, _cabi, _checks, _fused, _native, factored
from leantrain.optim._options import StepOptions, stochastic_codes_of, update_clip_of
from leantrain.optim._step import reference_step
from tests._helpers.fused_states import HYPER, codes_of, copy_state, ulps

pytestmark = pytest.mark.skipif(
    _native.load() is None, reason=f"native kernel unavailable: {_native.status()}"
)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Embedding(50, 24),
        torch.nn.Linear(24, 40),
        torch.nn.LayerNorm(40),
        torch.nn.Linear(40, 7),
    )


def _set_grads(model: torch.nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(model.parameters()):
        scale = torch.rand(p.shape[0], *([1] * (p.dim() - 1)), generator=g) + 0.1
        p.grad = torch.randn(p.shape, generator=g) * scale * (1 + i)


def _assert_same(a: Gefen, b: Gefen, model_a, model_b) -> None:
    for pa, pb in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(pa, pb)
        sa, sb = a.state[pa], b.state[pb]
        assert sa.keys() == sb.keys()
        for key in sa:
            assert torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize(
    "bits,second_moment",
    [(8, "factored"), (4, "auto"), (8, "auto"), (None, "factored")],
)
def test_plan_steps_equal_the_full_path_bit_for_bit(bits, second_moment):
    model_a, model_b = _model(), _model()
    options = dict(lr=1e-2, momentum_bits=bits, second_moment=second_moment)
    plan, full = (
        Gefen(model_a.parameters(), **options),
        Gefen(model_b.parameters(), **options),
    )
    for step in range(8):
        _set_grads(model_a, step)
        _set_grads(model_b, step)
        if step == 3:  # a scheduler's new lr: the plan refreshes its scalars
            for opt in (plan, full):
                opt.param_groups[0]["lr"] = 3e-3
        if step == 5:  # a parameter without a gradient: the full path, then a new plan
            model_a[2].bias.grad = model_b[2].bias.grad = None
        full._steps.plan = None  # always the full path
        plan.step()
        full.step()
        _assert_same(plan, full, model_a, model_b)
        assert plan._steps.plan is not None
    assert float(plan.state[model_a[1].weight]["step"]) == 8


def test_the_plan_is_one_kernel_call_without_a_separate_finite_pass(monkeypatch):
    model = _model()
    opt = Gefen(model.parameters(), momentum_bits=4)
    _set_grads(model, 0)
    opt.step()
    calls = []
    real = _cabi.launch

    def counting(lib, jobs, *args, **kwargs):
        calls.append(len(jobs))
        return real(lib, jobs, *args, **kwargs)

    def unexpected(*args, **kwargs):
        raise AssertionError("a pass outside the kernel call")

    monkeypatch.setattr(_cabi, "launch", counting)
    monkeypatch.setattr(_checks, "finite_flags", unexpected)
    monkeypatch.setattr(factored, "factor_means", unexpected)
    for step in range(1, 4):
        _set_grads(model, step)
        opt.step()
    assert calls == [len(list(model.parameters()))] * 3


@pytest.mark.parametrize("where", ["factored weight", "bias"])
@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_a_nonfinite_gradient_on_the_plan_changes_nothing(where, policy):
    model = _model()
    opt = Gefen(model.parameters(), momentum_bits=4, nonfinite=policy)
    for step in range(2):
        _set_grads(model, step)
        opt.step()
    assert opt._steps.plan is not None
    before = copy.deepcopy((list(model.parameters()), opt.state_dict()))
    _set_grads(model, 2)
    target = model[1].weight if where == "factored weight" else model[3].bias
    target.grad.view(-1)[target.numel() // 2] = float("inf")
    if policy == "raise":
        with pytest.raises(FloatingPointError, match="non-finite gradient"):
            opt.step()
    else:
        with pytest.warns(RuntimeWarning, match="step skipped"):
            opt.step()
        assert opt.nonfinite_steps == 1
    params, saved = before
    for p, q in zip(model.parameters(), params, strict=True):
        assert torch.equal(p, q)
    now = opt.state_dict()["state"]
    for index, state in saved["state"].items():
        for key, value in state.items():
            if torch.is_tensor(value):
                assert torch.equal(now[index][key], value), (index, key)


def test_the_plans_finite_check_sees_every_element_of_a_long_gradient():
    """The first phase reads a block-v gradient in pieces of 65,536 elements, each as
    four interleaved quarters; an infinity in any quarter, at a quarter's ends or in
    a piece's tail is found, and the step changes nothing."""
    n = 2 * 65536 + 13
    param = torch.nn.Parameter(torch.randn(n))
    opt = Gefen([param], momentum_bits=8)
    for step in range(2):
        param.grad = torch.randn(n) * (step + 1)
        opt.step()
    assert opt._steps.plan is not None
    q = 65536 // 4
    spots = [0, q - 1, q, 2 * q + 5, 3 * q + 7, 65535, 65536 + 3 * q + 1, n - 13, n - 1]
    for count, spot in enumerate(spots, start=1):
        before = param.detach().clone()
        param.grad = torch.randn(n)
        param.grad[spot] = float("inf")
        with pytest.warns(RuntimeWarning, match="step skipped"):
            opt.step()
        assert opt.nonfinite_steps == count, spot
        assert torch.equal(param.detach(), before), spot


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 21), (300, 700), (5000, 40), (2, 3, 5)])
def test_kernel_factors_equal_the_torch_path_on_any_thread_count(shape, grad_dtype):
    """The first phase's factors (every thread count) == factored.update_factors on
    the same gradient (its C pass of fixed row chunks, then the torch EMA)."""
    torch.manual_seed(sum(shape))
    param = torch.randn(shape)
    rows, cols = factored.factor_shape(shape)
    state = {
        "step": torch.tensor(2.0),
        "period": torch.tensor(param.numel()),
        "exp_avg_sq": torch.rand(rows + cols),
        "exp_avg": torch.randn(shape),
        "factored": torch.tensor(rows),
    }
    grad = (torch.randn(shape) * torch.rand(shape[0], *([1] * (len(shape) - 1)))).to(
        grad_dtype
    )
    expected = state["exp_avg_sq"].clone()
    factored.update_factors(grad, expected, rows, HYPER["beta2"])
    results = []
    for threads in (1, 2):
        s, p = copy_state(state), param.clone()
        s["step"] += 1
        h = StepOptions(**HYPER).scalars(float(s["step"]))
        _fused.c_step(p, grad, s, h, threads=threads)
        results.append((p, s["exp_avg_sq"]))
    assert torch.equal(results[0][1], expected)
    assert torch.equal(results[1][1], expected)
    assert torch.equal(results[0][0], results[1][0])


@pytest.mark.parametrize("bits", [8, 4])
def test_gefen_factored_matches_the_reference_step(bits):
    """Gefen's plan steps (factored 8-bit and 4-bit) against reference_step with the
    same arguments, each step from the reference's previous result."""
    model = _model(3)
    opt = Gefen(
        model.parameters(), lr=1e-2, momentum_bits=bits, second_moment="factored"
    )
    _set_grads(model, 0)
    opt.step()
    group = opt.param_groups[0]
    params = list(model.parameters())
    for step in range(1, 5):
        _set_grads(model, step)
        refs = []
        for seed, p in enumerate(params):
            ref_p, ref_s = p.detach().clone(), copy_state(opt.state[p])
            reference_step(
                ref_p,
                p.grad,
                ref_s,
                lr=group["lr"],
                beta1=group["betas"][0],
                beta2=group["betas"][1],
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                maximize=False,
                stochastic_codes=stochastic_codes_of(group, ref_s),
                seed=seed,
                update_clip=update_clip_of(group, ref_s),
            )
            refs.append((ref_p, ref_s))
        before = [p.detach().clone() for p in params]
        opt.step()
        assert opt._steps.plan is not None
        for p, old, (ref_p, ref_s) in zip(params, before, refs, strict=True):
            state = opt.state[p]
            assert torch.equal(state["step"], ref_s["step"])
            torch.testing.assert_close(
                state["exp_avg_sq"], ref_s["exp_avg_sq"], rtol=1e-6, atol=0
            )
            diff = codes_of(state, p.numel()).int() - codes_of(ref_s, p.numel()).int()
            assert int((diff != 0).sum()) <= 1
            scale = torch.maximum(ref_p.abs(), (ref_p - old).abs())
            assert ulps(p.detach(), ref_p, scale) <= 8
            with torch.no_grad():  # the next step from the reference's result
                p.copy_(ref_p)
                for key, value in ref_s.items():
                    if key != "codebook":
                        state[key].copy_(value)
