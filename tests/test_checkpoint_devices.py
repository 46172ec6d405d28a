"""A checkpoint saved on one device resumes on another: Gefen and a preconditioner in
the user's loop, saved with ``torch.save`` and loaded with ``map_location``, continue
as the run that never stopped (moved to the new device afterwards).

CPU to CPU runs in the default suite (bit for bit); CUDA to CPU and CPU to CUDA under
the ``gpu`` marker, within the rounding of another device's kernels. The resumed
optimizer's state must live on the new device: a state tensor left behind would
fail the next step on CUDA, or silently run on the CPU.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leantrain.optim import Gefen
from leantrain.precond import precondition_in_loop

PAIRS = [
    pytest.param("cpu", "cpu", id="cpu-cpu"),
    pytest.param("cuda", "cpu", id="cuda-cpu", marks=pytest.mark.gpu),
    pytest.param("cpu", "cuda", id="cpu-cuda", marks=pytest.mark.gpu),
]


def _require(*devices: str) -> None:
    if "cuda" in devices and not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device")


def _mlp(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4)).to(dtype)


def _batches(n: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(16, 8, generator=gen, dtype=dtype), torch.arange(16) % 4)
        for _ in range(n)
    ]


def _train(model, opt, batches, device) -> None:
    for x, t in batches:
        opt.zero_grad()
        F.cross_entropy(model(x.to(device)), t.to(device)).backward()
        opt.step()


def _float_tensors(value) -> list[torch.Tensor]:
    """The floating-point tensors in a state dict (random generator states are CPU
    byte tensors wherever the generator lives)."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() and value.dim() else []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _float_tensors(v)]
    return []


def _resume(make, src, dst, dtype, tol):
    """Three steps on ``src``, a checkpoint, two more on ``dst``; against five steps
    on ``src`` moved to ``dst``. Returns the resumed optimizer."""
    batches = _batches(5, dtype)
    model = _mlp(dtype).to(src)
    opt = make(model)
    _train(model, opt, batches[:3], src)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    _train(model, opt, batches[3:], src)  # the run that never stopped

    buffer.seek(0)
    saved = torch.load(buffer, map_location=dst, weights_only=False)
    resumed = _mlp(dtype).to(dst)
    resumed.load_state_dict(saved["model"])
    resumed_opt = make(resumed)
    resumed_opt.load_state_dict(saved["opt"])
    _train(resumed, resumed_opt, batches[3:], dst)

    state = _float_tensors(resumed_opt.state_dict()["state"])
    assert state and all(t.device.type == dst for t in state)
    for got, want in zip(resumed.parameters(), model.parameters(), strict=True):
        assert got.device.type == dst
        want = want.detach().to(dst)
        if tol == 0.0:
            assert torch.equal(got, want)
        else:
            err = ((got - want).abs().max() / want.abs().max()).item()
            assert err <= tol, err
    return resumed_opt


@pytest.mark.parametrize(("src", "dst"), PAIRS)
@pytest.mark.parametrize("bits", [8, 4])
def test_gefen_resumes_on_another_device(src, dst, bits):
    _require(src, dst)
    # 8-bit rounds to the nearest code; 4-bit stochastically, from counter-based
    # bits that continue on the new device. Another device's kernels round the
    # float arithmetic differently, which can move a code by one.
    tol = 0.0 if src == dst else 1e-3
    opt = _resume(
        lambda m: Gefen(m.parameters(), lr=1e-2, momentum_bits=bits),
        src,
        dst,
        torch.float32,
        tol,
    )
    assert opt.state_dict()["state"]


@pytest.mark.parametrize(("src", "dst"), PAIRS)
def test_preconditioner_in_loop_resumes_on_another_device(src, dst):
    _require(src, dst)

    # K-FAC refreshes at step 0 and then every 10 steps: steps 3 and 4 apply the
    # saved inverses on the new device (float64, so devices agree to rounding).
    def make(model):
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return precondition_in_loop(sgd, model, "kfac")

    tol = 0.0 if src == dst else 1e-10
    opt = _resume(make, src, dst, torch.float64, tol)
    maker_state = _float_tensors(opt.maker.state_dict())
    assert maker_state and all(t.device.type == dst for t in maker_state)
