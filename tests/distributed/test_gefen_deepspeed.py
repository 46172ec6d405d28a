"""Gefen as the client optimizer of DeepSpeed ZeRO-3 (CPU accelerator, gloo).

DeepSpeed is optional (``pip install --no-deps deepspeed`` plus its small pure-Python
requirements); without it this module is skipped. ZeRO hands the client optimizer
one flat fp32 partition per rank, so Gefen's partition and codebook follow that
partition, not the model's tensors (docs/distributed.md); what is checked here is
that training works and every rank holds consistent, finite state.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests._helpers.launchers import run_distributed

pytest.importorskip("deepspeed")


def zero3(rank: int, world: int) -> dict:
    import deepspeed

    from leantrain.optim import Gefen

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 37), nn.Tanh(), nn.Linear(37, 48))
    opt = Gefen(model.parameters(), lr=1e-2)
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=opt, config=config, dist_init_required=False
    )
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 12, generator=g), torch.randn(16, 48, generator=g)
    losses = []
    for _ in range(10):
        part = slice(rank * 8, (rank + 1) * 8)
        loss = (engine(x[part]) - y[part]).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    states = list(opt.state.values())
    return {
        "losses": losses,
        "numel": [p.numel() for g in opt.param_groups for p in g["params"]],
        "finite": all(bool(torch.isfinite(s["exp_avg_sq"]).all()) for s in states),
        "states": len(states),
    }


@pytest.mark.slow
def test_zero3_trains_with_gefen():
    results = run_distributed(zero3, 2, timeout=600)
    for out in results:
        assert out["states"] >= 1 and out["finite"]
        assert out["losses"][-1] < 0.7 * out["losses"][0]
