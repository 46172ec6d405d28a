"""The training loop of ``leantrain compare``: one optimizer on one task, measured.

:func:`train_one` trains a copy of a task's model with an optimizer of
:data:`~leantrain.compare.optimizers.OPTIMIZERS` and records the losses, the
optimizer's state bytes per parameter and the time of the forward and backward
pass and of ``optimizer.step()`` apart. The single-model comparison
(:mod:`leantrain.compare.single_model`), the memory axis
(:mod:`leantrain.compare.memory`) and ``benchmarks/gefen_seeds.py`` train with it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from leantrain.compare.devices import device_clock
from leantrain.compare.optimizers import OPTIMIZERS, WEIGHT_DECAY
from leantrain.compare.tasks import Task, evaluate


@dataclass
class RunResult:
    """What one optimizer's run measured."""

    name: str
    train_losses: list[float] = field(default_factory=list)
    train_loss: float = float("nan")  # mean over the last 10% of steps
    val_loss: float = float("nan")
    state_bytes_per_param: float = float("nan")
    step_ms: float = float("nan")  # optimizer.step(), first step excluded
    fwd_bwd_ms: float = float("nan")  # forward + backward, first step excluded
    first_step_ms: float = float("nan")  # includes lazy state set-up


def train_one(
    task: Task,
    name: str,
    steps: int,
    lr: float,
    progress: Callable[[float], None],
    lr_factor: Callable[[int], float] | None = None,
) -> RunResult:
    """Train a copy of ``task.model`` with optimizer ``name``; measure everything.

    ``lr_factor``: the factor of ``lr`` at each step, as ``LambdaLR`` takes it
    (None: constant ``lr``; :func:`leantrain.compare.lr.warmup_cosine`).
    """
    model = copy.deepcopy(task.model)  # same initial weights for every optimizer
    model.train()
    optimizer = OPTIMIZERS[name].factory(model, lr, WEIGHT_DECAY)
    lr_lambda = None
    if lr_factor is not None:
        lr_lambda = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    result = RunResult(name)
    fwd_bwd, opt_step = [], []
    # On CUDA each reading waits for the queued kernels: the times are the work's.
    clock = device_clock(next(model.parameters()).device)
    for batch, _ in zip(task.batches(), range(steps), strict=False):
        t0 = clock()
        optimizer.zero_grad(set_to_none=True)
        loss = task.loss(model, batch)
        loss.backward()
        t1 = clock()
        optimizer.step()
        t2 = clock()
        if lr_lambda is not None:
            lr_lambda.step()
        fwd_bwd.append(t1 - t0)
        opt_step.append(t2 - t1)
        result.train_losses.append(loss.item())
        progress(result.train_losses[-1])
    tail = result.train_losses[-max(1, steps // 10) :]
    result.train_loss = sum(tail) / len(tail)
    result.val_loss = evaluate(model, task)
    from leantrain.optim import optimizer_state_nbytes

    n_params = sum(p.numel() for p in model.parameters())
    result.state_bytes_per_param = optimizer_state_nbytes(optimizer) / n_params
    # The first step builds the state (Gefen: partition and codebook); report it apart.
    result.first_step_ms = 1e3 * (fwd_bwd[0] + opt_step[0])
    timed = slice(1, None) if steps > 1 else slice(None)
    result.step_ms = 1e3 * sum(opt_step[timed]) / len(opt_step[timed])
    result.fwd_bwd_ms = 1e3 * sum(fwd_bwd[timed]) / len(fwd_bwd[timed])
    return result
