"""How many files of leantrain/optim a steady step enters (issue 35, item 5): a
reader follows one Gefen or GefenMuon step through at most eight of them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from leantrain.optim import Gefen, GefenMuon, _fused_plan, _native, _triton_step

OPTIM = Path(_native.__file__).resolve().parent
BOUND = 8


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8)
    )


def _files_of_a_steady_step(opt, model: torch.nn.Module) -> set[str]:
    for _ in range(3):  # the first step learns the codebook; then a plan is kept
        opt.zero_grad()
        model(torch.randn(4, 64)).square().mean().backward()
        opt.step()
    opt.zero_grad()
    model(torch.randn(4, 64)).square().mean().backward()
    entered: set[str] = set()

    def profile(frame, event, arg):
        path = Path(frame.f_code.co_filename)
        if path.parent == OPTIM:
            entered.add(path.name)

    sys.setprofile(profile)
    try:
        opt.step()
    finally:
        sys.setprofile(None)
    return entered


needs_kernel = pytest.mark.skipif(
    _native.load() is None, reason="no C kernel on this machine"
)


@needs_kernel
@pytest.mark.parametrize("bits", [8, 4, None])
def test_a_steady_c_kernel_step_enters_at_most_eight_files(bits):
    model = _model()
    entered = _files_of_a_steady_step(
        Gefen(model.parameters(), momentum_bits=bits), model
    )
    assert "_fused_plan.py" in entered  # the cached C plan took it
    assert len(entered) <= BOUND, sorted(entered)


@needs_kernel
@pytest.mark.parametrize("bits", [8, None])
def test_a_steady_gefen_muon_step_enters_at_most_eight_files(bits):
    """Muon's own update (Newton-Schulz, the quantized momentum) and the AdamW side
    through the same cached plan as Gefen's. (4-bit Muon momentum adds its
    stochastic codes' three files: code_rounding, precision, _quant_table.)"""
    model = _model()
    entered = _files_of_a_steady_step(
        GefenMuon(model.parameters(), momentum_bits=bits), model
    )
    assert "_fused_plan.py" in entered  # the AdamW side took the cached plan
    assert len(entered) <= BOUND, sorted(entered)


@pytest.mark.skipif(
    not _triton_step.interpreting(),
    reason="the Triton kernels run on CPU tensors only under the interpreter",
)
@pytest.mark.parametrize("bits", [8, 4, None])
def test_a_steady_triton_step_enters_at_most_eight_files(bits, monkeypatch):
    """CPU tensors forced through the Triton kernels (as on CUDA: no C kernel),
    which Triton's interpreter runs; the kernels' own frames are the
    interpreter's and left out: the host side is what a reader follows."""
    monkeypatch.setenv("LEANTRAIN_NO_NATIVE", "1")
    monkeypatch.setattr(_triton_step, "serves", lambda device: True)
    model = _model()
    opt = Gefen(model.parameters(), momentum_bits=bits)
    entered = _files_of_a_steady_step(opt, model)
    kernels = {"_triton_kernels.py", "_triton_factored.py", "_triton_rounding.py"}
    host = entered - kernels
    assert "_triton_step.py" in host  # the kernels took it, on the kept tables
    assert isinstance(opt._steps.plan, _fused_plan.TritonPlan)
    assert len(host) <= BOUND, sorted(host)


@pytest.mark.skipif(
    not _triton_step.interpreting(),
    reason="the Triton kernels run on CPU tensors only under the interpreter",
)
@pytest.mark.parametrize("bits", [8])
def test_a_steady_triton_gefen_muon_step_enters_at_most_eight_files(bits, monkeypatch):
    """GefenMuon as on CUDA: the Muon side's momentum through its Triton kernel on
    kept tables, the AdamW side through Gefen's Triton plan (kernel frames left
    out, as above; 4-bit adds the stochastic codes' key files)."""
    monkeypatch.setenv("LEANTRAIN_NO_NATIVE", "1")
    monkeypatch.setattr(_triton_step, "serves", lambda device: True)
    model = _model()
    opt = GefenMuon(model.parameters(), momentum_bits=bits)
    entered = _files_of_a_steady_step(opt, model)
    kernels = {
        "_triton_kernels.py",
        "_triton_factored.py",
        "_triton_rounding.py",
        "_triton_momentum_kernel.py",
    }
    host = entered - kernels
    assert "_triton_momentum.py" in host  # the Muon side took the kernel
    assert len(host) <= BOUND, sorted(host)
