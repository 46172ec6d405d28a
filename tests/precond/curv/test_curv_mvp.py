"""Matrix-vector products agree with the dense form, for every representation."""

from __future__ import annotations

import pytest
import torch

from leantrain.precond.curv import curvature
from tests._helpers.curv_models import make_case


@pytest.mark.parametrize("shape", ["full", "layer", "kron", "unit", "diag"])
@pytest.mark.parametrize("model_name", ["cnn", "attn", "embed_ln"])
def test_mvp_matches_dense(model_name, shape):
    case = make_case(model_name)
    got = curvature(
        case.model,
        "cross_entropy",
        case.inputs,
        case.ce_targets,
        kind="ggn",
        shape=shape,
    )
    dense = got.to_dense()
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(dense.shape[0], generator=gen, dtype=dense.dtype)
    assert torch.allclose(got.mvp(v), dense @ v, rtol=1e-10, atol=1e-12)
    assert torch.allclose(got @ v, dense @ v, rtol=1e-10, atol=1e-12)
    params = list(case.model.parameters())
    pieces, start = [], 0
    for p in params:
        pieces.append(v[start : start + p.numel()].reshape(p.shape))
        start += p.numel()
    out = got @ pieces
    assert [t.shape for t in out] == [p.shape for p in params]
    assert torch.allclose(
        torch.cat([t.reshape(-1) for t in out]), dense @ v, rtol=1e-10, atol=1e-12
    )
    assert torch.allclose(got.diagonal(), dense.diagonal(), rtol=1e-12, atol=1e-14)
    # per-module blocks
    for part in got.modules.values():
        sub = dense[part.index.unsqueeze(-1), part.index.unsqueeze(-2)]
        assert torch.allclose(part.to_dense(), sub, rtol=1e-12, atol=1e-14)
        assert torch.allclose(
            part.mvp(v[part.index]), sub @ v[part.index], rtol=1e-10, atol=1e-12
        )
