"""Tests of GefenMuon's Triton momentum (``_triton_momentum``,
``_triton_momentum_kernel``): parity with the reference ``muon_momentum``, launch
counts, and GefenMuon's whole step through it.

As ``test_triton_step.py``: the default CPU suite runs the kernel through Triton's
interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET=1``), the ``gpu``-marked
cases run it compiled on CUDA at a larger size. Comparisons: codes equal but for
ties (a code may flip where m / absmax sits within rounding of a midpoint), absmax
and the returned Newton–Schulz input to fp32 rounding, stochastic codes bit for
bit the reference's (both hash the element's index on ``code_key(seed, step)``
and apply ``code_rounding``'s rule to the same fp32 quotient).
"""

from __future__ import annotations

import pytest
import torch

from tests._helpers.fused_states import codes_of, copy_state, random_state

pytest.importorskip("triton")

from leantrain.optim import GefenMuon, _triton_momentum, _triton_step  # noqa: E402
from leantrain.optim._muon_math import muon_momentum  # noqa: E402
from leantrain.optim.code_rounding import code_key  # noqa: E402

CUDA = torch.cuda.is_available()
interpreter = pytest.mark.skipif(
    not _triton_step.interpreting(),
    reason="triton compiles for CUDA here: the gpu-marked tests run these cases",
)


def muon_state(shape, period, bits, seed):
    """A Muon state after some training (random codes and absmax; no v)."""
    n = shape[0] * shape[1]
    state = random_state(n, period, bits, seed)
    del state["exp_avg_sq"]  # Muon keeps no second moment
    if bits is None:  # fp32 momentum takes the parameter's shape
        state["exp_avg"] = state["exp_avg"].view(shape)
    return state


def on(device, state: dict) -> dict:
    return {
        k: v if k == "codebook" else v.to(device, copy=True) for k, v in state.items()
    }


def assert_momentum_parity(mine, ref, out, expected, n, *, exact_codes, ties):
    """Codes equal (but for ``ties`` one-code flips unless ``exact_codes``),
    absmax and the output to fp32 rounding."""
    mine = {k: v.cpu() for k, v in mine.items()}
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-6, atol=1e-7)
    if "codebook" not in ref:
        torch.testing.assert_close(mine["exp_avg"], ref["exp_avg"], rtol=1e-6, atol=0)
        return
    torch.testing.assert_close(
        mine["exp_avg_absmax"], ref["exp_avg_absmax"], rtol=1e-6, atol=0
    )
    diff = codes_of(mine, n).int() - codes_of(ref, n).int()
    if exact_codes:
        assert int((diff != 0).sum()) == 0, int((diff != 0).sum())
    else:
        assert int(diff.abs().max()) <= 1 and int((diff != 0).sum()) <= ties


# (shape, period, bits, stochastic codes, nesterov): odd blocks (4-bit codes of two
# blocks share a byte: two-block units), a block longer than a tile (two passes,
# the momentum recomputed), 256-element blocks of period 1, fp32 momentum
CASES = [
    ((7, 29), 7, 8, False, True),
    ((7, 29), 7, 8, True, False),
    ((9, 23), 13, 4, True, True),
    ((10, 21), 21, 4, False, False),
    ((30, 70), 2100, 8, True, True),
    ((12, 25), 1, 8, False, True),
    ((6, 11), 1, None, False, True),
]


def momentum_case(device, shape, period, bits, stochastic, nesterov, steps=3):
    """``steps`` momentum steps of one job on ``device`` against ``muon_momentum``."""
    seed = shape[0] * 100 + period
    torch.manual_seed(seed)
    param = torch.randn(shape)
    state = muon_state(shape, period, bits, seed)
    n = param.numel()
    for _ in range(steps):
        grad = torch.randn(shape) * (1 + torch.arange(n).view(shape) % 5)
        mine, ref = on(device, state), copy_state(state)
        mine["step"] += 1
        ref["step"] += 1
        key = code_key(seed, int(mine["step"])) if stochastic and bits else None
        job = _triton_momentum.job(
            param.to(device),
            grad.to(device),
            mine,
            momentum=0.9,
            nesterov=nesterov,
            code_key=key,
        )
        (out,), launches = _triton_momentum.launch([job])
        expected = muon_momentum(
            param,
            grad,
            ref,
            momentum=0.9,
            nesterov=nesterov,
            stochastic_codes=stochastic,
            seed=seed,
        )
        assert launches == 1
        assert out.shape == shape and out.dtype == torch.float32
        assert_momentum_parity(
            mine, ref, out, expected, n, exact_codes=stochastic, ties=max(1, n // 1000)
        )
        state = ref


@interpreter
@pytest.mark.parametrize("shape,period,bits,stochastic,nesterov", CASES)
def test_momentum_matches_reference(shape, period, bits, stochastic, nesterov):
    momentum_case("cpu", shape, period, bits, stochastic, nesterov)


@interpreter
def test_one_launch_per_gradient_dtype():
    """Jobs of mixed gradient dtypes: one launch per dtype, each job as the
    reference steps it alone (its output a view of one shared buffer)."""
    shapes = [(5, 12), (8, 9), (4, 30)]
    dtypes = [torch.float32, torch.bfloat16, torch.float32]
    jobs, refs = [], []
    for i, (shape, dtype) in enumerate(zip(shapes, dtypes, strict=True)):
        param = torch.randn(shape)
        grad = torch.randn(shape).to(dtype)
        state = muon_state(shape, 6, 8 if i != 1 else 4, seed=i)
        ref = copy_state(state)
        state["step"] += 1
        ref["step"] += 1
        jobs.append(
            _triton_momentum.job(param, grad, state, momentum=0.95, nesterov=True)
        )
        expected = muon_momentum(param, grad, ref, momentum=0.95, nesterov=True)
        refs.append((state, ref, expected, param.numel()))
    outs, launches = _triton_momentum.launch(jobs)
    assert launches == 2
    for out, (state, ref, expected, n) in zip(outs, refs, strict=True):
        assert_momentum_parity(state, ref, out, expected, n, exact_codes=False, ties=1)


@interpreter
def test_kept_tables_step_as_fresh_ones_through_changes():
    """Tables kept from step to step give the reference's results, are reused
    while the states hold, and are rebuilt when a state's codebook changes (its
    rows point at the codebook's device table; new state tensors change the key
    by their addresses)."""
    shapes = [(6, 10), (5, 7)]
    params = [torch.randn(shape) for shape in shapes]
    states = [muon_state(shape, 5, 8, seed=i) for i, shape in enumerate(shapes)]
    tables = _triton_momentum.MomentumTables()
    kept = []
    for step in range(4):
        if step == 2:  # another codebook for the first state, same tensors
            states[0]["codebook"] = -states[0]["codebook"].flip(0)
        grads = [torch.randn(shape) for shape in shapes]
        refs = [copy_state(st) for st in states]
        jobs, expected = [], []
        for p, g, st, ref in zip(params, grads, states, refs, strict=True):
            st["step"] += 1
            ref["step"] += 1
            jobs.append(_triton_momentum.job(p, g, st, momentum=0.9, nesterov=True))
            expected.append(muon_momentum(p, g, ref, momentum=0.9, nesterov=True))
        outs, launches = _triton_momentum.launch(jobs, tables)
        assert launches == 1
        kept.append(tables.kept[torch.device("cpu")])
        for st, ref, out, want, p in zip(
            states, refs, outs, expected, params, strict=True
        ):
            assert_momentum_parity(
                st, ref, out, want, p.numel(), exact_codes=False, ties=1
            )
    assert kept[0] is kept[1] and kept[1] is not kept[2] and kept[2] is kept[3]


def train(bits, monkeypatch, *, triton: bool, steps=3):
    """A small model's parameters after ``steps`` GefenMuon steps; with ``triton``
    its tensors are served by the Triton kernels (both sides), else the Muon side
    takes the reference and the AdamW side the C kernel. Returns the parameters
    and the momentum launch counts."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 24)
    )
    x, y = torch.randn(32, 12), torch.randn(32, 24)
    opt = GefenMuon(model.parameters(), lr=2e-2, momentum_bits=bits)
    launches = []
    real = _triton_momentum.launch

    def counting(jobs, tables=None):
        outs, count = real(jobs, tables)
        launches.append(count)
        return outs, count

    if triton:
        monkeypatch.setenv("LEANTRAIN_NO_NATIVE", "1")
        monkeypatch.setattr(_triton_step, "serves", lambda device: True)
        monkeypatch.setattr(_triton_momentum, "launch", counting)
    for _ in range(steps):
        opt.zero_grad()
        (model(x) - y).square().mean().backward()
        opt.step()
    monkeypatch.undo()
    return [p.detach().clone() for p in model.parameters()], launches


@interpreter
@pytest.mark.parametrize("bits", [8, 4, None])
def test_gefen_muon_steps_through_triton(bits, monkeypatch):
    """GefenMuon on tensors _triton_step.serves: its two Muon matrices' quantized
    momentum in one launch a step, and the parameters after 3 steps those of the
    reference path (4-bit: stochastic codes by default, the same bits), to fp32
    rounding. fp32 momentum keeps torch.optim.Muon's ops: no launch."""
    mine, launches = train(bits, monkeypatch, triton=True)
    ref, none = train(bits, monkeypatch, triton=False)
    assert launches == ([] if bits is None else [1, 1, 1]) and none == []
    for a, b in zip(mine, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "shape,period,bits,stochastic,nesterov",
    [((256, 384), 256, 8, True, True), ((200, 301), 77, 4, True, False)],
)
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_momentum_matches_reference(shape, period, bits, stochastic, nesterov):
    momentum_case("cuda", shape, period, bits, stochastic, nesterov)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_gefen_muon_trains_as_on_the_cpu(bits, monkeypatch):
    """GefenMuon on a CUDA model takes the momentum kernel (one launch a step) and
    follows the CPU run (reference Muon side, C-kernel AdamW side): losses to fp32
    rounding over a few steps (Newton–Schulz in fp32 on both)."""
    torch.manual_seed(0)
    cpu = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 10)
    )
    gpu = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 10)
    ).cuda()
    gpu.load_state_dict(cpu.state_dict())
    x, y = torch.randn(128, 64), torch.randn(128, 10)
    opts = [
        GefenMuon(m.parameters(), momentum_bits=bits, ns_dtype=torch.float32)
        for m in (cpu, gpu)
    ]
    seen = []
    real = _triton_momentum.launch

    def counting(jobs, tables=None):
        outs, count = real(jobs, tables)
        seen.append(count)
        return outs, count

    monkeypatch.setattr(_triton_momentum, "launch", counting)
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
    assert seen == [1] * 5


def test_uncovered_tensors_are_named():
    """What the kernel does not cover is named (the reference path takes it)."""
    p, g = torch.randn(8, 4), torch.randn(8, 4)
    state = muon_state((8, 4), 4, 8, seed=1)
    assert _triton_momentum.problem(p, g, state) is None
    assert "non-contiguous" in _triton_momentum.problem(
        p, g.t().contiguous().t(), state
    )
    assert "float64" in _triton_momentum.problem(p, g.double(), state)
    state["exp_avg_codes"] = state["exp_avg_codes"].int()
    assert "exp_avg_codes" in _triton_momentum.problem(p, g, state)
