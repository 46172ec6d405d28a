"""The same parity checks on a CUDA device (deselected by default; run ``-m gpu``)."""

from __future__ import annotations

import pytest
import torch

from leantrain.layer_parallel import LayerParallel
from leantrain.models.blocks import TransformerBlock

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_cuda_parallel_equals_serial(dropout):
    torch.manual_seed(0)
    blocks = [TransformerBlock(16, 2, causal=True, dropout=dropout) for _ in range(16)]
    stack = LayerParallel(blocks, cf=4, fwd_iters=2, bwd_iters=2, skip_downcycle=False)
    stack = stack.double().cuda().train()
    x = torch.randn(2, 8, 16, dtype=torch.float64, device="cuda", requires_grad=True)
    results = []
    for mode in ("parallel", "serial"):
        getattr(stack, mode)()
        stack.zero_grad()
        x.grad = None
        torch.manual_seed(3)
        y = stack(x)
        y.pow(2).sum().backward()
        grads = [p.grad.clone() for p in stack.parameters()]
        results.append((y.detach(), x.grad.clone(), grads))
    (yp, gxp, gp), (ys, gxs, gs) = results
    assert (yp - ys).abs().max() < 1e-10
    assert (gxp - gxs).abs().max() < 1e-10
    assert max((a - b).abs().max() for a, b in zip(gp, gs, strict=True)) < 1e-10
