"""The hook machinery: training-step use, repeated calls, attention, safety checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leantrain.precond.curv import (
    CurvatureCollector,
    curvature,
    dense_curvature,
    output_vectors,
)
from leantrain.precond.curv._mha import mha_forward
from leantrain.precond.curv.kinds import as_loss_spec
from tests._helpers.curv_blocks import masked
from tests._helpers.curv_models import make_case, rel_err


def test_collector_inside_a_training_step_matches_curvature():
    case = make_case("cnn")
    model, loss_fn = case.model, nn.CrossEntropyLoss()
    expected = curvature(
        model, loss_fn, case.inputs, case.ce_targets, kind="ggn", shape="kron"
    )
    reference_grads = torch.autograd.grad(
        loss_fn(model(case.inputs), case.ce_targets), list(model.parameters())
    )
    collector = CurvatureCollector(model, shapes=("kron", "diag"))
    with collector:
        out = model(case.inputs)
        loss = loss_fn(out, case.ce_targets)
        loss.backward(retain_graph=True)  # the ordinary gradient; hooks stay silent
        vectors = output_vectors("ggn", as_loss_spec(loss_fn), out, case.ce_targets)
        collector.accumulate(out, vectors)
    assert not collector._handles
    for p, g in zip(model.parameters(), reference_grads, strict=True):
        assert torch.allclose(p.grad, g)  # .grad untouched by the curvature passes
    stats = collector.statistics()
    for name in ("conv1", "conv2", "fc"):
        assert rel_err(stats[name]["A"][0], expected[name].A) < 1e-12
        assert rel_err(stats[name]["B"][0], expected[name].B) < 1e-12
    assert collector.n_passes == 3  # one pass per class, the whole batch at once
    collector.reset()
    assert collector.statistics()["fc"] == {}


class Reuse(nn.Module):
    """The same Linear applied twice (weight sharing across calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.out = nn.Linear(3, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.fc(torch.tanh(self.fc(x)))))


@pytest.mark.parametrize("shape", ["full", "layer", "unit", "diag"])
def test_module_called_twice_is_exact(shape):
    torch.manual_seed(0)
    model = Reuse().double()
    x = torch.randn(4, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (4,))
    ref = dense_curvature(model, "cross_entropy", x, y, "ggn")
    got = curvature(model, "cross_entropy", x, y, kind="ggn", shape=shape)
    assert rel_err(got.to_dense(), masked(ref, model, shape)) < 1e-10


class CrossAttn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=False, bias=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x, mem):  # x: (N, L, E), mem: (N, S, E)
        q, kv = x.transpose(0, 1), mem.transpose(0, 1)
        pad = torch.zeros(mem.shape[0], mem.shape[1], dtype=torch.bool)
        pad[0, -1] = True
        out, _ = self.attn(q, kv, kv, key_padding_mask=pad, need_weights=False)
        return self.head(out.mean(0))


def test_cross_attention_exact_and_three_kron_sites():
    torch.manual_seed(1)
    model = CrossAttn().double()
    x = torch.randn(3, 2, 4, dtype=torch.float64)
    mem = torch.randn(3, 3, 4, dtype=torch.float64)
    y = torch.randint(0, 2, (3,))
    ref = dense_curvature(model, "cross_entropy", (x, mem), y, "ggn")
    for shape in ("full", "unit", "diag"):
        got = curvature(model, "cross_entropy", (x, mem), y, kind="ggn", shape=shape)
        assert rel_err(got.to_dense(), masked(ref, model, shape)) < 1e-10
    kron = curvature(model, "cross_entropy", (x, mem), y, kind="ggn", shape="kron")
    assert len(kron["attn"].kron) == 3  # q, k, v see different inputs
    v = torch.randn(kron.numel, dtype=torch.float64)
    assert torch.allclose(kron @ v, kron.to_dense() @ v, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("variant", ["plain", "masks", "weights_per_head", "no_bias"])
def test_mha_forward_reproduces_the_module(batch_first, variant):
    torch.manual_seed(2)
    mha = nn.MultiheadAttention(
        6, 3, batch_first=batch_first, bias=variant != "no_bias"
    )
    mha = mha.double()
    shape = (2, 4, 6) if batch_first else (4, 2, 6)
    q = torch.randn(shape, dtype=torch.float64)
    kv = torch.randn(shape, dtype=torch.float64)
    kwargs = {}
    if variant == "masks":
        kwargs["attn_mask"] = torch.randn(4, 4, dtype=torch.float64)
        pad = torch.tensor([[0.0, 0.0, float("-inf"), 0.0]] * 2, dtype=torch.float64)
        kwargs["key_padding_mask"] = pad  # float like attn_mask (torch warns on mixing)
    if variant == "weights_per_head":
        kwargs["average_attn_weights"] = False
    expected = mha(q, kv, kv, **kwargs)
    (out, weights), _ = mha_forward(mha, q, kv, kv, **kwargs)
    assert torch.allclose(out, expected[0], rtol=1e-12, atol=1e-12)
    assert torch.allclose(weights, expected[1], rtol=1e-12, atol=1e-12)


class Functional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return self.fc(x) + F.linear(x, self.fc.weight)  # weight used outside fc


def test_parameters_used_outside_their_module_are_detected():
    model = Functional().double()
    x = torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="'fc'.*outside the module"):
        curvature(
            model,
            "mse",
            x,
            torch.zeros(4, 2, dtype=torch.float64),
            kind="ggn",
            shape="diag",
        )


class Broadcast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Embedding(3, 2)
        self.fc = nn.Linear(2, 1)

    def forward(self, x):  # x: (N, 3, 2); positions without a batch dim
        return self.fc(x + self.pos(torch.arange(3))).sum(1)


def test_module_without_batch_dimension_is_rejected():
    model = Broadcast().double()
    x = torch.randn(5, 3, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="'pos' saw dim 0 of size 3"):
        curvature(
            model,
            "mse",
            x,
            torch.zeros(5, 1, dtype=torch.float64),
            kind="ggn",
            shape="diag",
        )


def test_batchnorm_in_training_mode_is_rejected_but_hessian_works():
    case = make_case("cnn")
    case.model.train()
    with pytest.raises(ValueError, match="'bn'.*couples the examples"):
        curvature(
            case.model,
            "cross_entropy",
            case.inputs,
            case.ce_targets,
            kind="ggn",
            shape="diag",
        )
    ref = dense_curvature(
        case.model, "cross_entropy", case.inputs, case.ce_targets, "hessian"
    )
    got = curvature(
        case.model,
        "cross_entropy",
        case.inputs,
        case.ce_targets,
        kind="hessian",
        shape="layer",
    )
    assert rel_err(got.to_dense(), masked(ref, case.model, "layer")) < 1e-10


def test_ignored_and_frozen_parameters_get_zero_rows():
    case = make_case("mlp")
    case.model.fc2.bias.requires_grad_(False)
    with pytest.raises(ValueError, match="partially frozen"):
        curvature(
            case.model, "mse", case.inputs, case.mse_targets, kind="ggn", shape="full"
        )
    case.model.fc2.weight.requires_grad_(False)
    got = curvature(
        case.model,
        "mse",
        case.inputs,
        case.mse_targets,
        kind="ggn",
        shape="full",
        ignore_modules=["fc1"],
    )
    assert got.to_dense().shape == (25, 25)  # fc2 frozen: only fc1's parameters
    assert torch.count_nonzero(got.to_dense()) == 0
    assert list(got.modules) == []


class SeqFirstSelfAttn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2)  # batch_first=False
        self.fc = nn.Linear(4, 2)

    def forward(self, x):  # x: (N, L, E)
        h = x.transpose(0, 1)
        out, _ = self.attn(h, h, h)
        return self.fc(input=out.mean(0))  # input passed by keyword


def test_sequence_first_self_attention_and_keyword_input():
    torch.manual_seed(0)
    model = SeqFirstSelfAttn().double()
    x = torch.randn(3, 2, 4, dtype=torch.float64)
    y = torch.randint(0, 2, (3,))
    ref = dense_curvature(model, "cross_entropy", x, y, "ggn")
    got = curvature(model, "cross_entropy", x, y, kind="ggn", shape="full")
    assert rel_err(got.to_dense(), ref) < 1e-10
    kron = curvature(model, "cross_entropy", x, y, kind="ggn", shape="kron")
    assert len(kron["attn"].kron) == 1  # one shared input: packed q, k, v factors
    assert kron["attn"].B.shape == (12, 12)
