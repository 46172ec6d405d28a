"""The step-cost counts against torch's own FLOP counter (the slow obvious reference):
``forward_backward_macs`` against a counted forward and backward, ``application_macs``
against a counted ``precondition()`` of a step that refreshes nothing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from leantrain.models.gpt import GPT, GPTConfig, lm_loss
from leantrain.precond import KfacGradientMaker, PreconditioningConfig
from leantrain.precond.step_cost import (
    application_macs,
    forward_backward_macs,
    schedule_mean_step,
)


def _counted_macs(fn) -> float:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops() / 2  # a multiply-add is two FLOPs


def test_forward_backward_macs_equal_the_counted_pass_of_a_gpt():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, d_model=64, n_head=2, block_size=16))
    x = torch.randint(0, 256, (3, 16))
    counted = _counted_macs(lambda: lm_loss(model(x), x).backward())
    assert forward_backward_macs(model, 16) * x.numel() == counted


def test_application_macs_equal_a_counted_kfac_plain_step():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(12, 20, bias=False), nn.Tanh(), nn.Linear(20, 6, bias=False)
    )
    # Refreshed once, at step 0; step 1 only applies the stored inverses.
    config = PreconditioningConfig(curvature_interval=100, preconditioner_interval=100)
    gm = KfacGradientMaker(model, config, fisher_type="fisher_emp")
    x, t = torch.randn(32, 12), torch.randint(0, 6, (32,))
    for _ in range(2):
        model.zero_grad()
        gm.setup_loss_call(F.cross_entropy, gm.setup_model_call(model, x), t)
        gm.forward_and_backward()
    with torch.no_grad():
        counted = _counted_macs(gm.precondition)
    assert application_macs(gm) == counted == 20 * 12 * 32 + 6 * 20 * 26


def test_forward_backward_macs_refuses_a_bad_context():
    with pytest.raises(ValueError, match="context must be a positive int, got 0"):
        forward_backward_macs(nn.Linear(2, 2), 0)


@pytest.mark.parametrize("intervals", [(1, 1), (1, 10), (10, 10), (10, 100), (5, 20)])
def test_schedule_mean_step_is_a_run_of_the_schedule(intervals):
    """The mean against the schedule itself: the steps of a run after warm-up,
    each costed by what ``PreconditioningConfig`` says is due at it."""
    curvature_interval, preconditioner_interval = intervals
    config = PreconditioningConfig(
        curvature_interval=curvature_interval,
        preconditioner_interval=preconditioner_interval,
        ema_decay=0.95,
        warmup_steps=3,
    )
    plain, curvature, refresh = 1.0, 2.5, 7.0
    steps = range(3, 3 + 4 * preconditioner_interval)  # whole periods
    costs = [
        refresh
        if config.preconditioner_due(s)
        else curvature
        if config.curvature_due(s)
        else plain
        for s in steps
    ]
    expected = sum(costs) / len(costs)
    got = schedule_mean_step(plain, curvature, refresh, *intervals)
    assert got == pytest.approx(expected, rel=1e-12)


def test_schedule_mean_step_refuses_intervals_that_do_not_nest():
    with pytest.raises(ValueError, match="not a multiple of curvature_interval=3"):
        schedule_mean_step(1.0, 2.0, 3.0, 3, 10)
    with pytest.raises(ValueError, match="preconditioner_interval must be a positive"):
        schedule_mean_step(1.0, 2.0, 3.0, 1, 0)
