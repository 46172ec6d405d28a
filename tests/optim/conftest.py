"""Shared helpers for the optimizer tests: a small MLP, data, a train loop, and the
``backend`` fixture (the fused step on the C kernel and on the PyTorch fallback)."""

from __future__ import annotations

import copy
import io
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from leantrain.optim import _fused, _native


def make_mlp(sizes=(12, 32, 32, 5), seed: int = 0, dtype=torch.float32) -> nn.Module:
    """A LayerNorm MLP: 2-D weights, 1-D biases and norm params (several shapes)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers += [nn.LayerNorm(b), nn.Tanh()]
    return nn.Sequential(*layers).to(dtype)


def make_data(n: int = 64, d_in: int = 12, d_out: int = 5, seed: int = 1):
    """A regression task with a known nonlinear teacher."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    w = torch.randn(d_in, d_out, generator=g) / d_in**0.5
    return x, torch.tanh(x @ w) + 0.1 * x[:, :d_out] ** 2


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x.to(next(model.parameters()).dtype))
    return (out.float() - y).square().mean()


def train(model, opt, x, y, steps: int) -> list[float]:
    """Plain training loop; returns the losses seen before each step."""
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(model, x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def roundtrip(obj):
    """torch.save + torch.load(weights_only=True), as a checkpoint does."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def max_diff(model_a: nn.Module, model_b: nn.Module) -> float:
    """Largest absolute difference between corresponding parameters."""
    return max(
        (a.float() - b.float()).abs().max().item()
        for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True)
    )


@pytest.fixture
def kit() -> SimpleNamespace:
    """The helpers above, for tests (conftest modules are not imported directly)."""
    return SimpleNamespace(
        make_mlp=make_mlp,
        make_data=make_data,
        loss_fn=loss_fn,
        train=train,
        roundtrip=roundtrip,
        max_diff=max_diff,
        clone=copy.deepcopy,
    )


@pytest.fixture(params=["c", "torch"])
def backend(request, monkeypatch):
    """Runs a test on the C kernel and on the PyTorch fallback."""
    if request.param == "torch":
        monkeypatch.setenv("LEANTRAIN_NO_NATIVE", "1")
    else:
        monkeypatch.delenv("LEANTRAIN_NO_NATIVE", raising=False)
        if _native.compiler() is None:
            pytest.skip("no C compiler on this machine: only the fallback can run")
        assert _fused.backend() == "c", _native.status()
    assert _fused.backend() == request.param
    return request.param
