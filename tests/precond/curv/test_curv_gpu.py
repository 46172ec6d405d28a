"""CUDA parity with the CPU result (deselected by default; run with ``-m gpu``)."""

from __future__ import annotations

import copy

import pytest
import torch

from leantrain.precond.curv import curvature
from tests._helpers.curv_models import make_case, rel_err


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["full", "kron", "unit", "diag"])
@pytest.mark.parametrize("model_name", ["cnn", "attn", "embed_ln"])
def test_cuda_matches_cpu(model_name, shape):
    if not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device")
    case = make_case(model_name)
    cpu = curvature(
        case.model,
        "cross_entropy",
        case.inputs,
        case.ce_targets,
        kind="ggn",
        shape=shape,
    )
    model = copy.deepcopy(case.model).cuda()
    got = curvature(
        model,
        "cross_entropy",
        case.inputs.cuda(),
        case.ce_targets.cuda(),
        kind="ggn",
        shape=shape,
    )
    assert got.to_dense().is_cuda
    assert rel_err(got.to_dense().cpu(), cpu.to_dense()) < 1e-10
    v = torch.randn(cpu.numel, dtype=torch.float64)
    assert rel_err((got @ v.cuda()).cpu(), cpu @ v) < 1e-10
