"""Tests of Gefen's Triton step (``_triton_step``, ``_triton_kernels``): parity with
``_step.reference_step`` and with the C kernel's random bits, launch counts, and
the dispatch from ``Gefen.step``.

How the kernels run without a GPU: Triton's interpreter (``TRITON_INTERPRET=1``)
executes the same kernels on CPU tensors. Triton decides when it is first imported
whether ``@triton.jit`` makes compiled or interpreted kernels (its own reductions,
``tl.sum`` and ``tl.max``, included), so the switch has to be on before anything in
the process imports triton: ``tests/conftest.py`` sets it on machines without CUDA,
before collection. (Setting it in this module would come too late once an earlier
test's ``torch.compile`` imported triton; a subprocess per test would pay a torch
import each.) On a CUDA machine triton compiles: the CPU cases skip, and the
``gpu``-marked tests run the same checks on CUDA at a larger size.

The interpreter runs Python, not Triton's compiler, so one test also compiles
every kernel for an H100 (sm_90) in a subprocess without the switch (no GPU
needed), and another checks that leantrain imports and steps without triton.

Comparisons, as for the C kernel (``test_fused.py``): codes equal but for ties
(a code may flip where m / absmax sits within rounding of a midpoint), parameters
and second moments to fp32 rounding, stochastic codes and stochastically rounded
bf16 weights bit for bit the C kernel's, stochastically rounded fp16 weights bit
for bit the PyTorch fallback's (the C kernel takes no fp16).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests._helpers.fused_states import (
    HYPER,
    codebook,
    codes_of,
    copy_state,
    random_state,
)

pytest.importorskip("triton")

from leantrain.optim import Gefen, _fused, _native, _triton_step  # noqa: E402
from leantrain.optim._options import StepOptions
from leantrain.optim._state import new_state  # noqa: E402
from leantrain.optim._state_layout import state_layout  # noqa: E402
from leantrain.optim._step import reference_step  # noqa: E402
from leantrain.optim.code_rounding import code_key  # noqa: E402
from leantrain.optim.codebook import with_exact_zero  # noqa: E402
from leantrain.optim.factored import factor_shape  # noqa: E402
from leantrain.optim.precision import rounding_key  # noqa: E402

CUDA = torch.cuda.is_available()
interpreter = pytest.mark.skipif(
    not _triton_step.interpreting(),
    reason="triton compiles for CUDA here: the gpu-marked tests run these cases",
)


def triton_step(
    param, grad, state, *, stochastic_codes=False, seed=0, stochastic=None, **hyper
):
    """fused_step's bookkeeping around one Triton job; returns the launch count
    (``stochastic``: round a bf16/fp16 parameter stochastically; None: bf16 only)."""
    state["step"] += 1
    step = int(state["step"])
    h = StepOptions(**hyper).scalars(float(step))
    if stochastic is None:
        stochastic = param.dtype == torch.bfloat16
    job = _triton_step.job(
        param,
        grad,
        state,
        h,
        layout=state_layout(param, state),
        stochastic=stochastic,
        key=rounding_key(seed, step) if stochastic else 0,
        code_key=code_key(seed, step) if stochastic_codes else None,
    )
    return _triton_step.launch([job])


def on(device, state: dict) -> dict:
    """A copy of ``state`` on ``device`` (the codebook is shared, as in Gefen)."""
    return {
        k: v if k == "codebook" else v.to(device, copy=True) for k, v in state.items()
    }


def assert_parity(mine: dict, ref: dict, p_mine, p_ref, n: int, ties: int) -> None:
    """Codes equal but for ``ties`` flips of one code, absmax, v and the
    parameter to fp32 rounding."""
    mine = {k: v.cpu() for k, v in mine.items()}
    torch.testing.assert_close(mine["exp_avg_sq"], ref["exp_avg_sq"], rtol=1e-6, atol=0)
    if "codebook" in ref:
        diff = codes_of(mine, n).int() - codes_of(ref, n).int()
        assert int(diff.abs().max()) <= 1 and int((diff != 0).sum()) <= ties
        torch.testing.assert_close(
            mine["exp_avg_absmax"], ref["exp_avg_absmax"], rtol=1e-6, atol=0
        )
    else:
        torch.testing.assert_close(
            mine["exp_avg"], ref["exp_avg"], rtol=1e-6, atol=1e-7
        )
    torch.testing.assert_close(
        p_mine.cpu().float(), p_ref.float(), rtol=1e-5, atol=1e-6
    )


def blocks_case(device, bits, n, period, update_clip, steps=2):
    """``steps`` steps on ``device`` against the reference, varying maximize and
    weight decay; the state is random (codes, absmax, v as after training)."""
    torch.manual_seed(n + period)
    param = torch.randn(n)
    state = random_state(n, period, bits, seed=n)
    for step in range(steps):
        hyper = dict(
            HYPER,
            maximize=step == 1,
            weight_decay=0.1 * (step == 0),
            update_clip=update_clip,
        )
        grad = torch.randn(n) * (1 + torch.arange(n) % 5)
        mine, p_mine = on(device, state), param.to(device, copy=True)
        ref, p_ref = copy_state(state), param.clone()
        launches = triton_step(p_mine, grad.to(device), mine, **hyper)
        reference_step(p_ref, grad, ref, **hyper)
        assert launches == 1
        assert_parity(mine, ref, p_mine, p_ref, n, ties=max(1, n // 1000))
        param, state = p_ref, ref


# (n, period): odd blocks (4-bit codes of two blocks share a byte: two-block
# units), per-element v (period 1, absmax blocks of 256), one block, and a block
# longer than a tile (two passes, the momentum recomputed)
SMALL = [(203, 7), (300, 1), (130, 130), (2100, 2100)]


@interpreter
@pytest.mark.parametrize("update_clip", [None, 1.0])
@pytest.mark.parametrize("bits", [8, 4, None])
@pytest.mark.parametrize("n,period", SMALL)
def test_blocks_match_reference(bits, n, period, update_clip):
    blocks_case("cpu", bits, n, period, update_clip)


def factored_case(device, bits, stochastic, shape, steps=3):
    """A factored second moment (the 8-bit and 4-bit defaults for matrices):
    reference parity, and stochastic codes bit for bit the C kernel's."""
    torch.manual_seed(3)
    cb = with_exact_zero(codebook(bits))
    param = torch.randn(shape)
    state = new_state(param, shape[1], bits, cb, factor_shape(shape))
    mine, p_mine = on(device, state), param.to(device, copy=True)
    ref, p_ref = copy_state(state), param.clone()
    c_state, p_c = copy_state(state), param.clone()
    rounding = {"stochastic_codes": stochastic, "seed": 5}
    n = param.numel()
    for _ in range(steps):
        grad = torch.randn(shape)
        launches = triton_step(p_mine, grad.to(device), mine, **HYPER, **rounding)
        assert launches == 4  # row sums, column factor, row factor, the step
        reference_step(p_ref, grad, ref, **HYPER, **rounding)
        assert_parity(mine, ref, p_mine, p_ref, n, ties=max(1, n // 1000))
        if _native.load() is not None:
            _fused.fused_step(p_c, grad, c_state, **HYPER, **rounding)
            if stochastic:  # the same counter-based bits as the C kernel
                mine_codes = codes_of({k: v.cpu() for k, v in mine.items()}, n)
                assert torch.equal(mine_codes, codes_of(c_state, n))
        # continue from the reference's state, as test_fused does
        mine, p_mine = on(device, ref), p_ref.to(device, copy=True)
        ref, p_ref = copy_state(ref), p_ref.clone()
        c_state, p_c = copy_state(ref), p_ref.clone()


@interpreter
@pytest.mark.parametrize("bits,stochastic", [(8, False), (8, True), (4, True)])
def test_factored_matches_reference(bits, stochastic):
    factored_case("cpu", bits, stochastic, (37, 24))


def stochastic_case(device, bits, n, period):
    """Stochastic codes on block-shared v: bit for bit the C kernel's and the
    reference's (code_rounding's rule, the same hash of the global index)."""
    torch.manual_seed(11)
    state = random_state(n, period, bits, seed=4)
    param, grad = torch.randn(n), torch.randn(n)
    mine, p_mine = on(device, state), param.to(device, copy=True)
    ref, p_ref = copy_state(state), param.clone()
    triton_step(p_mine, grad.to(device), mine, stochastic_codes=True, seed=9, **HYPER)
    reference_step(p_ref, grad, ref, stochastic_codes=True, seed=9, **HYPER)
    mine_codes = codes_of({k: v.cpu() for k, v in mine.items()}, n)
    assert torch.equal(mine_codes, codes_of(ref, n))
    if _native.load() is not None:
        c_state, p_c = copy_state(state), param.clone()
        _fused.fused_step(p_c, grad, c_state, stochastic_codes=True, seed=9, **HYPER)
        assert torch.equal(mine_codes, codes_of(c_state, n))


@interpreter
@pytest.mark.parametrize("bits,n,period", [(8, 600, 50), (4, 403, 13)])
def test_stochastic_codes_are_the_c_kernels(bits, n, period):
    stochastic_case("cpu", bits, n, period)


def low_precision_case(device, dtype, n, period):
    """bf16 / fp16 parameters and gradients: the math in fp32, the parameter
    written back rounded (bf16: stochastically, bit for bit the C kernel's
    rounding of the same fp32 value; fp16: to nearest)."""
    torch.manual_seed(5)
    state = random_state(n, period, 8, seed=6)
    param = torch.randn(n).to(dtype)
    grad = torch.randn(n).to(dtype)
    mine, p_mine = on(device, state), param.to(device, copy=True)
    ref, p_ref = copy_state(state), param.clone()
    triton_step(p_mine, grad.to(device), mine, seed=3, **HYPER)
    reference_step(p_ref, grad, ref, **HYPER)  # rounds the parameter to nearest
    assert p_mine.dtype == dtype
    mine_cpu = {k: v.cpu() for k, v in mine.items()}
    diff = codes_of(mine_cpu, n).int() - codes_of(ref, n).int()
    assert int((diff != 0).sum()) <= 1
    torch.testing.assert_close(
        mine_cpu["exp_avg_sq"], ref["exp_avg_sq"], rtol=1e-6, atol=0
    )
    # one rounding of the parameter's dtype apart at most (stochastic or not)
    torch.testing.assert_close(
        p_mine.cpu().float(), p_ref.float(), rtol=1e-2, atol=1e-3
    )
    if dtype == torch.bfloat16 and _native.load() is not None:
        c_state, p_c = copy_state(state), param.clone()
        _fused.fused_step(p_c, grad, c_state, seed=3, **HYPER)  # bf16: stochastic
        same = p_mine.cpu() == p_c
        assert int((~same).sum()) <= max(1, n // 1000)  # an fp32 ulp at a threshold


@interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params(dtype):
    low_precision_case("cpu", dtype, 700, 70)


def fp16_stochastic_case(device, n, period):
    """fp16 parameters rounded stochastically: bit for bit the PyTorch fallback's
    rounding (precision.stochastic_round), from subnormals to past fp16's largest
    value (saturating)."""
    torch.manual_seed(8)
    state = random_state(n, period, 8, seed=2)
    param = (torch.randn(n) * torch.logspace(-8, 5, n)).half()
    grad = torch.randn(n).half()
    mine, p_mine = on(device, state), param.to(device, copy=True)
    ref, p_ref = copy_state(state), param.clone()
    triton_step(p_mine, grad.to(device), mine, seed=4, stochastic=True, **HYPER)
    _fused.fused_step(p_ref, grad, ref, seed=4, stochastic_rounding=True, **HYPER)
    assert torch.equal(p_mine.cpu(), p_ref)


@interpreter
def test_fp16_stochastic_rounding_is_the_fallbacks():
    fp16_stochastic_case("cpu", 3000, 100)


def mixed_states(device):
    """Parameters of every kind in one list: blocks, per element, factored, 8-bit,
    4-bit, fp32 momentum."""
    torch.manual_seed(2)
    cases = []
    for bits in (8, 4, None):
        for n, period in ((97, 97), (64, 1)):
            cases.append((torch.randn(n), random_state(n, period, bits, seed=n)))
    for bits in (8, 4):
        shape = (12, 10)
        cb = with_exact_zero(codebook(bits))
        p = torch.randn(shape)
        cases.append((p, new_state(p, 10, bits, cb, factor_shape(shape))))
    return cases


def many_case(device, param_dtype=torch.float32):
    """All kinds at once: 1 launch for the step + 3 for the factored ones, each
    parameter as the reference would step it alone."""
    cases = mixed_states(device)
    jobs, refs = [], []
    for param, state in cases:
        grad = torch.randn(param.shape)
        mine, p_mine = on(device, state), param.to(device, copy=True)
        ref, p_ref = copy_state(state), param.clone()
        mine["step"] += 1
        h = StepOptions(**HYPER).scalars(float(mine["step"]))
        layout = state_layout(p_mine, mine)
        jobs.append(_triton_step.job(p_mine, grad.to(device), mine, h, layout=layout))
        reference_step(p_ref, grad, ref, **HYPER)
        refs.append((mine, ref, p_mine, p_ref))
    assert _triton_step.launch(jobs) == 4
    for mine, ref, p_mine, p_ref in refs:
        assert_parity(mine, ref, p_mine, p_ref, p_ref.numel(), ties=1)


@interpreter
def test_many_parameters_in_four_launches():
    many_case("cpu")


@interpreter
def test_gefen_steps_through_triton(monkeypatch):
    """Gefen.step sends the tensors _triton_step.serves to the kernels (here the CPU
    ones, through the interpreter): the same training as the C kernel's or the
    fallback's, parameters to fp32 rounding over a few steps (8-bit defaults:
    factored matrices, block-shared 1-D parameters)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)
    )
    twin = torch.nn.Sequential(
        torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)
    )
    twin.load_state_dict(model.state_dict())
    x, y = torch.randn(32, 12), torch.randn(32, 3)
    opts = [
        Gefen(m.parameters(), lr=1e-2, second_moment="factored") for m in (model, twin)
    ]
    launches = []
    real = _triton_step.launch

    def counting(jobs, tables=None):
        launches.append(real(jobs, tables))
        return launches[-1]

    for _ in range(3):
        for m, opt in zip((model, twin), opts, strict=True):
            opt.zero_grad()
            (m(x) - y).square().mean().backward()
            if m is model:
                # as on CUDA: no C kernel (nor its cached plan) for these tensors
                monkeypatch.setenv("LEANTRAIN_NO_NATIVE", "1")
                monkeypatch.setattr(_triton_step, "serves", lambda device: True)
                monkeypatch.setattr(_triton_step, "launch", counting)
            opt.step()
            monkeypatch.undo()
        for a, b in zip(model.parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert launches == [4, 4, 4]  # factored matrices: 3 + 1 launches a step


@interpreter
def test_strided_parameters_step_as_contiguous_twins(monkeypatch):
    """step_many steps a transposed parameter (and gradient) as a contiguous copy
    through the kernels and writes it back: the reference's step of that copy."""
    from leantrain.optim._dispatch import StepItem, step_many

    monkeypatch.setattr(_triton_step, "serves", lambda device: True)
    torch.manual_seed(4)
    base, grad = torch.randn(40, 30), torch.randn(30, 40)
    param = base.t()  # (30, 40), not contiguous
    state = random_state(1200, 40, 8, seed=3)
    ref, p_ref = copy_state(state), param.contiguous()
    step_many([StepItem(param, grad.t().contiguous().t(), state, StepOptions(**HYPER))])
    reference_step(p_ref, grad.t().contiguous().t(), ref, **HYPER)
    assert not param.is_contiguous()
    assert_parity(state, ref, param, p_ref, 1200, ties=1)


@interpreter
def test_kept_tables_step_as_fresh_ones_through_changes(monkeypatch):
    """The dispatch keeps the Triton job tables while the same states step
    (``StepCache.triton``); a step on them equals, bit for bit, one that builds its
    tables afresh, through a new gradient dtype, a replaced state tensor and a
    parameter in new storage, and every change builds new tables."""
    from leantrain.optim._dispatch import StepCache, StepItem, step_many

    monkeypatch.setattr(_triton_step, "serves", lambda device: True)
    cases = mixed_states("cpu")
    kept = [
        StepItem(p, torch.zeros_like(p), s, StepOptions(**HYPER), seed=i)
        for i, (p, s) in enumerate(cases)
    ]
    fresh = [
        StepItem(i.param.clone(), i.grad, copy_state(i.state), i.options, i.seed)
        for i in kept
    ]
    cache, tables = StepCache(), []
    for step in range(5):
        grads = [torch.randn(i.param.shape) for i in kept]
        if step == 2:
            grads[0] = grads[0].bfloat16()  # a new gradient dtype
        if step == 3:  # a state tensor replaced by a copy
            for items in (kept, fresh):
                v = items[1].state["exp_avg_sq"]
                items[1].state["exp_avg_sq"] = v.clone()
        if step == 4:  # a parameter moves to new storage
            for items in (kept, fresh):
                items[2].param = items[2].param.clone()
        for items in (kept, fresh):
            for item, g in zip(items, grads, strict=True):
                item.grad = g
        step_many(kept, cache)
        step_many(fresh)  # no cache: tables built for this step only
        tables.append(cache.triton)
        for a, b in zip(kept, fresh, strict=True):
            assert torch.equal(a.param, b.param)
            for key in a.state:
                assert torch.equal(a.state[key], b.state[key]), key
    assert tables[1] is tables[0]  # a steady step reuses them
    assert len({id(t) for t in tables[1:]}) == 4  # each change built new ones


@interpreter
@pytest.mark.parametrize("bits", [8, 4])
def test_the_triton_plan_steps_as_the_full_path(bits, monkeypatch):
    """After a full step whose parameters all took the Triton kernels, Gefen keeps
    a plan (``_fused_plan.TritonPlan``) on the kept job tables: its steps equal the
    full path's bit for bit, through a learning-rate change and a skipped step
    with a NaN gradient (nothing changed, counted), and a changed option leaves it
    for the full path."""
    monkeypatch.setenv("LEANTRAIN_NO_NATIVE", "1")
    monkeypatch.setattr(_triton_step, "serves", lambda device: True)
    from leantrain.optim import _fused_plan

    torch.manual_seed(1)
    models = [torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Linear(16, 3))]
    models.append(torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Linear(16, 3)))
    models[1].load_state_dict(models[0].state_dict())
    opts = [
        Gefen(m.parameters(), lr=1e-2, momentum_bits=bits, second_moment="factored")
        for m in models
    ]
    x, y = torch.randn(32, 12), torch.randn(32, 3)
    for step in range(5):
        for m, opt in zip(models, opts, strict=True):
            if opt is opts[1]:
                opt._steps.plan = None  # always the full path
            if step == 2:
                opt.param_groups[0]["lr"] = 3e-3  # a scheduler: the plan holds
            opt.zero_grad()
            (m(x) - y).square().mean().backward()
            if step == 3:
                m[0].bias.grad[0] = float("nan")
                with pytest.warns(RuntimeWarning, match="non-finite"):
                    opt.step()
            else:
                opt.step()
        planned = opts[0]._steps.plan
        assert step == 0 or isinstance(planned, _fused_plan.TritonPlan)
        for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
            assert torch.equal(a, b)
        for a, b in zip(opts[0].state.values(), opts[1].state.values(), strict=True):
            for key in a:
                assert torch.equal(a[key], b[key]), key
    assert opts[0].nonfinite_steps == opts[1].nonfinite_steps == 1
    opts[0].param_groups[0]["update_clip"] = 0.5  # not a scalar: the full path
    plan = opts[0]._steps.plan
    assert plan.run(opts[0], opts[0].param_groups) is None


@interpreter
@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_a_steady_triton_step_reads_one_device_value(policy, monkeypatch):
    """A CUDA-free count of the host's reads of device values in a steady Triton
    step (``.item()``, ``.tolist()``, ``bool``/``float``/``int`` of a tensor, called
    from leantrain/optim), leaving out the state's CPU scalars (step counters,
    periods): one, the non-finite verdict, under either policy. (A "skip" that
    decides on the device, with no read, is not built yet.)"""
    import sys
    from pathlib import Path

    monkeypatch.setenv("LEANTRAIN_NO_NATIVE", "1")
    monkeypatch.setattr(_triton_step, "serves", lambda device: True)
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Linear(16, 3))
    opt = Gefen(model.parameters(), nonfinite=policy, second_moment="factored")
    x = torch.randn(8, 12)
    for _ in range(2):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    opt.zero_grad()
    model(x).square().mean().backward()
    host = {id(t) for s in opt.state.values() for k, t in s.items() if t.numel() == 1}
    optim = Path(_triton_step.__file__).resolve().parent
    reads = []

    def counted(name):
        real = getattr(torch.Tensor, name)

        def read(t, *args, **kwargs):
            caller = sys._getframe(1).f_code
            if Path(caller.co_filename).parent == optim and id(t) not in host:
                reads.append((Path(caller.co_filename).name, caller.co_name, name))
            return real(t, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, read)

    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        counted(name)
    opt.step()
    monkeypatch.undo()
    assert reads == [("_checks.py", "finite_flags", "tolist")], reads


_WITHOUT_TRITON = """
import sys

class Block:  # triton not installed
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("no triton here")

sys.meta_path.insert(0, Block())
import torch
from leantrain.optim import Gefen, _triton_step

assert not _triton_step.available()
model = torch.nn.Linear(8, 4)
opt = Gefen(model.parameters(), lr=1e-2)
for _ in range(2):
    opt.zero_grad()
    model(torch.randn(16, 8)).square().mean().backward()
    opt.step()
state = opt.state[model.weight]
print(_triton_step.problem(model.weight, model.weight.grad, state, False))
"""


def test_the_library_works_without_triton():
    """triton is optional: leantrain imports and Gefen steps on the CPU without
    it, and the Triton step names the reason it cannot run."""
    done = _python(_WITHOUT_TRITON)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "an environment without triton" in done.stdout


def test_uncovered_options_are_named():
    """What the Triton step does not cover yet is named (the fallback keeps it)."""
    p = torch.randn(8, 4)
    state = random_state(32, 4, 8, seed=1)
    g = torch.randn(8, 4)
    assert _triton_step.problem(p, g, state, False) is None
    assert "non-contiguous" in _triton_step.problem(p.t(), g.t(), state, False)
    assert "dtype torch.float64" in _triton_step.problem(p.double(), g, state, False)
    codes = state["exp_avg_codes"]
    state["exp_avg_codes"] = codes.int()
    assert "exp_avg_codes" in _triton_step.problem(p, g, state, False)


def test_fallback_warns_once_naming_the_option(monkeypatch):
    monkeypatch.setattr(_triton_step, "_warned", set())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _triton_step.warn_fallback("a non-contiguous param")
        _triton_step.warn_fallback("a non-contiguous param")
    assert len(seen) == 1 and "non-contiguous param" in str(seen[0].message)


# The same checks on CUDA at a larger size (pytest -m gpu).
@pytest.mark.parametrize("update_clip", [None, 1.0])
@pytest.mark.parametrize("bits", [8, 4, None])
@pytest.mark.parametrize("n,period", [(50_001, 97), (40_000, 1), (70_001, 70_001)])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_blocks_match_reference(bits, n, period, update_clip):
    blocks_case("cuda", bits, n, period, update_clip, steps=3)


@pytest.mark.parametrize("bits,stochastic", [(8, False), (8, True), (4, True)])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_factored_matches_reference(bits, stochastic):
    factored_case("cuda", bits, stochastic, (313, 160))


@pytest.mark.parametrize("bits,n,period", [(8, 100_000, 500), (4, 90_001, 13)])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_stochastic_codes_are_the_c_kernels(bits, n, period):
    stochastic_case("cuda", bits, n, period)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_low_precision_params(dtype):
    low_precision_case("cuda", dtype, 100_000, 700)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_fp16_stochastic_rounding_is_the_fallbacks():
    fp16_stochastic_case("cuda", 100_000, 500)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_many_parameters_in_four_launches():
    many_case("cuda")


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_gefen_trains_as_on_the_cpu(bits, monkeypatch):
    """Gefen on a CUDA model (its defaults for ``bits``) takes the Triton step
    and follows the CPU run (C kernel) step by step: losses to fp32 rounding over
    a few steps (a code flipped at a tie may part the two runs slowly)."""
    torch.manual_seed(0)
    cpu = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 10)
    )
    gpu = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 10)
    ).cuda()
    gpu.load_state_dict(cpu.state_dict())
    x, y = torch.randn(128, 64), torch.randn(128, 10)
    opts = [Gefen(m.parameters(), lr=1e-3, momentum_bits=bits) for m in (cpu, gpu)]
    seen = []
    real = _triton_step.launch

    def counting(jobs):
        seen.append(real(jobs))
        return seen[-1]

    monkeypatch.setattr(_triton_step, "launch", counting)
    for _ in range(5):
        losses = []
        for m, opt in zip((cpu, gpu), opts, strict=True):
            device = next(m.parameters()).device
            opt.zero_grad()
            loss = (m(x.to(device)) - y.to(device)).square().mean()
            loss.backward()
            opt.step()
            losses.append(float(loss))
        assert losses[1] == pytest.approx(losses[0], rel=1e-4)
    factored = any("factored" in st for st in opts[1].state.values())
    assert seen == [4 if factored else 1] * 5


_COMPILE = """
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from leantrain.optim import _triton_factored as f, _triton_kernels as k
from leantrain.optim import _triton_momentum_kernel as mk

def compile_(fn, types, constants):
    signature = {**types, **{name: "constexpr" for name in constants}}
    source = ASTSource(fn=fn, signature=signature, constexprs=constants)
    options = {"enable_fp_fusion": False}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)

tables = {"jobs": "*i64", "hypers": "*fp32", "starts": "*i64", "njobs": "i32"}
pairs = [(tl.float32, tl.float32), (tl.bfloat16, tl.bfloat16), (tl.float16, tl.float32)]
for p_dtype, g_dtype in pairs:
    constants = {"TILE": 1024, "LOG_JOBS": 8, "P_DTYPE": p_dtype, "G_DTYPE": g_dtype,
                 "EXACT": False}
    ptx = compile_(k.gefen_step_kernel, tables, constants).asm["ptx"]
    # IEEE division and square root only (Triton's plain / and sqrt are not)
    assert "div.full" not in ptx and "sqrt.approx" not in ptx, "approximate math"
factor = {"fjobs": "*i64", "starts": "*i64", "njobs": "i32"}
compile_(f.factor_rows_kernel, factor, {"ROWS": 16, "COLS": 256, "LOG_JOBS": 6,
                                        "G_DTYPE": tl.float32})
factor = {"fjobs": "*i64", "hypers": "*fp32", "starts": "*i64", "njobs": "i32"}
compile_(f.factor_cols_kernel, factor, {"COLS": 256, "LOG_JOBS": 6, "EXACT": False})
compile_(f.factor_a_kernel, factor, {"ROWS": 256, "LOG_JOBS": 6, "EXACT": False})
for g_dtype in (tl.float32, tl.bfloat16):  # GefenMuon's momentum
    constants = {"TILE": 1024, "LOG_JOBS": 8, "G_DTYPE": g_dtype, "EXACT": False}
    ptx = compile_(mk.momentum_kernel, tables, constants).asm["ptx"]
    assert "div.full" not in ptx, "approximate math"
print("compiled")
"""


def test_kernels_compile_for_cuda():
    """The interpreter runs Python, not Triton's compiler: a kernel it runs may
    still not compile (a global that is not constexpr, a type the compiler
    rejects). Compiling for an H100 (sm_90) needs no GPU, only triton's CUDA
    backend: done in a subprocess without ``TRITON_INTERPRET``."""
    pytest.importorskip("triton.backends.nvidia")
    done = _python(_COMPILE)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


def _python(code: str):
    """Runs ``code`` in a fresh interpreter with this checkout importable and
    without TRITON_INTERPRET (triton compiles there)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
