"""Adjoint MGRIT: exact against autograd through the serial stack, coarse adjoint steps
are transposed forward coarse steps, and the linear problem matches numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from leantrain.layer_parallel import (
    ChunkLayout,
    LayerRNG,
    MGRITOptions,
    StepPropagator,
    adjoint_solve,
    mgrit_solve,
)
from leantrain.layer_parallel.adjoint import AdjointPropagator
from tests._helpers.linear_reference import diagonal_run
from tests._helpers.lp_steps import DiagStep, PairStep, tanh_steps

OFF = LayerRNG(0, enabled=False)


def _forward(steps, x, cf, levels, chunks, iters):
    prop = StepPropagator(steps, 1.0 / len(steps), cf, OFF, record=True)
    layout = ChunkLayout(len(steps), chunks, cf, levels)
    traj, _ = mgrit_solve(prop, x, layout, MGRITOptions(levels, cf, iters, 1, False))
    return prop, layout, traj


def _serial_grads(steps, x, g):
    x = x.detach().requires_grad_()
    y = x
    for s in steps:
        y = s(y, 1.0 / len(steps))
    params = list(steps.parameters())
    grads = torch.autograd.grad(y, [x, *params], g)
    return grads[0], grads[1:]


@pytest.mark.parametrize(
    "n,levels,cf,chunks", [(16, 2, 2, 2), (16, 2, 4, 1), (32, 3, 2, 4), (32, 3, 4, 2)]
)
def test_adjoint_exact_against_serial_autograd(n, levels, cf, chunks):
    steps = tanh_steps(n, 4, scale=2.0)
    x = torch.randn(3, 4, dtype=torch.float64)
    g = torch.randn(3, 4, dtype=torch.float64)
    iters = n // (2 * cf)
    prop, layout, _ = _forward(steps, x, cf, levels, chunks, iters)
    params = [list(s.parameters()) for s in steps]
    gx, grads, traj, stats = adjoint_solve(
        prop, g, layout, MGRITOptions(levels, cf, iters, 1, False), params
    )
    ref_x, ref_p = _serial_grads(steps, x, g)
    assert (gx - ref_x).abs().max() < 1e-12
    assert torch.equal(traj[0], g) and traj[-1] is gx
    for p, r in zip(steps.parameters(), ref_p, strict=True):
        assert (grads[id(p)] - r).abs().max() < 1e-12
    assert stats.converged is True


def test_adjoint_error_falls_with_iterations():
    steps = tanh_steps(32, 4, scale=2.0)
    x = torch.randn(2, 4, dtype=torch.float64)
    g = torch.randn(2, 4, dtype=torch.float64)
    prop, layout, _ = _forward(steps, x, 2, 2, 1, 8)
    ref_x, _ = _serial_grads(steps, x, g)
    errs = []
    for iters in (1, 2, 3, 4):
        opts = MGRITOptions(2, 2, iters)
        gx, _, _, _ = adjoint_solve(prop, g, layout, opts, [[]] * 32)
        errs.append((gx - ref_x).abs().max().item())
    assert errs[-1] > 1e-9  # not yet exact (that takes N/(2cf) + 1 = 9 cycles)
    assert all(b < 0.5 * a for a, b in zip(errs, errs[1:], strict=False))


@pytest.mark.parametrize("level", [1, 2])
def test_coarse_adjoint_step_is_transposed_coarse_step(level):
    n, cf = 16, 2
    steps = tanh_steps(n, 3, scale=2.0)
    x = torch.randn(3, dtype=torch.float64)
    prop, _, _ = _forward(steps, x, cf, 3, 1, 4)
    adj = AdjointPropagator(prop, [[]] * n)
    w = torch.randn(3, dtype=torch.float64)
    scale = cf**level
    for m in range(1, n // scale + 1):
        first = (n // scale - m) * scale  # forward coarse interval's first layer
        u = prop.inputs[first].detach()
        jac = torch.autograd.functional.jacobian(
            lambda v, k=first: steps[k](v, scale / n), u
        )
        assert torch.allclose(adj(level, m, w), jac.T @ w, atol=1e-14, rtol=0)


def test_shared_parameters_accumulate_over_layers():
    torch.manual_seed(0)
    step = PairStep(3).double()
    steps = torch.nn.ModuleList([step] * 8)  # one module, 8 layers
    x = (torch.randn(2, 3, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64))
    g = (torch.randn(2, 3, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64))
    prop, layout, _ = _forward(steps, x, 2, 2, 2, 2)
    params = [list(s.parameters()) for s in steps]
    (gx, gy), grads, _, _ = adjoint_solve(
        prop, g, layout, MGRITOptions(2, 2, 2, 1, False), params
    )
    xs = [t.detach().requires_grad_() for t in x]
    y = tuple(xs)
    for s in steps:
        y = s(y, 1 / 8)
    ref = torch.autograd.grad(y, [*xs, *step.parameters()], g)
    assert (gx - ref[0]).abs().max() < 1e-12 and (gy - ref[1]).abs().max() < 1e-12
    for p, r in zip(step.parameters(), ref[2:], strict=True):
        assert (grads[id(p)] - r).abs().max() < 1e-12


@pytest.mark.parametrize("levels,cf,skip,iters", [(2, 4, True, 3), (3, 2, False, 3)])
def test_linear_adjoint_matches_numpy(levels, cf, skip, iters):
    # Constant diagonal lambda: J^T = J on every level, so the adjoint run from g is
    # the forward MGRIT of the same ODE started at g.
    n, lams = 32, [-2.0, 3.0]
    steps = torch.nn.ModuleList(
        DiagStep(torch.tensor(lams, dtype=torch.float64)) for _ in range(n)
    )
    x = torch.tensor([1.0, 1.0], dtype=torch.float64)
    prop, layout, _ = _forward(steps, x, cf, levels, 1, 1)
    g = [0.3, -1.2]
    opts = MGRITOptions(levels, cf, iters, 1, skip)
    _, _, traj, stats = adjoint_solve(
        prop, torch.tensor(g, dtype=torch.float64), layout, opts, [[]] * n
    )
    hist, u = diagonal_run(lams, g, n, 1 / n, cf, levels, opts.relax, iters, skip)
    np.testing.assert_allclose(stats.history, hist, rtol=1e-10)
    np.testing.assert_allclose(torch.stack(traj).numpy(), u, rtol=1e-12, atol=1e-14)


def test_adjoint_needs_a_recorded_forward():
    steps = tanh_steps(8, 2)
    prop = StepPropagator(steps, 1 / 8, 2, OFF)  # record=False
    with pytest.raises(ValueError, match="no recorded final sweep"):
        adjoint_solve(
            prop, torch.zeros(2), ChunkLayout(8, 1, 2, 2), MGRITOptions(2, 2), [[]] * 8
        )
