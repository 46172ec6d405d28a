"""The curvature axis of ``leantrain compare``: AdamW against K-FAC and Shampoo.

AdamW and each preconditioning method (feeding ``SGD(momentum=0.9)`` with the
registry's learning rate, as in ``leantrain compare --precond``, whose training loop
:func:`leantrain.compare.precond.train_method` this reuses) train a copy of the MLP
on the 8x8 digits from the same weights on the same batches. The target is AdamW's
final training loss (the mean of its last 10 % of steps); the table says for each
row the first step at which its moving-average training loss reaches the target,
the wall-clock seconds of training up to that step (the first step included, which
sets up the curvature state), and the mean step time against AdamW's. On CUDA the
batch is larger (``compare.devices.DEVICE_SIZES``) and the step times are the GPU's
(each timed step ends with a synchronisation).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass

from leantrain.compare.jobs import Job
from leantrain.compare.precond import (
    MethodResult,
    steps_to_reach,
    tail_window,
    train_method,
)
from leantrain.compare.report import (
    failed_row,
    fmt,
    mark_under_load,
    markdown_table,
    moving_average,
)
from leantrain.compare.tasks import TASKS
from leantrain.precond.registry import PRECOND_METHODS, available_methods

_TASKS: dict = {}  # per process: the task of each (seed, batch size)


@dataclass(frozen=True)
class CurvatureConfig:
    """What the curvature axis trains (``steps`` of ``batch_size`` digit images)."""

    # The registry's schedules: K-FAC every 10 steps, Shampoo's roots every 100.
    methods: tuple[str, ...] = ("kfac", "shampoo")
    steps: int = 300
    batch_size: int = 64
    lr: float = 1e-3  # AdamW's; the methods use the registry's
    seed: int = 0
    data: str = "digits"
    device: str = "cpu"  # "cuda": the sizes of compare.devices.DEVICE_SIZES


DEFAULT = CurvatureConfig()
ROWS_FIRST = ("adamw",)


def _task(config: CurvatureConfig):
    key = (config.data, config.seed, config.batch_size, config.device)
    if key not in _TASKS:
        args = argparse.Namespace(
            data=config.data, seed=config.seed, batch_size=config.batch_size
        )
        _TASKS[key] = TASKS["mlp"].build(args).to(config.device)
    return _TASKS[key]


def train_curvature_run(
    config: CurvatureConfig, name: str, *, progress: Callable[[], None]
) -> MethodResult:
    """AdamW or one method (a job of :func:`jobs`); unavailable methods are rows."""
    reason = available_methods().get(name)
    if reason is not None:
        return MethodResult(name, status=f"unavailable: {reason}")
    return train_method(_task(config), name, config.steps, config.lr, progress)


def jobs(config: CurvatureConfig) -> list[Job]:
    """AdamW and one job per method."""
    unknown = [m for m in config.methods if m not in PRECOND_METHODS]
    if unknown:
        raise ValueError(
            f"unknown preconditioning method(s) {unknown}; allowed: "
            f"{', '.join(PRECOND_METHODS)}"
        )
    return [
        Job(
            key=("curvature", name),
            label=name,
            fn=train_curvature_run,
            args=(config, name),
            ticks=config.steps,
            cost=config.steps * 0.01,
        )
        for name in (*ROWS_FIRST, *config.methods)
    ]


@dataclass
class CurvatureRow:
    """One row: the run and what it took to reach the target."""

    name: str
    status: str
    note: str
    step_ms: float
    step_ratio: float  # mean step / AdamW's
    train_loss: float
    val_loss: float
    steps_to_target: int | None
    seconds_to_target: float | None
    diverged: bool  # finite, but the final train loss is above the first one


def summarise(config: CurvatureConfig, results: Mapping) -> dict:
    """Target, steps and seconds to it, and step ratios from the jobs' results."""
    runs = [results[("curvature", n)] for n in (*ROWS_FIRST, *config.methods)]
    adamw = runs[0]
    target = adamw.train_loss if adamw.status == "ok" else math.nan
    window = tail_window(config.steps)
    rows = []
    for r in runs:
        reached = seconds = None
        if r.status == "ok" and math.isfinite(target):
            reached = steps_to_reach(r.train_losses, target, window)
            if reached is not None:
                seconds = sum(r.step_times[:reached])
        ratio = r.step_ms / adamw.step_ms if adamw.status == "ok" else math.nan
        rows.append(
            CurvatureRow(
                name=r.name,
                status=r.status,
                note=r.note,
                step_ms=r.step_ms,
                step_ratio=ratio,
                train_loss=r.train_loss,
                val_loss=r.val_loss,
                steps_to_target=reached,
                seconds_to_target=seconds,
                diverged=r.status == "ok" and r.train_loss > r.train_losses[0],
            )
        )
    return {"rows": rows, "target": target, "window": window, "runs": runs}


COLUMNS = [
    "method",
    "steps to target",
    "x AdamW",
    "seconds to target",
    "x AdamW",
    "step ms",
    "x AdamW",
    "train loss",
    "val loss",
    "note",
]


def _ratio(value: float | None, base: float | None) -> str:
    if value is None or base is None or not base:
        return "-"
    return fmt(value / base, ".2f")


def table(summary: dict) -> str:
    """Markdown table of the curvature axis, every ratio to AdamW of the same run."""
    rows = summary["rows"]
    base = rows[0]
    body = [COLUMNS, ["---"] + ["---:"] * 8 + ["---"]]
    under_load = summary.get("under_load", ())
    for r in rows:
        if r.status != "ok":
            body.append(failed_row(r.name, r.status, r.note, len(COLUMNS)))
            continue
        steps = "-" if r.steps_to_target is None else str(r.steps_to_target)
        secs = "-" if r.seconds_to_target is None else f"{r.seconds_to_target:.2f}"
        body.append(
            [
                mark_under_load(r.name, ("curvature", r.name) in under_load),
                steps,
                _ratio(r.steps_to_target, base.steps_to_target),
                secs,
                _ratio(r.seconds_to_target, base.seconds_to_target),
                fmt(r.step_ms, ".2f"),
                fmt(r.step_ratio, ".2f"),
                fmt(r.train_loss, ".4g"),
                fmt(r.val_loss, ".4g"),
                ("diverged; " if r.diverged else "") + r.note,
            ]
        )
    return markdown_table(body)


def settings(config: CurvatureConfig, summary: dict) -> str:
    """One line: the model, the data, the training settings and the target."""
    return (
        f"{_task(config).description}; {config.steps} steps, batch "
        f"{config.batch_size}, AdamW lr {config.lr}, seed {config.seed}; target = "
        f"AdamW's train loss {summary['target']:.4f}"
    )


def describe(config: CurvatureConfig) -> str:
    """What the axis runs, for ``leantrain compare curvature --help``."""
    c = config
    return (
        f"AdamW (lr {c.lr}) against {', '.join(c.methods)} (each feeding "
        "SGD(momentum=0.9) with the registry's learning rate): the MLP "
        f"64-512-512-10 trains on the 8x8 digits ('{c.data}') for {c.steps} steps "
        f"of {c.batch_size} images, from the same weights on the same batches; the "
        "target is AdamW's final training loss, and the table says how many steps "
        "and seconds each method takes to reach it."
    )


def explanation(summary: dict) -> str:
    """What the columns mean."""
    return (
        "Steps to target: the first step at which the mean train loss over the last "
        f"{summary['window']} steps is at most the target (AdamW's train loss, the "
        "mean of its last 10 % of steps), '-' if never. Seconds to target: the wall "
        "time of the training steps up to then (the first step, which sets up the "
        "curvature state, included). Step ms: mean whole training step (forward, "
        "backward with the curvature and preconditioning work, optimizer step), "
        "first step excluded. Train loss: the mean of the last 10 % of steps; "
        "'diverged' marks a run whose train loss ends above its first one. Methods "
        "feed SGD(momentum 0.9) with the registry's "
        "learning rate; they build per-layer curvature matrices, so they are meant "
        "for small models."
    )


def record(summary: dict) -> dict:
    """The axis' entries of compare.json."""
    return {
        "target": summary["target"],
        "window": summary["window"],
        "rows": [asdict(r) for r in summary["rows"]],
        "runs": [asdict(r) for r in summary["runs"]],
    }


def plot(ax, summary: dict) -> None:
    """Training loss (moving average) against wall-clock seconds, target line."""
    window = summary["window"]
    for r in summary["runs"]:
        if r.status != "ok":
            continue
        seconds, total = [], 0.0
        for t in r.step_times:
            total += t
            seconds.append(total)
        ax.semilogy(seconds, moving_average(r.train_losses, window), label=r.name)
    if math.isfinite(summary["target"]):
        ax.axhline(summary["target"], color="k", linestyle=":", label="AdamW final")
    ax.set(
        xlabel="training seconds",
        ylabel="train loss (moving average)",
        title="curvature: loss against time",
    )
    ax.legend(fontsize=7)
