"""``leantrain compare --precond``: preconditioned gradients against SGD and AdamW.

Plain SGD (momentum 0.9), AdamW and every method named (from
:data:`leantrain.precond.registry.PRECOND_METHODS`, each feeding
``torch.optim.SGD(momentum=0.9)`` with the registry's learning rate) train a copy of
one seeded model on the same batches in the same order. Every row makes its
gradient through a gradient maker (plain autograd for SGD and AdamW), so the time
ratio compares the curvature work alone. The table says, per row: the mean time of
a whole training step and its ratio to the plain SGD step of the same run, the
final train and validation loss, and the steps to reach a target loss: AdamW's
final train loss in the same run.

These methods build per-layer (or dense) curvature matrices: they are meant for
small models, so ``--precond`` trains the MLP on the 8x8 digits unless ``--model``
says otherwise. A method that cannot be imported is listed as ``unavailable``, one
that does not apply to the model (a dense matrix too large) as ``not applicable``,
one that raises or diverges as ``failed``.
"""

from __future__ import annotations

import argparse
import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from leantrain.compare.devices import device_clock
from leantrain.compare.report import (
    failed_row,
    fmt,
    markdown_table,
    moving_average,
    publish,
    pyplot,
    torch_threads,
    train_each,
    versions,
)
from leantrain.compare.tasks import Task, evaluate, resolve_defaults
from leantrain.precond import GradientMaker
from leantrain.precond.registry import (
    PRECOND_METHODS,
    MethodUnavailableError,
    available_methods,
    make_gradient_maker,
)

SGD_LR = 0.1  # the plain-SGD baseline of benchmarks/precond.py
MOMENTUM = 0.9
BASELINES = ("sgd", "adamw")


@dataclass
class MethodResult:
    """What one row measured (NaN where it stopped before measuring)."""

    name: str
    note: str = ""
    status: str = "ok"  # or "unavailable: ...", "not applicable: ...", "failed: ..."
    step_ms: float = math.nan  # mean whole step, first step excluded
    train_loss: float = math.nan  # mean over the last 10% of steps
    val_loss: float = math.nan
    steps_to_target: int | None = None
    train_losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)  # seconds, every step


def tail_window(steps: int) -> int:
    """Steps averaged for the final train loss (and the target): the last 10%."""
    return max(1, steps // 10)


def steps_to_reach(losses: Sequence[float], target: float, window: int) -> int | None:
    """First step (1-based) whose mean loss over the last ``window`` steps is at most
    ``target``; None if none. Early steps count only once a full window exists."""
    averages = moving_average(losses, window)
    for step in range(window, len(losses) + 1):
        if averages[step - 1] <= target:
            return step
    return None


def _short(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".splitlines()[0][:160]


def train_method(
    task: Task, name: str, steps: int, adamw_lr: float, progress: Callable[[], None]
) -> MethodResult:
    """Train a copy of ``task.model`` with ``name`` (a method or a baseline)."""
    model = copy.deepcopy(task.model)  # same initial weights for every row
    model.train()
    if name in BASELINES:
        result = MethodResult(name, note="plain autograd")
        maker = GradientMaker(model)
        if name == "sgd":
            result.note += f", SGD lr {SGD_LR} momentum {MOMENTUM}"
            opt = torch.optim.SGD(model.parameters(), lr=SGD_LR, momentum=MOMENTUM)
        else:
            result.note += f", AdamW lr {adamw_lr}"
            opt = torch.optim.AdamW(model.parameters(), lr=adamw_lr)
    else:
        spec = PRECOND_METHODS[name]
        result = MethodResult(name, note=f"{spec.note}; SGD lr {spec.lr}".lstrip("; "))
        try:
            maker = make_gradient_maker(name, model, lr=spec.lr)
        except MethodUnavailableError as err:
            result.status = f"unavailable: {_short(err)}"
            return result
        except ValueError as err:  # e.g. a dense matrix too large for the model
            result.status = f"not applicable: {_short(err)}"
            return result
        opt = torch.optim.SGD(model.parameters(), lr=spec.lr, momentum=MOMENTUM)
    times = result.step_times
    # On CUDA each reading waits for the queued kernels: the times are the work's.
    clock = device_clock(next(model.parameters()).device)
    try:
        for i, batch in zip(range(steps), task.batches(), strict=False):
            t0 = clock()
            opt.zero_grad(set_to_none=True)
            output = maker.setup_model_call(model, batch[0])
            maker.setup_loss_call(task.criterion, output, batch[1])
            _, loss = maker.forward_and_backward()
            opt.step()
            times.append(clock() - t0)
            result.train_losses.append(loss.item())
            if not math.isfinite(result.train_losses[-1]):
                raise FloatingPointError(f"loss diverged at step {i + 1}")
            progress()
        timed = times[1:] or times  # the first step sets up hooks and state
        result.step_ms = 1e3 * sum(timed) / len(timed)
        tail = result.train_losses[-tail_window(steps) :]
        result.train_loss = sum(tail) / len(tail)
        result.val_loss = evaluate(model, task)
    except Exception as err:  # noqa: BLE001 - a failing method is a table row
        result.status = f"failed: {_short(err)}"
    return result


PRECOND_COLUMNS = [
    "method",
    "step ms",
    "x SGD",
    "train loss",
    "val loss",
    "steps to target",
    "note",
]


def precond_table(results: Sequence[MethodResult], target: float) -> str:
    """Markdown table; time ratios to the ``sgd`` row, target = AdamW's train loss."""
    sgd = next((r for r in results if r.name == "sgd" and r.status == "ok"), None)
    rows = [PRECOND_COLUMNS, ["---"] + ["---:"] * 5 + ["---"]]
    for r in results:
        if r.status != "ok":
            rows.append(failed_row(r.name, r.status, r.note, len(PRECOND_COLUMNS)))
            continue
        ratio = r.step_ms / sgd.step_ms if sgd else math.nan
        reached = "-" if r.steps_to_target is None else str(r.steps_to_target)
        rows.append(
            [
                r.name,
                fmt(r.step_ms, ".2f"),
                fmt(ratio, ".2f"),
                fmt(r.train_loss, ".4f"),
                fmt(r.val_loss, ".4f"),
                reached if math.isfinite(target) else "-",
                r.note,
            ]
        )
    return markdown_table(rows)


def write_precond_plot(
    results: Sequence[MethodResult], target: float, path: Path
) -> None:
    """Loss curves with the target line, and a bar chart of step time / SGD's."""
    plt = pyplot()
    ok = [r for r in results if r.status == "ok"]
    sgd = next((r for r in ok if r.name == "sgd"), None)
    fig, (ax_loss, ax_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in ok:
        window = tail_window(len(r.train_losses))
        width = 2.5 if r.name in BASELINES else 1.2
        ax_loss.semilogy(
            moving_average(r.train_losses, window), label=r.name, linewidth=width
        )
    if math.isfinite(target):
        ax_loss.axhline(target, color="k", linestyle=":", label="target (AdamW)")
    ax_loss.set(xlabel="step", ylabel="train loss (moving average)", title="Loss")
    ax_loss.legend(fontsize=7, ncol=2)
    if sgd is not None:
        bars = ax_time.bar([r.name for r in ok], [r.step_ms / sgd.step_ms for r in ok])
        ax_time.bar_label(bars, fmt="%.1f", fontsize=7)
    ax_time.tick_params(axis="x", labelrotation=60, labelsize=7)
    ax_time.set(ylabel="step time / SGD step", title="Time per step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_precond(args: argparse.Namespace) -> list[MethodResult]:
    """``leantrain compare --precond``: train, print the table, write compare.*."""
    start = time.perf_counter()
    spec = resolve_defaults(args)
    reasons = available_methods()
    names = [*BASELINES, *args.precond]
    with torch_threads(args.threads):
        task = spec.build(args)

        def train(name: str, bar) -> MethodResult:
            if reasons.get(name) is not None:
                return MethodResult(name, status=f"unavailable: {reasons[name]}")
            return train_method(task, name, args.steps, args.lr, bar.update)

        results = train_each(names, args.steps, train)
        run_versions = versions()
    wall_s = time.perf_counter() - start
    adamw = results[1]
    target = adamw.train_loss if adamw.status == "ok" else math.nan
    window = tail_window(args.steps)
    for r in results:
        if r.status == "ok" and math.isfinite(target):
            r.steps_to_target = steps_to_reach(r.train_losses, target, window)
    publish(
        args,
        settings=f"{task.description}; {args.steps} steps, batch {args.batch_size}, "
        f"AdamW lr {args.lr}, seed {args.seed}; target = AdamW's train loss "
        f"{target:.4f}",
        table=precond_table(results, target),
        explanation="Step ms: mean wall time of a whole training step (zero_grad, "
        "forward and backward through the gradient maker with its curvature and "
        "preconditioning work, optimizer step), first step excluded; x SGD: its "
        "ratio to the plain SGD step of this run. Train loss: mean of the last "
        f"10% ({window}) of steps; val loss: mean over {len(task.val_batches)} "
        "fixed validation batches. Steps to target: the first step at which the "
        f"mean train loss over the last {window} steps is at most the target "
        "(AdamW's train loss), '-' if never. Preconditioned methods feed "
        "SGD(momentum 0.9) with the registry's learning rate. These methods are "
        "meant for small models (per-layer or dense curvature matrices).",
        after=f"Wall time of the whole comparison: {wall_s:.1f} s.",
        results=results,
        wall_s=wall_s,
        run_versions=run_versions,
        target=target,
        window=window,
        plot=lambda path: write_precond_plot(results, target, path),
    )
    return results
