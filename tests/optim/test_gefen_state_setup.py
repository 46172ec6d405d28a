"""Gefen's state set-up on the first gradient: the partition options, the shared
codebook, parameters that get a gradient late or are frozen, and bf16 models."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from leantrain.optim import Gefen
from leantrain.optim.codebook import histogram, learn_codebook, with_exact_zero
from tests._helpers.gefen_steps import one_step as _one_step

# --- partition and codebook -----------------------------------------------------


def test_partition_options_set_the_period(kit):
    from leantrain.optim.partition import choose_period

    model = kit.make_mlp()
    w, b = model[0].weight, model[0].bias  # (32, 12), (32,)
    opt = Gefen(
        [
            {"params": [w], "partition": 7},
            {"params": [b], "partition": 1000},
            {"params": [model[1].weight], "partition": "element"},
            {"params": [model[1].bias], "partition": "tensor"},
            {"params": list(model[3:].parameters())},
        ]
    )
    _one_step(model, opt, 12)
    period = {p: int(s["period"]) for p, s in opt.state.items()}
    assert period[w] == 7 and period[b] == 32
    assert period[model[1].weight] == 1 and period[model[1].bias] == 32
    assert int(opt.state[model[1].weight]["qblock"]) == 256
    assert period[model[3].weight] == choose_period(model[3].weight.grad)
    assert "factored" in opt.state[model[3].weight]  # "auto": the matrix factors
    for p, s in opt.state.items():
        if "factored" in s:
            rows = int(s["factored"])
            assert s["exp_avg_sq"].numel() == rows + p.numel() // rows
        else:
            assert s["exp_avg_sq"].numel() == math.ceil(p.numel() / period[p])


def test_codebook_learned_from_first_gradient_and_shared(kit):
    model = kit.make_mlp()
    big = list(model.parameters())[:4]
    small = list(model.parameters())[4:]
    opt = Gefen([{"params": big}, {"params": small, "momentum_bits": 4}])
    opt.zero_grad()
    kit.loss_fn(model, *kit.make_data()).backward()
    grads = {p: p.grad.clone() for p in model.parameters()}
    opt.step()
    for params, bits in ((big, 8), (small, 4)):
        counts = sum(
            histogram(grads[p].reshape(-1), int(opt.state[p]["qblock"])) for p in params
        )
        # the optimal codebook, its code nearest 0 moved to exactly 0
        expected = with_exact_zero(learn_codebook(counts, 2**bits).float())
        assert 0.0 in expected.tolist() and 0.0 not in learn_codebook(counts, 2**bits)
        codebooks = {id(opt.state[p]["codebook"]) for p in params}
        assert len(codebooks) == 1
        codebook = opt.state[params[0]]["codebook"]
        assert torch.equal(codebook, expected) and codebook.dtype == torch.float32
        assert codebook[0] == -1 and codebook[-1] == 1
    frozen = opt.state[big[0]]["codebook"].clone()
    kit.train(model, opt, *kit.make_data(), 3)
    assert torch.equal(opt.state[big[0]]["codebook"], frozen)


def test_late_gradient_parameter_reuses_codebook(kit):
    x, y = kit.make_data()
    model, late = kit.make_mlp(), nn.Linear(12, 5)
    opt = Gefen([*model.parameters(), *late.parameters()], lr=1e-2)
    kit.train(model, opt, x, y, 2)
    assert not opt.state.get(late.weight)
    before = late.weight.detach().clone()
    for _ in range(2):
        opt.zero_grad()
        (kit.loss_fn(model, x, y) + late(x).square().mean()).backward()
        opt.step()
    assert opt.state[late.weight]["codebook"] is opt.state[model[0].weight]["codebook"]
    assert float(opt.state[late.weight]["step"]) == 2
    assert not torch.equal(late.weight, before)


def test_frozen_then_unfrozen_parameter_trains(kit):
    x, y = kit.make_data()
    model = kit.make_mlp()
    model[0].weight.requires_grad_(False)
    opt = Gefen(model.parameters(), lr=1e-2)
    kit.train(model, opt, x, y, 2)
    before = model[0].weight.detach().clone()
    assert not opt.state.get(model[0].weight)
    model[0].weight.requires_grad_(True)
    kit.train(model, opt, x, y, 2)
    assert not torch.equal(model[0].weight, before)


def test_momentum_bits_cannot_change_after_first_step(kit):
    model = kit.make_mlp()
    opt = Gefen(model.parameters())
    _one_step(model, opt, 12)
    opt.param_groups[0]["momentum_bits"] = 4
    with pytest.raises(ValueError, match="momentum_bits=8 but its group now says 4"):
        _one_step(model, opt, 12)


def test_bf16_model_trains_with_fp32_state(kit):
    x, y = kit.make_data()
    model = kit.make_mlp(dtype=torch.bfloat16)
    opt = Gefen(model.parameters(), lr=1e-2)
    losses = kit.train(model, opt, x, y, 40)
    assert losses[-1] < 0.5 * losses[0]
    for s in opt.state.values():
        assert s["exp_avg_sq"].dtype == s["exp_avg_absmax"].dtype == torch.float32
    resumed = Gefen(kit.clone(model).parameters(), lr=1e-2)
    resumed.load_state_dict(kit.roundtrip(opt.state_dict()))
    for s in resumed.state.values():  # torch's cast to bf16 is undone
        assert s["exp_avg_sq"].dtype == s["codebook"].dtype == torch.float32
        assert (
            s["exp_avg_codes"].dtype == torch.uint8 and s["period"].dtype == torch.int64
        )
