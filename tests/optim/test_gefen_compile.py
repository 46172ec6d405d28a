"""``torch.compile(opt.step)`` with Gefen and GefenMuon gives eager's parameters.

The step is excluded from Dynamo's trace (``torch.compiler.disable``), so the
compiled call runs it eagerly; these tests hold it to the eager optimizer bit for
bit over several steps, 8-bit and 4-bit.
"""

import pytest
import torch

from leantrain.optim import Gefen, GefenMuon, muon_param_groups


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    )


def _train(model, step, opt, steps=3):
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=gen)
        model.zero_grad()
        model(x).pow(2).mean().backward()
        step()
    return [p.detach().clone() for p in model.parameters()], opt


@pytest.mark.parametrize("bits", [8, 4])
def test_compiled_gefen_step_equals_eager(bits):
    eager, compiled = _model(), _model()
    opt_e = Gefen(eager.parameters(), lr=1e-2, momentum_bits=bits)
    opt_c = Gefen(compiled.parameters(), lr=1e-2, momentum_bits=bits)
    want, _ = _train(eager, opt_e.step, opt_e)
    got, _ = _train(compiled, torch.compile(opt_c.step), opt_c)
    assert want[0].ne(_model()[0].weight).any()  # the steps moved the weights
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)
    state_e = opt_e.state_dict()["state"]
    state_c = opt_c.state_dict()["state"]
    for k in state_e:
        for name, value in state_e[k].items():
            assert torch.equal(value, state_c[k][name]), name


def test_compiled_gefen_muon_step_equals_eager():
    eager, compiled = _model(), _model()
    opt_e = GefenMuon(muon_param_groups(eager), lr=1e-2)
    opt_c = GefenMuon(muon_param_groups(compiled), lr=1e-2)
    want, _ = _train(eager, opt_e.step, opt_e)
    got, _ = _train(compiled, torch.compile(opt_c.step), opt_c)
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)
