"""Gefen's checkpoint layout (world-size independent) and DCP's template step, in one
process. The distributed round trips are in tests/distributed/test_gefen_distributed.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from leantrain.optim import Gefen
from leantrain.optim._checkpoint import codes_shape, padded_lengths
from leantrain.optim.partition import period_floor
from leantrain.optim.quant import unpack_nibbles


def model() -> nn.Module:
    torch.manual_seed(0)
    # (37, 12): 4-bit packable rows; (37,): 1-D, unpacked; (5, 7): odd last dim
    return nn.Sequential(
        nn.Linear(12, 37), nn.Tanh(), nn.Linear(37, 7), nn.Linear(7, 5)
    )


def train(net, opt, steps, start=0):
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 12, generator=g), torch.randn(16, 5, generator=g)
        (net(x) - y).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("bits", [8, 4, None])
def test_state_dict_is_the_checkpoint_layout(bits):
    net = model()
    opt = Gefen(net.parameters(), lr=1e-2, momentum_bits=bits, second_moment="blocks")
    train(net, opt, 3)
    saved = opt.state_dict()["state"]
    for index, param in enumerate(net.parameters()):
        state, runtime = saved[index], opt.state[param]
        n = param.numel()
        nb, nq = padded_lengths(n, "auto")
        assert nb == math.ceil(n / period_floor(n, 256, 16384))
        period = int(runtime["period"])
        assert state["exp_avg_sq"].shape == (nb,)
        assert torch.equal(
            state["exp_avg_sq"][: -(-n // period)], runtime["exp_avg_sq"]
        )
        assert not state["exp_avg_sq"][-(-n // period) :].any()  # zero padding
        if bits is None:
            assert torch.equal(state["exp_avg"], runtime["exp_avg"])
            continue
        codes = state["exp_avg_codes"]
        assert codes.shape == codes_shape(tuple(param.shape), bits)
        if bits == 8:
            assert torch.equal(codes.reshape(-1), runtime["exp_avg_codes"])
        else:  # the same codes, whatever the packing
            flat = runtime["exp_avg_codes"]
            expect = unpack_nibbles(flat, n)
            got = codes.reshape(-1)
            if codes.shape != param.shape:  # packed along the last dim
                got = unpack_nibbles(got, n)
            assert torch.equal(got, expect)
        assert state["exp_avg_absmax"].shape == (nq,)


@pytest.mark.parametrize("bits", [8, 4, None])
def test_round_trip_resumes_bit_exactly(bits):
    a, b = model(), model()
    opt_a = Gefen(a.parameters(), lr=1e-2, momentum_bits=bits)
    train(a, opt_a, 6)
    b.load_state_dict(a.state_dict())
    opt_b = Gefen(b.parameters(), lr=1e-2, momentum_bits=bits)
    opt_b.load_state_dict(opt_a.state_dict())
    train(a, opt_a, 4, start=6)
    train(b, opt_b, 4, start=6)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def test_dcp_template_step_changes_nothing():
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    a, b = model(), model()
    opt_a, opt_b = Gefen(a.parameters(), lr=1e-2), Gefen(b.parameters(), lr=1e-2)
    template = get_optimizer_state_dict(b, opt_b)  # zero grads at lr 0
    assert {int(s["period"]) for s in opt_b.state.values()} == {0}
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    assert all(float(g["lr"]) == 1e-2 for g in opt_b.param_groups)
    # the template has the shapes of a real checkpoint
    train(a, opt_a, 1)
    real = get_optimizer_state_dict(a, opt_a)
    for key, state in real["state"].items():
        for name, value in state.items():
            assert template["state"][key][name].shape == value.shape, (key, name)
    train(a, opt_a, 5, start=1)
    train(b, opt_b, 6)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def test_provisional_state_round_trips_and_is_replaced():
    a = model()
    opt = Gefen(a.parameters(), lr=1e-2)
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    get_optimizer_state_dict(a, opt)
    fresh = Gefen(a.parameters(), lr=1e-2)
    fresh.load_state_dict(opt.state_dict())
    assert {int(s["period"]) for s in fresh.state.values()} == {0}
    train(a, fresh, 1)
    assert all(int(s["period"]) > 0 for s in fresh.state.values())


def test_another_partition_is_rejected():
    net = model()
    # blocks: a state whose layout is its period (the default factors the matrix)
    opt = Gefen(net.parameters(), lr=1e-2, second_moment="blocks")
    train(net, opt, 1)
    other = Gefen(net.parameters(), lr=1e-2, partition="element")
    with pytest.raises(ValueError, match="parameter 0 .*exp_avg_sq"):
        other.load_state_dict(opt.state_dict())


@pytest.mark.parametrize("bits", [8, 4, None])
def test_another_models_state_is_named_as_such(bits):
    # A wider model: the error names the parameter shape, not a derived layout
    # (the period or the factors, which differ as a consequence).
    torch.manual_seed(0)
    narrow, wide = nn.Linear(64, 256), nn.Linear(96, 256)
    opt = Gefen(narrow.parameters(), lr=1e-2, momentum_bits=bits)
    narrow(torch.randn(4, 64)).sum().backward()
    opt.step()
    other = Gefen(wide.parameters(), lr=1e-2, momentum_bits=bits)
    with pytest.raises(
        ValueError,
        match=r"parameter 0 \(shape \(256, 96\)\): the state "
        r"was saved for a parameter of another shape",
    ):
        other.load_state_dict(opt.state_dict())
