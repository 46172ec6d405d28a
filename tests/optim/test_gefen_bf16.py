"""Gefen on bf16 parameters: stochastic rounding option, determinism and resume."""

import copy

import pytest
import torch

from leantrain.optim import Gefen


def _train(model, opt, steps, x):
    for _ in range(steps):
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()


def _bf16_model():
    torch.manual_seed(0)
    return torch.nn.Linear(64, 32).bfloat16(), torch.randn(16, 64).bfloat16()


def test_stochastic_rounding_keeps_updates_below_half_an_ulp():
    # lr so small that most updates are under half a bf16 ulp: round-to-nearest
    # drops them, stochastic rounding keeps them on average.
    model, x = _bf16_model()
    moved = {}
    for option in (False, True):
        m = copy.deepcopy(model)
        _train(m, Gefen(m.parameters(), lr=1e-4, stochastic_rounding=option), 5, x)
        moved[option] = (m.weight.float() - model.weight.float()).abs().mean().item()
    assert moved[True] > 1.5 * moved[False]


def test_stochastic_rounding_is_the_bf16_default_and_resumes_bit_exactly():
    model, x = _bf16_model()
    straight = copy.deepcopy(model)
    _train(straight, Gefen(straight.parameters(), lr=1e-3), 6, x)
    explicit = copy.deepcopy(model)
    opt = Gefen(explicit.parameters(), lr=1e-3, stochastic_rounding=True)
    _train(explicit, opt, 3, x)
    saved = copy.deepcopy(opt.state_dict())
    resumed = Gefen(explicit.parameters(), lr=1e-3, stochastic_rounding=True)
    resumed.load_state_dict(saved)
    _train(explicit, resumed, 3, x)
    assert torch.equal(straight.weight, explicit.weight)
    assert torch.equal(straight.bias, explicit.bias)


def test_invalid_stochastic_rounding_is_rejected():
    model, _ = _bf16_model()
    with pytest.raises(ValueError, match="stochastic_rounding"):
        Gefen(model.parameters(), stochastic_rounding="yes")
