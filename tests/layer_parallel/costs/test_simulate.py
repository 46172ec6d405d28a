"""The schedule simulator: reproduces the cost model's counts, hand-computed
communication schedules (MGRIT forward and the serial forward with an MGRIT adjoint),
the ideal speedups of DESIGN.md, and validates its input."""

from __future__ import annotations

import itertools
import math

import pytest

from leantrain.layer_parallel import ChunkLayout
from leantrain.layer_parallel.costs import solve_time
from leantrain.layer_parallel.costs.simulate import (
    CommModel,
    LayerTimes,
    OutsideTimes,
    SimResult,
    simulate,
)

CONFIGS = [
    (n, p, levels, cf, k, relax, skip)
    for n, p, levels, cf, k, relax, skip in itertools.product(
        [32, 64], [1, 2, 4, 8], [2, 3], [2, 4], [1, 3], [0, 1], [True, False]
    )
    if (n // p) % cf ** (levels - 1) == 0 and (n + p + k + relax + levels) % 5 == 0
]


@pytest.mark.parametrize("n,p,levels,cf,k,relax,skip", CONFIGS)
def test_unit_times_reproduce_the_cost_model(n, p, levels, cf, k, relax, skip):
    layout = ChunkLayout(n, p, cf, levels)
    expect = solve_time(layout, (relax,) * (levels - 1), k, skip=skip)
    kw = dict(levels=levels, cf=cf, fwd_iters=k, bwd_iters=k, relax=relax)
    fwd = simulate(n, p, LayerTimes(1.0, 0.0, 1.0, 0.0), skip_downcycle=skip, **kw)
    bwd = simulate(n, p, LayerTimes(0.0, 1.0, 0.0, 1.0), skip_downcycle=skip, **kw)
    assert fwd.forward == pytest.approx(expect, abs=1e-9)
    assert bwd.backward == pytest.approx(expect, abs=1e-9)  # adjoint: same schedule
    assert fwd.serial == n and bwd.serial == n


def test_hand_computed_schedule_with_latency():
    # N=8, P=2, L=2, cf=2, one skipped cycle: chunk 0 solves 2 coarse steps (t=2),
    # chunk 1 waits 2+a and solves 2 (4+a); final sweep: shift (4+a), F-relax 2 and
    # C-relax 2 (8+a), residual all-reduce 2a (8+3a), the floor's state-norm
    # all-reduce 2a (8+5a), output broadcast a (8+6a).
    a = 0.25
    r = simulate(8, 2, LayerTimes(1.0, 0.0), cf=2, fwd_iters=1, comm=CommModel(a))
    assert r.forward == pytest.approx(8 + 6 * a)
    bw = CommModel(latency=0.0, bandwidth=100.0)
    r = simulate(8, 2, LayerTimes(1.0, 0.0), cf=2, fwd_iters=1, comm=bw, state_bytes=50)
    # two 50-byte state messages and two all-reduces of one 8-byte float
    assert r.forward == pytest.approx(8 + 2 * 0.5 + 2 * (2 * 0.08))


@pytest.mark.parametrize("n,p,levels,cf,k,relax,skip", CONFIGS[::3])
def test_serial_forward_costs_n_steps_and_keeps_the_adjoint_schedule(
    n, p, levels, cf, k, relax, skip
):
    layout = ChunkLayout(n, p, cf, levels)
    kw = dict(levels=levels, cf=cf, bwd_iters=k, relax=relax, skip_downcycle=skip)
    fwd = simulate(n, p, LayerTimes(0.0, 0.0, 1.0, 0.0), forward_solver="serial", **kw)
    assert fwd.forward == pytest.approx(n)  # no parallelism in the exact forward
    bwd = simulate(n, p, LayerTimes(0.0, 1.0, 0.0, 1.0), forward_solver="serial", **kw)
    expect = solve_time(layout, (relax,) * (levels - 1), k, skip=skip)
    assert bwd.backward == pytest.approx(expect, abs=1e-9)


def test_hand_computed_serial_forward_schedule():
    # N=8, P=2, cf=2, L=2, latency a; forward_record 2, VJP 1, VJP+params 1.
    # Forward: chunk 0 records 4 layers (t=8), chunk 1 waits 8+a and records 4
    # (16+a), output broadcast a: 16+2a. Adjoint, one skipped cycle: a coarse step
    # recomputes the layer with its graph and applies its VJP (2+1): chunk 0 two
    # (6), chunk 1 waits 6+a and does two (12+a); final sweep after the shift: 2 F
    # and 2 C VJPs with parameters (16+a), two all-reduces 2a each (16+5a), input
    # gradient broadcast a: 16+6a. The step adds the batch-seed broadcast a.
    a = 0.25
    times = LayerTimes(forward=1.0, backward=1.0, forward_record=2.0)
    kw = dict(cf=2, bwd_iters=1, comm=CommModel(a), forward_solver="serial")
    r = simulate(8, 2, times, **kw)
    assert r.forward == pytest.approx(16 + 2 * a)
    assert r.backward == pytest.approx(16 + 6 * a)
    assert r.step == pytest.approx(32 + 9 * a)
    assert r.serial == pytest.approx(8 * 3.0)
    mgrit = simulate(8, 2, times, cf=2, bwd_iters=1, comm=CommModel(a))
    assert mgrit.backward == r.backward  # the adjoint does not depend on the forward


@pytest.mark.parametrize("p,cf,expect", [(2, 4, 4 / 3), (4, 4, 2.0), (8, 4, 8 / 3)])
def test_ideal_forward_speedup_of_design_md(p, cf, expect):
    # TorchBraid default (F-relaxation, skip, one cycle, L=2): S = 1/(1/cf + 1/P)
    r = simulate(64, p, LayerTimes(1.0, 0.0), cf=cf, fwd_iters=1, relax=0)
    assert 64 / r.forward == pytest.approx(expect)


def test_more_ranks_help_only_while_communication_is_cheap():
    t = LayerTimes(1.0, 2.0, 1.2, 2.5)
    kw = dict(levels=2, cf=4, fwd_iters=1, bwd_iters=1, state_bytes=1e3)
    free = [simulate(128, p, t, **kw).speedup for p in (2, 4, 8, 16, 32)]
    assert free == sorted(free)
    slow = CommModel(latency=5.0)  # a message costs five layer steps
    costly = [simulate(128, p, t, comm=slow, **kw).speedup for p in (2, 4, 8, 16, 32)]
    assert all(c < f for c, f in zip(costly, free, strict=True))
    assert costly[-1] < costly[2]


def test_result_and_validation():
    r = SimResult(forward=1.0, backward=2.0, step=3.0, serial=6.0)
    assert r.speedup == 2.0
    assert LayerTimes(1.0, 2.0).serial_step == 3.0
    with pytest.raises(ValueError, match="divisible by cf"):
        simulate(16, 2, LayerTimes(1.0, 1.0), cf=4, levels=3)
    with pytest.raises(ValueError, match="LayerTimes.forward must be finite"):
        LayerTimes(-1.0, 1.0)
    with pytest.raises(ValueError, match="forward_solver must be one of"):
        simulate(16, 2, LayerTimes(1.0, 1.0), forward_solver="pipeline")
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        CommModel(bandwidth=0.0)
    with pytest.raises(ValueError, match="latency must be finite"):
        CommModel(latency=math.nan)


def test_outside_work_is_charged_per_rank_and_to_serial():
    # one rank's outside work: embed + head fwd + head bwd + AdamW over the
    # embedding/head + N/P layers' AdamW; the serial step pays it for all N layers
    out = OutsideTimes(0.1, 0.2, 0.3, 0.05, 0.01)
    assert out.step(16) == pytest.approx(0.61 + 16 * 0.05)
    t = LayerTimes(1.0, 2.0, 3.0, 4.0)
    for solver in ("mgrit", "serial"):
        kw = dict(cf=4, fwd_iters=1, forward_solver=solver)
        bare = simulate(64, 4, t, **kw)
        r = simulate(64, 4, t, outside=out, **kw)
        assert r.step == pytest.approx(bare.step + 0.61 + 16 * 0.05)
        assert r.serial == pytest.approx(64 * 7.0 + 0.61 + 64 * 0.05)
        assert (r.forward, r.backward) == (bare.forward, bare.backward)
    with pytest.raises(ValueError, match="OutsideTimes.head_forward"):
        OutsideTimes(0.0, -1.0)
