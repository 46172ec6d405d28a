"""The phase profiler on 2 gloo ranks: each rank counts its own layer steps, the
messages between the ranks are timed, the phases add up to the step, and the stack
keeps its exchanges and gives the same result as without the profiler."""

from __future__ import annotations

import pytest
import torch

from leantrain.layer_parallel import LayerParallel
from leantrain.layer_parallel.comm import DistExchange
from leantrain.layer_parallel.costs.phase_timer import profile_phases
from leantrain.models.blocks import TransformerBlock
from tests._helpers.launchers import parallelize_over_all_ranks, run_distributed

pytestmark = pytest.mark.distributed


def _worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    blocks = [TransformerBlock(8, 2, causal=True) for _ in range(8)]
    stack = parallelize_over_all_ranks(
        LayerParallel(blocks, cf=2, fwd_iters=1), timeout=60
    )
    x = torch.randn(2, 4, 8)
    plain = stack(x.clone().requires_grad_()).detach()
    xi = x.clone().requires_grad_()
    with profile_phases(stack) as timer, timer.phase("outside"):
        y = stack(xi)
        y.sum().backward()
    return {
        "calls": dict(timer.calls),
        "phases_sum": sum(timer.wall.values()),
        "total": timer.total_wall,
        "same": float(torch.equal(plain, y.detach())),
        "restored": float(
            all(isinstance(ex, DistExchange) for ex in stack._exchanges)
            and "_output" not in stack.__dict__
        ),
    }


def test_profile_phases_on_two_ranks():
    for r in run_distributed(_worker, 2, timeout=120):
        calls = r["calls"]
        # N = 8 on 2 ranks, cf = 2: a skipped cycle's coarse solve (2 coarse steps
        # per rank) and the final sweep (4 steps per rank), in both directions
        assert calls["fwd coarse"] == 2 and calls["fwd final"] == 4
        assert calls["adj coarse"] == 2 and calls["adj final"] == 4
        for phase in ("msg shift", "msg relay", "msg allreduce", "msg broadcast"):
            assert calls[phase] >= 1, (phase, calls)
        assert r["phases_sum"] == pytest.approx(r["total"])
        assert r["same"] == 1.0 and r["restored"] == 1.0
