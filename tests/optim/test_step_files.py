"""How many files of leantrain/optim a steady Gefen step enters (issue 35, item 5):
a reader follows one step through at most eight of them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from leantrain.optim import Gefen, _native

OPTIM = Path(_native.__file__).resolve().parent
BOUND = 8


def _files_of_a_steady_step(opt: Gefen, model: torch.nn.Module) -> set[str]:
    for _ in range(3):  # the first step learns the codebook; then a plan is kept
        model(torch.randn(4, 64)).square().mean().backward()
        opt.step()
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


@pytest.mark.skipif(_native.load() is None, reason="no C kernel on this machine")
@pytest.mark.parametrize("bits", [8, 4, None])
def test_a_steady_c_kernel_step_enters_at_most_eight_files(bits):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8)
    )
    entered = _files_of_a_steady_step(
        Gefen(model.parameters(), momentum_bits=bits), model
    )
    assert "_fused_plan.py" in entered  # the cached C plan took it
    assert len(entered) <= BOUND, sorted(entered)
