"""Every kind in every representation against dense torch.func/autograd references."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from leantrain.precond.curv import curvature, dense_curvature
from tests._helpers.curv_blocks import masked
from tests._helpers.curv_models import rel_err

LOSSES = {
    "ce_mean": lambda: nn.CrossEntropyLoss(),
    "ce_sum": lambda: nn.CrossEntropyLoss(reduction="sum"),
    "mse_mean": lambda: nn.MSELoss(),
    "mse_sum": lambda: nn.MSELoss(reduction="sum"),
}


def _targets(case, loss_name):
    return case.ce_targets if loss_name.startswith("ce") else case.mse_targets


@pytest.mark.parametrize("loss_name", list(LOSSES))
@pytest.mark.parametrize("kind", ["ggn", "fisher_exact", "fisher_emp"])
def test_full_matches_dense_reference(case, kind, loss_name):
    loss = LOSSES[loss_name]()
    targets = _targets(case, loss_name)
    ref = dense_curvature(case.model, loss, case.inputs, targets, kind)
    got = curvature(case.model, loss, case.inputs, targets, kind=kind, shape="full")
    assert got.to_dense().shape == ref.shape
    assert rel_err(got.to_dense(), ref) < 1e-10


@pytest.mark.parametrize("loss_name", ["ce_mean", "mse_sum"])
def test_hessian_full_and_blocks_match_reference(case, loss_name):
    loss = LOSSES[loss_name]()
    targets = _targets(case, loss_name)
    ref = dense_curvature(case.model, loss, case.inputs, targets, "hessian")
    for shape in ("full", "layer", "unit", "diag"):
        got = curvature(
            case.model, loss, case.inputs, targets, kind="hessian", shape=shape
        )
        expected = masked(ref, case.model, shape)
        assert rel_err(got.to_dense(), expected) < 1e-10, shape


@pytest.mark.parametrize("shape", ["layer", "unit", "diag"])
@pytest.mark.parametrize("kind", ["ggn", "fisher_emp"])
def test_blocks_are_the_exact_parts_of_full(case, kind, shape):
    loss = nn.CrossEntropyLoss()
    ref = dense_curvature(case.model, loss, case.inputs, case.ce_targets, kind)
    got = curvature(
        case.model, loss, case.inputs, case.ce_targets, kind=kind, shape=shape
    )
    expected = masked(ref, case.model, shape)
    assert rel_err(got.to_dense(), expected) < 1e-10
    # the cheap diagonal accessor agrees with the dense form
    assert torch.allclose(got.diagonal(), expected.diagonal(), rtol=1e-10, atol=1e-14)


def test_mse_diag_and_unit_blocks_exact(case):
    loss = nn.MSELoss()
    ref = dense_curvature(case.model, loss, case.inputs, case.mse_targets, "ggn")
    for shape in ("unit", "diag"):
        got = curvature(
            case.model, loss, case.inputs, case.mse_targets, kind="ggn", shape=shape
        )
        assert rel_err(got.to_dense(), masked(ref, case.model, shape)) < 1e-10


@pytest.mark.parametrize("kind", ["ggn", "fisher_emp", "hessian"])
def test_mean_versus_sum_scaling(kind):
    from tests._helpers.curv_models import make_case

    case = make_case("embed_ln")
    numel = case.mse_targets.numel()
    mean = curvature(
        case.model, nn.MSELoss(), case.inputs, case.mse_targets, kind=kind, shape="full"
    ).to_dense()
    total = curvature(
        case.model,
        nn.MSELoss(reduction="sum"),
        case.inputs,
        case.mse_targets,
        kind=kind,
        shape="full",
    ).to_dense()
    assert rel_err(mean * numel, total) < 1e-12
    # cross-entropy "mean" averages over the non-ignored positions only
    count = int((case.ce_targets != -100).sum())
    mean = curvature(
        case.model,
        "cross_entropy",
        case.inputs,
        case.ce_targets,
        kind=kind,
        shape="diag",
    ).to_dense()
    total = curvature(
        case.model,
        nn.CrossEntropyLoss(reduction="sum"),
        case.inputs,
        case.ce_targets,
        kind=kind,
        shape="diag",
    ).to_dense()
    assert rel_err(mean * count, total) < 1e-12


def test_reference_hessian_matches_finite_differences():
    """Guards the reference itself (torch.func.hessian is wrong on these models)."""
    from leantrain.precond.curv.reference import _flat_model
    from tests._helpers.curv_models import make_case

    case = make_case("attn")
    loss = nn.CrossEntropyLoss()
    ref = dense_curvature(case.model, loss, case.inputs, case.ce_targets, "hessian")
    theta, f = _flat_model(case.model)

    def grad_at(t):
        t = t.clone().requires_grad_(True)
        value = loss(f(t, case.inputs), case.ce_targets)
        return torch.autograd.grad(value, t)[0]

    for j in (3, 30, 50):
        step = torch.zeros_like(theta)
        step[j] = 1e-6
        fd = (grad_at(theta + step) - grad_at(theta - step)) / 2e-6
        assert rel_err(ref[:, j], fd) < 1e-6


@pytest.mark.parametrize("shape", ["unit", "diag", "layer"])
def test_closed_forms_for_one_position(shape):
    """Embedding and Linear on a single position take the closed-form path."""
    from tests._helpers.curv_models import make_case

    case = make_case("embed_ln", seq=1)
    loss = nn.CrossEntropyLoss(reduction="sum")
    ref = dense_curvature(case.model, loss, case.inputs, case.ce_targets, "fisher_emp")
    got = curvature(
        case.model, loss, case.inputs, case.ce_targets, kind="fisher_emp", shape=shape
    )
    assert rel_err(got.to_dense(), masked(ref, case.model, shape)) < 1e-10


def test_conv_same_padding_dilation_and_4d_linear_input():
    torch.manual_seed(3)
    model = nn.Sequential(
        nn.Conv2d(2, 2, 3, padding="same", dilation=2),
        nn.Tanh(),
        nn.Linear(5, 2),  # acts on the last dim of (N, C, H, W): positions C*H
        nn.Flatten(),
    ).double()
    x = torch.randn(3, 2, 4, 5, dtype=torch.float64)
    targets = torch.randn(3, 16, dtype=torch.float64)
    ref = dense_curvature(model, "mse", x, targets, "ggn")
    for shape in ("full", "unit", "diag"):
        got = curvature(model, "mse", x, targets, kind="ggn", shape=shape)
        assert rel_err(got.to_dense(), masked(ref, model, shape)) < 1e-10


def test_float32_model_agrees_with_float64():
    from tests._helpers.curv_models import make_case

    case = make_case("cnn")
    ref = curvature(
        case.model,
        "cross_entropy",
        case.inputs,
        case.ce_targets,
        kind="ggn",
        shape="kron",
    )
    model32 = case.model.float()
    got = curvature(
        model32,
        "cross_entropy",
        case.inputs.float(),
        case.ce_targets,
        kind="ggn",
        shape="kron",
    )
    assert got.to_dense().dtype == torch.float32
    assert rel_err(got.to_dense().double(), ref.to_dense()) < 1e-5
