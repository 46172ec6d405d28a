"""K-FAC, EKFAC, Shampoo, PSGD and K-BFGS under DistributedDataParallel (gloo).

Every method runs in ONE spawned group per world size (spawning dominates the cost):
on each rank the preconditioned gradient of every step must equal the
single-process one on the union batch to 1e-6 (relative), curvature steps (which
bypass the DDP wrapper and average by hand) and plain DDP steps alike.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leantrain.precond import PreconditioningConfig
from leantrain.precond.methods.ekfac import EkfacGradientMaker
from leantrain.precond.methods.kbfgs import KbfgsGradientMaker
from leantrain.precond.methods.kfac import KfacGradientMaker
from leantrain.precond.methods.psgd import PsgdGradientMaker
from leantrain.precond.methods.shampoo import ShampooGradientMaker
from tests._helpers.launchers import run_distributed

pytestmark = pytest.mark.distributed

BATCH, STEPS = 8, 4
EMA = PreconditioningConfig(
    curvature_interval=2, preconditioner_interval=2, ema_decay=0.8, damping=1e-2
)
PLAIN = PreconditioningConfig(curvature_interval=2, preconditioner_interval=2)


def _makers():
    return {
        "kfac_emp_pi": lambda m: KfacGradientMaker(m, EMA, fisher_type="fisher_emp"),
        "kfac_exact_exact": lambda m: KfacGradientMaker(
            m, EMA, fisher_type="fisher_exact", damping_mode="exact"
        ),
        "ekfac_emp": lambda m: EkfacGradientMaker(m, EMA, fisher_type="fisher_emp"),
        "shampoo": lambda m: ShampooGradientMaker(m, EMA),
        "psgd_hvp": lambda m: PsgdGradientMaker(m, PLAIN, precond_lr=0.1),
        "psgd_whitening": lambda m: PsgdGradientMaker(
            m, PLAIN, mode="whitening", precond_lr=0.1
        ),
        "kbfgs": lambda m: KbfgsGradientMaker(m, EMA),
    }


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3)
    ).double()


def _data(step: int):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, 4, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 3, (BATCH,), generator=g)


def _train(name: str, rank: int, world_size: int) -> list[dict[str, torch.Tensor]]:
    model = _model()
    wrapped = model
    if world_size > 1:
        wrapped = nn.parallel.DistributedDataParallel(model)
    gm = _makers()[name](wrapped)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    shard = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
    history = []
    for step in range(STEPS):
        x, t = _data(step)
        opt.zero_grad()
        y = gm.setup_model_call(wrapped, x[shard])
        gm.setup_loss_call(F.cross_entropy, y, t[shard])
        gm.forward_and_backward()
        history.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return history


def _worker(rank: int, world_size: int) -> dict:
    return {name: _train(name, rank, world_size) for name in _makers()}


@pytest.fixture(scope="module")
def single_process() -> dict:
    return {name: _train(name, 0, 1) for name in _makers()}


# Spawning is dominated by importing torch and torch._dynamo (DDP) in every process:
# ~40 s for two ranks and ~80 s for four on the loaded 2-core machine, so four ranks
# run with the slow tests.
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_every_method_matches_union_batch(world_size, single_process):
    results = run_distributed(_worker, world_size, timeout=240)
    for rank, per_method in enumerate(results):
        for name, history in per_method.items():
            for step, (got, want) in enumerate(
                zip(history, single_process[name], strict=True)
            ):
                for pname, g in got.items():
                    err = float((g - want[pname]).norm() / want[pname].norm())
                    assert err < 1e-6, (world_size, rank, name, step, pname, err)
