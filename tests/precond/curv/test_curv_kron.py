"""Kronecker factors: exact where K-FAC is exact, and equal to direct computations."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import hessian

from leantrain.precond.curv import curvature, dense_curvature
from tests._helpers.curv_blocks import masked, module_groups
from tests._helpers.curv_models import make_case, rel_err


@pytest.mark.parametrize("kind", ["ggn", "fisher_exact", "fisher_emp"])
@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
def test_kron_exact_for_single_example_linear(kind, loss):
    case = make_case("mlp", n=1)
    targets = case.ce_targets if loss == "cross_entropy" else case.mse_targets
    ref = dense_curvature(case.model, loss, case.inputs, targets, kind)
    got = curvature(case.model, loss, case.inputs, targets, kind=kind, shape="kron")
    # every module is a Linear on a non-sequence input: B ⊗ A is each exact block
    assert rel_err(got.to_dense(), masked(ref, case.model, "layer")) < 1e-10
    assert got["fc1"].A.shape == (5, 5)  # 4 inputs + the bias coordinate
    assert got["fc1"].B.shape == (5, 5)


def _capture(model, module):
    store = {}

    def hook(mod, args, output):
        store["x"] = args[0]
        store["y"] = output

    handle = module.register_forward_hook(hook)
    return store, handle


def _direct_factors(case, module_name, loss_fn, targets, layout):
    """A from the captured inputs, B from J_y^T (d2L/dz2) J_y of the module output."""
    model = case.model
    module = dict(model.named_modules())[module_name]
    store, handle = _capture(model, module)
    z = model(case.inputs)
    handle.remove()
    x, y = store["x"], store["y"]
    n = z.shape[0]
    rows = []
    for j in range(z.numel()):
        (g,) = torch.autograd.grad(z.reshape(-1)[j], y, retain_graph=True)
        rows.append(g.reshape(-1))
    jac = torch.stack(rows)  # (Nz, Ny)
    h = hessian(
        lambda out: loss_fn(out.reshape(-1, out.shape[-1]), targets.reshape(-1))
    )(z.detach()).reshape(z.numel(), z.numel())
    g_y = (jac.T @ h @ jac).detach()  # GGN w.r.t. the module output
    if layout == "conv":  # y: (N, C, H, W): positions are pixels
        c = y.shape[1]
        g_y = g_y.reshape(n, c, -1, n, c, y[0, 0].numel())
        b = torch.einsum("nilnjl->ij", g_y)
        a = F.unfold(
            x, module.kernel_size, module.dilation, module.padding, module.stride
        )
        a = a.transpose(1, 2)
    else:  # (N, *, I): positions are the middle dims
        i = y.shape[-1]
        g_y = g_y.reshape(n, -1, i, n, y[0].numel() // i, i)
        keep = torch.ones(n, g_y.shape[1], dtype=z.dtype)
        if layout == "embedding":
            # torch never updates the padding row: padding positions are not data
            keep = (x != module.padding_idx).to(z.dtype).reshape(n, -1)
            a = F.one_hot(x, module.num_embeddings).to(z.dtype)
            a = a.reshape(n, -1, module.num_embeddings) * keep.unsqueeze(-1)
        b = torch.einsum("ntintj,nt->ij", g_y, keep)
        if layout != "embedding":
            a = x.reshape(n, -1, x.shape[-1])
    if getattr(module, "bias", None) is not None:
        a = torch.cat([a, torch.ones(*a.shape[:-1], 1, dtype=a.dtype)], -1)
    a = a.reshape(-1, a.shape[-1])
    return a.T @ a / n, b


@pytest.mark.parametrize(
    "model_name, module_name, layout",
    [
        ("mlp", "fc1", "linear"),
        ("cnn", "conv1", "conv"),
        ("cnn", "conv2", "conv"),
        ("embed_ln", "fc", "linear"),  # sequence Linear (N, T, D)
        ("embed_ln", "emb", "embedding"),
    ],
)
def test_kron_factors_match_direct_computation(model_name, module_name, layout):
    case = make_case(model_name, n=4)
    loss = nn.CrossEntropyLoss(reduction="sum")
    got = curvature(
        case.model, loss, case.inputs, case.ce_targets, kind="ggn", shape="kron"
    )
    a, b = _direct_factors(case, module_name, loss, case.ce_targets, layout)
    assert rel_err(got[module_name].A, a) < 1e-10
    assert rel_err(got[module_name].B, b) < 1e-10


@pytest.mark.parametrize("zero_gamma", [False, True])
def test_kron_keeps_exact_unit_blocks_for_normalization_layers(zero_gamma):
    # x̂ is read back from the BatchNorm output as (y - β) / γ; a zero γ takes the
    # normalization route instead (its unit block is still exact).
    case = make_case("cnn")
    if zero_gamma:
        with torch.no_grad():
            case.model.bn.weight[1] = 0.0
            case.model.bn1d.weight[0] = 0.0
    loss = nn.CrossEntropyLoss()
    ref = dense_curvature(case.model, loss, case.inputs, case.ce_targets, "ggn")
    got = curvature(
        case.model, loss, case.inputs, case.ce_targets, kind="ggn", shape="kron"
    )
    unit = masked(ref, case.model, "unit")
    for name in ("bn", "bn1d"):
        idx = torch.tensor(module_groups(case.model)[name])
        block = got.to_dense()[idx.unsqueeze(-1), idx.unsqueeze(-2)]
        assert rel_err(block, unit[idx.unsqueeze(-1), idx.unsqueeze(-2)]) < 1e-10
        with pytest.raises(ValueError, match="Kronecker factor pairs"):
            _ = got[name].A


def test_kron_self_attention_packs_qkv_into_one_factor_pair():
    case = make_case("attn", n=3)
    got = curvature(
        case.model,
        "cross_entropy",
        case.inputs,
        case.ce_targets,
        kind="ggn",
        shape="kron",
    )
    part = got["attn"]
    assert len(part.kron) == 1
    assert part.A.shape == (5, 5) and part.B.shape == (12, 12)
    # A is the second moment of the attention input (with the bias coordinate)
    store, handle = _capture(case.model, case.model.attn)
    case.model(case.inputs)
    handle.remove()
    h = store["x"]
    h = torch.cat([h, torch.ones(*h.shape[:-1], 1, dtype=h.dtype)], -1).reshape(-1, 5)
    assert rel_err(part.A, h.T @ h / 3) < 1e-12


def test_kron_exact_for_attention_on_one_token():
    """One example, one position: every linear map (in_proj, out_proj, embeddings,
    head) is K-FAC-exact; LayerNorm keeps its exact unit blocks."""
    case = make_case("attn", n=1, seq=1)
    loss = nn.CrossEntropyLoss()
    ref = dense_curvature(case.model, loss, case.inputs, case.ce_targets, "ggn")
    got = curvature(
        case.model, loss, case.inputs, case.ce_targets, kind="ggn", shape="kron"
    )
    groups = module_groups(case.model)
    layer, unit = masked(ref, case.model, "layer"), masked(ref, case.model, "unit")
    dense = got.to_dense()
    for name, idx in groups.items():
        idx = torch.tensor(idx)
        sub = (idx.unsqueeze(-1), idx.unsqueeze(-2))
        expected = unit[sub] if name == "ln" else layer[sub]
        assert rel_err(dense[sub], expected) < 1e-10, name
    assert float(got["attn.out_proj"].B.norm()) > 0


@pytest.mark.parametrize(
    "conv",
    [
        dict(kernel_size=3, padding=1),
        dict(kernel_size=(3, 2), stride=(2, 1), dilation=(1, 2), padding=(2, 0)),
        dict(kernel_size=2, stride=2, bias=False),
        dict(kernel_size=3, padding="same", dilation=2),
    ],
)
def test_conv_input_factor_equals_unfold_definition(conv):
    # A comes from kernel-major patches permuted back to the weight's (C, kh, kw)
    # order; the definition uses F.unfold in that order directly.
    torch.manual_seed(0)
    layer = nn.Conv2d(3, 4, **conv).double()
    x = torch.randn(5, 3, 7, 6, dtype=torch.float64)
    model = nn.Sequential(layer, nn.Flatten())
    out = model(x)
    targets = torch.randint(0, out.shape[1], (5,))
    got = curvature(model, "cross_entropy", x, targets, kind="ggn", shape="kron")
    pad = layer.padding
    if isinstance(pad, str):
        sizes = zip(layer.dilation, layer.kernel_size, strict=True)
        pad = tuple(d * (k - 1) // 2 for d, k in sizes)
    cols = F.unfold(x, layer.kernel_size, layer.dilation, pad, layer.stride)
    a = cols.transpose(1, 2).reshape(-1, cols.shape[1])
    if layer.bias is not None:
        a = torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype)], 1)
    torch.testing.assert_close(got["0"].A, a.T @ a / 5, rtol=1e-12, atol=1e-12)
