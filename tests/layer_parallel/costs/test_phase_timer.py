"""The phase profiler: layer steps counted by kind as the simulator charges them,
exclusive times that add up, and everything restored afterwards."""

import pytest
import torch

from leantrain.layer_parallel import LayerParallel
from leantrain.layer_parallel.adjoint import AdjointPropagator
from leantrain.layer_parallel.costs.phase_timer import (
    PhaseTimer,
    charged,
    profile_phases,
)
from leantrain.layer_parallel.costs.simulate import LayerTimes, simulate
from leantrain.layer_parallel.ode import StepPropagator
from leantrain.models.blocks import TransformerBlock


def test_phase_timer_times_are_exclusive_and_add_up():
    timer = PhaseTimer()
    with timer.phase("outer"):
        sum(range(10_000))
        with timer.phase("inner"):
            sum(range(10_000))
        with timer.phase("inner"):
            pass
    assert timer.calls == {"outer": 1, "inner": 2}
    assert timer.wall["outer"] > 0 and timer.wall["inner"] > 0
    assert timer.total_wall == pytest.approx(sum(timer.wall.values()))
    table = timer.table(charged={"inner": 1e-3}).splitlines()
    assert table[0].startswith("| phase | calls | wall ms | CPU ms | simulator ms")
    assert "| inner | 2 |" in table[2] + table[3] and table[-1].startswith("| total")
    timer.reset()
    assert not timer.wall and not timer.calls


@pytest.mark.parametrize("fwd_iters", [1, 2])
def test_profiled_step_counts_what_the_simulator_charges(fwd_iters):
    torch.manual_seed(0)
    stack = LayerParallel(
        [TransformerBlock(8, 2, causal=True) for _ in range(8)],
        cf=2,
        fwd_iters=fwd_iters,
    )
    x = torch.randn(2, 4, 8, requires_grad=True)
    with profile_phases(stack) as timer, timer.phase("outside"):
        stack(x).sum().backward()
    # N = 8, cf = 2, one chunk: the skipped first cycle is a coarse solve of 4
    # steps; a second cycle relaxes (F: 4, C: 4, F: 4, residual: 4 steps) and solves
    # the coarse level with 4 tau steps and 4 solve steps; the final sweep is 8
    # recorded steps. The adjoint (one skipped cycle) recomputes 4 coarse steps.
    fwd_coarse = 4 if fwd_iters == 1 else 12
    assert timer.calls["fwd coarse"] == fwd_coarse
    assert timer.calls.get("fwd relax", 0) == (0 if fwd_iters == 1 else 16)
    assert timer.calls["fwd final"] == 8 and timer.calls["adj final"] == 8
    assert timer.calls["adj coarse"] == 4 and "adj relax" not in timer.calls
    # with distinct layer times the simulator's one-chunk step is exactly the
    # charge for these calls (no messages, no outside work)
    t = LayerTimes(1.0, 2.0, 3.0, 4.0)
    sim = simulate(8, 1, t, cf=2, fwd_iters=fwd_iters)
    assert sum(charged(timer.calls, t).values()) == pytest.approx(sim.step)
    # everything is put back
    assert StepPropagator.__call__.__qualname__ == "StepPropagator.__call__"
    assert AdjointPropagator.__call__.__qualname__ == "AdjointPropagator.__call__"
    assert "_solve_forward" not in stack.__dict__ and stack._exchanges is None
