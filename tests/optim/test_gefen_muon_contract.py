"""GefenMuon's optimizer contract: checkpoints, errors, closures, groups, schedulers,
non-finite gradients and bf16 parameters."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as sched

from leantrain.optim.muon import (
    GefenMuon,
)
from tests._helpers.muon_models import matrix_mlp as _matrix_mlp
from tests._helpers.muon_models import rel as _rel

# --- optimizer contract ------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4, None])
def test_state_dict_round_trip_resumes_bit_exactly(bits, kit):
    x, y = kit.make_data()
    model = kit.make_mlp()
    options = {"lr": 0.02, "adamw_lr": 1e-2, "momentum_bits": bits}
    options["ns_dtype"] = torch.float64 if bits is None else None
    opt = GefenMuon(model.parameters(), **options)
    kit.train(model, opt, x, y, 4)
    resumed_model = kit.clone(model)
    resumed = GefenMuon(resumed_model.parameters(), **options)
    resumed.load_state_dict(kit.roundtrip(opt.state_dict()))
    for p in resumed_model.parameters():
        assert resumed.state[p]["step"].dtype == torch.float32
        if bits is not None:
            assert resumed.state[p]["exp_avg_codes"].dtype == torch.uint8
    if bits is not None:
        assert len({id(s["codebook"]) for s in resumed.state.values()}) == 1
    kit.train(model, opt, x, y, 4)
    kit.train(resumed_model, resumed, x, y, 4)
    assert kit.max_diff(model, resumed_model) == 0.0


def test_load_state_dict_rejects_other_layouts(kit):
    x, y = kit.make_data()
    model = kit.make_mlp()
    opt = GefenMuon(model.parameters())
    kit.train(model, opt, x, y, 1)
    other = GefenMuon(kit.clone(model).parameters(), momentum_bits=4)
    with pytest.raises(ValueError, match="momentum_bits"):
        other.load_state_dict(opt.state_dict())
    matrices = _matrix_mlp()  # one param group in both optimizers
    adamw = torch.optim.AdamW(matrices.parameters())
    kit.train(matrices, adamw, x, y, 1)
    with pytest.raises(ValueError, match="not a GefenMuon state dict"):
        GefenMuon(matrices.parameters()).load_state_dict(adamw.state_dict())


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"lr": -1.0}, ValueError, "Invalid learning rate: -1.0"),
        ({"weight_decay": -0.5}, ValueError, "Invalid weight_decay value: -0.5"),
        ({"momentum": 1.0}, ValueError, "Invalid momentum value: 1.0"),
        ({"nesterov": 1}, TypeError, "nesterov must be a bool, got 1"),
        ({"ns_steps": 100}, ValueError, "Invalid ns_steps: 100"),
        ({"ns_coefficients": (1.0, 2.0)}, ValueError, "Invalid ns_coefficients"),
        ({"eps": -1.0}, ValueError, "Invalid epsilon value: -1.0"),
        ({"adjust_lr_fn": "x"}, ValueError, "Invalid adjust_lr_fn: 'x'"),
        ({"momentum_bits": 3}, ValueError, "Invalid momentum_bits: 3"),
        ({"partition": "rows"}, ValueError, "Invalid partition: 'rows'"),
        ({"ns_dtype": torch.int32}, ValueError, "Invalid ns_dtype: torch.int32"),
        ({"adamw_lr": -1.0}, ValueError, "Invalid learning rate: -1.0"),
        ({"adamw_betas": (1.0, 0.9)}, ValueError, "beta parameter at index 0: 1.0"),
        ({"adamw_eps": -1.0}, ValueError, "Invalid epsilon value: -1.0"),
        ({"adamw_weight_decay": -1.0}, ValueError, "Invalid weight_decay value"),
        ({"nonfinite": "ignore"}, ValueError, "Invalid nonfinite: 'ignore'"),
    ],
)
def test_invalid_options_raise(kwargs, error, message):
    with pytest.raises(error, match=message):
        GefenMuon([nn.Parameter(torch.zeros(3, 3))], **kwargs)


def test_invalid_groups_raise():
    vector = nn.Parameter(torch.zeros(5))
    with pytest.raises(ValueError, match=r"shape \(5,\).*use_muon=True.*2-D"):
        GefenMuon([{"params": [vector], "use_muon": True}])
    with pytest.raises(ValueError, match="Invalid use_muon: 'yes'"):
        GefenMuon([{"params": [vector], "use_muon": "yes"}])
    with pytest.raises(ValueError, match="Invalid use_muon: 1"):
        GefenMuon([{"params": [vector], "use_muon": 1}])
    with pytest.raises(ValueError, match="Invalid momentum value: 2"):
        GefenMuon([{"params": [nn.Parameter(torch.zeros(2, 2))], "momentum": 2}])
    with pytest.raises(TypeError, match="complex"):
        GefenMuon([nn.Parameter(torch.zeros(2, 2, dtype=torch.complex64))])
    with pytest.raises(ValueError, match="beta parameter at index 1: 1.5"):
        GefenMuon([{"params": [vector], "use_muon": False, "betas": (0.9, 1.5)}])


def test_adamw_group_options_come_from_the_group_or_adamw_defaults():
    w, v = nn.Parameter(torch.zeros(3, 3)), nn.Parameter(torch.zeros(3))
    opt = GefenMuon(
        [{"params": [w], "use_muon": False, "lr": 0.5}, {"params": [v]}],
        adamw_lr=0.1,
        adamw_weight_decay=0.2,
    )
    explicit, split = opt.param_groups
    assert (explicit["lr"], explicit["weight_decay"]) == (0.5, 0.2)
    assert (split["lr"], split["use_muon"]) == (0.1, False)


@pytest.mark.parametrize("bits", [8, None])
def test_lr_zero_changes_nothing(bits, kit):
    x, y = kit.make_data()
    model = kit.make_mlp()
    before = kit.clone(model)
    opt = GefenMuon(model.parameters(), lr=0.0, adamw_lr=0.0, momentum_bits=bits)
    kit.train(model, opt, x, y, 3)
    assert kit.max_diff(model, before) == 0.0
    assert len(opt.state) == len(list(model.parameters()))


def test_closure_on_the_first_step_equals_explicit_backward(kit):
    x, y = kit.make_data()
    model = kit.make_mlp()
    explicit_model = kit.clone(model)
    opt = GefenMuon(model.parameters(), lr=0.02)
    explicit = GefenMuon(explicit_model.parameters(), lr=0.02)

    def closure():
        opt.zero_grad()
        loss = kit.loss_fn(model, x, y)
        loss.backward()
        return loss

    for _ in range(3):
        returned = opt.step(closure)
        explicit.zero_grad()
        expected = kit.loss_fn(explicit_model, x, y)
        expected.backward()
        explicit.step()
        assert returned.item() == expected.item()
    assert kit.max_diff(model, explicit_model) == 0.0


def test_add_param_group_and_late_parameters_share_the_codebook(kit):
    x, y = kit.make_data()
    model = kit.make_mlp()
    first, *rest = list(model.children())
    opt = GefenMuon(first.parameters(), lr=0.02)
    kit.train(model, opt, x, y, 2)
    codebook = opt.state[first.weight]["codebook"]
    opt.add_param_group({"params": [p for m in rest for p in m.parameters()]})
    assert [g["use_muon"] for g in opt.param_groups] == [True, False, True, False]
    late = [p for m in rest for p in m.parameters()]
    snapshot = [p.detach().clone() for p in late]
    kit.train(model, opt, x, y, 2)
    for p, old in zip(late, snapshot, strict=True):
        assert not torch.equal(p, old)
        assert opt.state[p]["codebook"] is codebook


def test_nonfinite_gradient_skips_the_step(kit):
    x, y = kit.make_data()
    model = kit.make_mlp()
    opt = GefenMuon(model.parameters(), lr=0.02)
    kit.train(model, opt, x, y, 2)
    params, state = kit.clone(model), copy.deepcopy(opt.state_dict())
    opt.zero_grad()
    kit.loss_fn(model, x, y).backward()
    next(model.parameters()).grad[0, 0] = math.nan
    with pytest.warns(RuntimeWarning, match="non-finite gradient"):
        opt.step()
    assert kit.max_diff(model, params) == 0.0
    assert opt.nonfinite_steps == 1
    for key, saved in state["state"].items():
        for name, value in saved.items():
            live = opt.state_dict()["state"][key][name]
            assert torch.equal(live, value), name
    strict = GefenMuon(model.parameters(), nonfinite="raise")
    with pytest.raises(FloatingPointError, match="non-finite gradient"):
        strict.step()


def test_scheduler_scales_both_sides(kit):
    model = kit.make_mlp()
    opt = GefenMuon(model.parameters(), lr=0.02, adamw_lr=1e-2)
    scheduler = sched.StepLR(opt, step_size=1, gamma=0.5)
    opt.step()
    scheduler.step()
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.005]


def test_bf16_parameters_are_updated_in_fp32_and_stored_back(kit):
    x, y = kit.make_data()
    model = _matrix_mlp().to(torch.bfloat16)
    exact = _matrix_mlp()
    kit.train(model, GefenMuon(model.parameters(), lr=0.02), x, y, 5)
    kit.train(exact, GefenMuon(exact.parameters(), lr=0.02), x, y, 5)
    for a, b in zip(model.parameters(), exact.parameters(), strict=True):
        assert a.dtype == torch.bfloat16
        assert _rel(a.float(), b) < 0.05
