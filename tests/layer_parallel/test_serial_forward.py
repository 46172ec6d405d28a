"""The serial-forward / MGRIT-adjoint mode (``forward_solver="serial"``).

The forward is exact serial stepping; only the adjoint is an MGRIT solve. Checked
against the serial network (a ``ResidualStack`` of the same blocks with plain
autograd) in float64: the output always to 1e-12, the gradients to 1e-10 once the
adjoint runs to exactness, and an inexact adjoint shows in the gradient and in the
reported adjoint residuals.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from leantrain.layer_parallel import LayerParallel
from leantrain.models import ResidualStack, TransformerBlock

D = 8


def _blocks(n: int) -> nn.ModuleList:
    torch.manual_seed(0)
    blocks = nn.ModuleList(TransformerBlock(D, 2, causal=True) for _ in range(n))
    for m in blocks.modules():  # far from the identity: inexact adjoints show up
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.5 / D**0.5)
    return blocks.double()


def _run(stack: nn.Module, x: torch.Tensor, w: torch.Tensor):
    """Output, input gradient and parameter gradients of ``sum(stack(x) * w)``."""
    x = x.clone().requires_grad_()
    y = stack(x)
    (y * w).sum().backward()
    grads = [p.grad.clone() for p in stack.parameters()]
    return y.detach(), x.grad, grads


def _max_diff(a, b) -> float:
    return max((s - t).abs().max().item() for s, t in zip(a, b, strict=True))


def _inputs():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, D, generator=g, dtype=torch.float64)
    return x, torch.randn(2, 5, D, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("levels,cf,n,chunks", [(2, 2, 8, 2), (3, 2, 8, 1)])
def test_exact_adjoint_gives_the_serial_gradients(levels, cf, n, chunks):
    blocks = _blocks(n)
    ref = ResidualStack(copy.deepcopy(blocks), t_final=1.0)
    # skip_downcycle=False: N / (2 cf) cycles are exact (docs/layer_parallel.md)
    stack = LayerParallel(
        blocks,
        levels=levels,
        cf=cf,
        chunks=chunks,
        bwd_iters=n // (2 * cf),
        skip_downcycle=False,
        forward_solver="serial",
    )
    x, w = _inputs()
    ry, rx, rg = _run(ref, x, w)
    py, px, pg = _run(stack, x, w)
    assert (ry - py).abs().max().item() < 1e-12
    assert (rx - px).abs().max().item() < 1e-10
    assert _max_diff(rg, pg) < 1e-10
    stats = stack.stats
    assert stats.mode == "parallel" and stats.forward is None
    assert stats.serial_steps == n
    assert stats.backward.iterations == n // (2 * cf)
    assert stats.layer_steps == n + stats.backward.total_work


def test_inexact_adjoint_keeps_the_forward_exact_and_reports_it():
    n = 16
    blocks = _blocks(n)
    ref = ResidualStack(copy.deepcopy(blocks), t_final=1.0)
    stack = LayerParallel(blocks, cf=2, bwd_iters=1, forward_solver="serial")
    x, w = _inputs()
    ry, rx, rg = _run(ref, x, w)
    py, px, pg = _run(stack, x, w)
    assert (ry - py).abs().max().item() < 1e-12  # the forward is the serial one
    grad_error = max((rx - px).abs().max().item(), _max_diff(rg, pg))
    assert grad_error > 1e-8  # one adjoint cycle on 16 layers is not exact
    back = stack.stats.backward
    assert back.iterations == 1 and back.final_residual > 1e-8
    assert back.converged is not False  # inexact, but contracting

    # the same module with the MGRIT forward: its forward is not exact
    stack.forward_solver = "mgrit"
    stack.set_iterations(fwd=1)
    my, _, _ = _run(stack, x, w)
    assert (ry - my).abs().max().item() > 1e-8
    assert stack.stats.forward is not None


def test_no_grad_forward_is_serial_too():
    blocks = _blocks(8)
    ref = ResidualStack(copy.deepcopy(blocks), t_final=1.0)
    stack = LayerParallel(blocks, cf=2, chunks=2, forward_solver="serial")
    x, _ = _inputs()
    with torch.no_grad():
        assert (ref(x) - stack(x)).abs().max().item() < 1e-12
    assert stack.stats.forward is None and stack.stats.serial_steps == 8


def test_forward_solver_is_validated():
    with pytest.raises(ValueError, match="forward_solver must be one of"):
        LayerParallel(_blocks(4), cf=2, forward_solver="pipelined")
    stack = LayerParallel(_blocks(4), cf=2)
    with pytest.raises(ValueError, match="forward_solver must be one of"):
        stack.forward_solver = "Serial"
    assert stack.forward_solver == "mgrit"
    assert "forward_solver=serial" in repr(
        LayerParallel(_blocks(4), cf=2, forward_solver="serial")
    )
