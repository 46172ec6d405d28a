"""Bad input raises ValueError / TypeError naming the value and what is allowed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from leantrain.precond.curv import as_loss_spec, curvature
from tests._helpers.curv_models import make_case


@pytest.fixture
def mlp():
    return make_case("mlp")


def _call(case, **kw):
    args = dict(kind="ggn", shape="diag")
    args.update(kw)
    loss = args.pop("loss", "cross_entropy")
    targets = args.pop("targets", case.ce_targets)
    model = args.pop("model", case.model)
    return curvature(model, loss, case.inputs, targets, **args)


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(kind="fisher"), ValueError, "Invalid curvature kind 'fisher'.*fisher_mc"),
        (dict(shape="block"), ValueError, "Invalid curvature shape 'block'.*kron"),
        (dict(loss="l1"), ValueError, "Unknown loss name 'l1'.*mse"),
        (dict(loss=nn.L1Loss()), TypeError, "L1Loss"),
        (dict(loss=nn.MSELoss(reduction="none")), ValueError, "reduction 'none'"),
        (
            dict(loss=nn.CrossEntropyLoss(label_smoothing=0.1)),
            ValueError,
            "label_smooth",
        ),
        (dict(loss=nn.CrossEntropyLoss(weight=torch.ones(3))), ValueError, "weights"),
        (dict(kind="fisher_mc", n_mc_samples=0), ValueError, "n_mc_samples.*>= 1.*0"),
        (dict(kind="fisher_mc", generator=1), TypeError, "torch.Generator.*int"),
        (dict(kind="hessian", shape="kron"), ValueError, "no Kronecker"),
        (dict(targets=torch.zeros(5)), ValueError, "class indices"),
        (dict(loss="mse"), ValueError, "MSE targets must have the output's shape"),
        (dict(model=lambda x: x), TypeError, "nn.Module"),
        (dict(ignore_modules=["nope"]), ValueError, "'nope' is not a module name"),
        (dict(ignore_modules=[3]), TypeError, "ignore_modules entries"),
    ],
)
def test_bad_arguments(mlp, kw, exc, match):
    with pytest.raises(exc, match=match):
        _call(mlp, **kw)


class WithGRU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(3, 2, batch_first=True)
        self.fc = nn.Linear(2, 2)

    def forward(self, x):
        return self.fc(self.rnn(x)[0][:, -1])


def test_unsupported_module_is_named_or_can_be_ignored():
    model = WithGRU().double()
    x = torch.randn(4, 5, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (4,))
    with pytest.raises(ValueError, match="'rnn' of type GRU.*ignore_modules"):
        curvature(model, "cross_entropy", x, y, kind="ggn", shape="diag")
    for ignore in (["rnn"], [nn.GRU], [model.rnn]):
        got = curvature(
            model,
            "cross_entropy",
            x,
            y,
            kind="ggn",
            shape="diag",
            ignore_modules=ignore,
        )
        assert list(got.modules) == ["fc"]
        rnn_size = sum(p.numel() for p in model.rnn.parameters())
        assert torch.count_nonzero(got.diagonal()[:rnn_size]) == 0
        assert torch.count_nonzero(got.diagonal()[rnn_size:]) > 0


def test_mvp_rejects_wrong_shapes(mlp):
    got = _call(mlp)
    with pytest.raises(ValueError, match=r"flat vector must have shape \(43,\)"):
        got.mvp(torch.zeros(42, dtype=torch.float64))
    with pytest.raises(ValueError, match="parameter shapes"):
        got @ [torch.zeros(3)]
    with pytest.raises(TypeError, match="flat tensor or a list"):
        got @ 3.0
    with pytest.raises(KeyError, match="no curvature for module 'nope'"):
        got["nope"]


def test_unsupported_module_options():
    conv = nn.Sequential(nn.Conv2d(2, 2, 3, groups=2))
    x = torch.randn(2, 2, 4, 4)
    with pytest.raises(ValueError, match="groups=2"):
        curvature(conv, "mse", x, torch.zeros(2, 2, 2, 2), kind="ggn", shape="diag")
    model = nn.Sequential(nn.MultiheadAttention(4, 2, kdim=3, vdim=3))
    with pytest.raises(ValueError, match="'0'.*kdim/vdim"):
        curvature(model, "mse", x, x, kind="ggn", shape="diag")
    bias_kv = nn.Sequential(nn.MultiheadAttention(4, 2, add_bias_kv=True))
    with pytest.raises(ValueError, match="add_bias_kv"):
        curvature(bias_kv, "mse", x, x, kind="ggn", shape="diag")


def test_string_loss_means_mean_reduction():
    assert as_loss_spec("ce").reduction == "mean"
    assert as_loss_spec(nn.MSELoss(reduction="sum")).reduction == "sum"
