"""NG-family makers under DDP: each rank's gradient equals the union-batch one.

One spawned gloo group per world size runs every method (spawning is slow on the
shared 2-core machine). Each method takes three steps with curvature interval 2
(steps 0 and 2 are curvature steps outside the DDP wrapper, step 1 reuses the stale
preconditioner on a gradient averaged by DDP itself); Hessian-free needs interval 1.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from leantrain.precond import PreconditioningConfig
from leantrain.precond.methods.hessian_free import HessianFreeGradientMaker
from leantrain.precond.methods.natural_gradient import NaturalGradientMaker
from leantrain.precond.methods.newton import NewtonGradientMaker
from leantrain.precond.methods.seng import SengGradientMaker
from leantrain.precond.methods.smw_ng import SmwNgGradientMaker
from tests._helpers.launchers import run_distributed

pytestmark = pytest.mark.distributed

UNION = 8  # examples in the union batch (divisible by 2 and 4)
EVERY2 = PreconditioningConfig(
    damping=0.1, curvature_interval=2, preconditioner_interval=2
)
EVERY1 = PreconditioningConfig(damping=0.3)

METHODS = {
    **{
        f"ng_{shape}": (
            lambda m, s=shape: NaturalGradientMaker(
                m, EVERY2, fisher_type="fisher_exact", shape=s
            )
        )
        for shape in ("full", "layer", "unit", "diag")
    },
    "ng_diag_emp": lambda m: NaturalGradientMaker(
        m, EVERY2, fisher_type="fisher_emp", shape="diag"
    ),
    "smw_ng": lambda m: SmwNgGradientMaker(m, EVERY2),
    # a sketch of 5 of the 8 union examples: every rank draws the same ones
    "seng": lambda m: SengGradientMaker(
        m, EVERY2, sketching_size=5, truncated_rank=3, seed=4
    ),
    "hf_ggn": lambda m: HessianFreeGradientMaker(m, EVERY1, max_iters=10),
    "hf_hessian": lambda m: HessianFreeGradientMaker(
        m, EVERY1, curvature="hessian", max_iters=10
    ),
    "newton": lambda m: NewtonGradientMaker(m, EVERY2, absolute=True),
}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.ln = nn.LayerNorm(6)
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.ln(self.fc1(x))))


def _step(gm, model, x, t) -> list[torch.Tensor]:
    for p in model.parameters():
        p.grad = None
    y = gm.setup_model_call(model, x)
    gm.setup_loss_call(F.cross_entropy, y, t)
    gm.forward_and_backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def _compare(rank: int, world_size: int) -> dict[str, float]:
    torch.manual_seed(0)
    base = Net().double()
    errors = {}
    for name, make in METHODS.items():
        ref = copy.deepcopy(base)
        ref_gm = make(ref)
        local = copy.deepcopy(base)
        ddp = nn.parallel.DistributedDataParallel(local)
        gm = make(ddp)
        worst = 0.0
        for step in range(3):
            gen = torch.Generator().manual_seed(100 + step)
            x = torch.randn(UNION, 4, generator=gen, dtype=torch.float64)
            t = torch.randint(0, 3, (UNION,), generator=gen)
            shard = slice(rank * UNION // world_size, (rank + 1) * UNION // world_size)
            expected = _step(ref_gm, ref, x, t)
            got = _step(gm, ddp, x[shard], t[shard])
            for e, g in zip(expected, got, strict=True):
                scale = max(1.0, float(e.abs().max()))
                worst = max(worst, float((e - g).abs().max()) / scale)
        errors[name] = worst
        dist.barrier()
    return errors


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_method_matches_union_batch(world_size):
    results = run_distributed(_compare, world_size, timeout=240.0)
    for rank, errors in enumerate(results):
        assert set(errors) == set(METHODS)
        bad = {k: v for k, v in errors.items() if not v < 1e-6}
        assert not bad, f"rank {rank}: {bad}"
