"""The memory axis of ``leantrain compare``: AdamW against Gefen 8-bit and 4-bit.

Every optimizer trains the small GPT (``GPT.default()`` on the embedded text) once
per seed; within a seed every optimizer starts from the same weights and sees the
same batches. The run-to-run spread is measured in the same comparison: for each
optimizer, the relative difference between its seeds' validation losses; the
*spread* is the largest of these. A Gefen row's verdict compares its mean validation
loss over the seeds with AdamW's: "within run-to-run noise" when the relative
difference is at most the spread, otherwise "x % worse (or better), outside it".
Two seeds make the spread a rough yardstick (the seed-to-seed difference of one
optimizer has about the size of the standard deviation of a difference of means);
it says whether one comparison can tell the optimizers apart, not how large a
difference many seeds would find (docs/gefen.md has sixteen-seed figures).
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

from leantrain._report import fmt, markdown_table
from leantrain.compare import OPTIMIZER_LABELS, TASKS, RunResult, train_one
from leantrain.compare_jobs import Job

_TASKS: dict = {}  # per process: the task of each (seed, batch size)


@dataclass(frozen=True)
class MemoryConfig:
    """What the memory axis trains (``steps`` of ``batch_size`` sequences)."""

    optimizers: tuple[str, ...] = ("adamw", "gefen8", "gefen4")
    seeds: tuple[int, ...] = (0, 1)
    # 250 steps leave the first plateau (val loss about 2.9 from step 50 to 150)
    # and keep six runs on two cores within the time budget.
    steps: int = 250
    batch_size: int = 16
    lr: float = 2e-3
    data: str = "stdlib"
    seconds_per_step: float = 0.2  # a rough cost, to schedule the longest first


DEFAULT = MemoryConfig()


def _task(config: MemoryConfig, seed: int):
    key = (config.data, seed, config.batch_size)
    if key not in _TASKS:  # the corpus is read once per process
        args = argparse.Namespace(
            data=config.data, seed=seed, batch_size=config.batch_size
        )
        _TASKS[key] = TASKS["gpt"].build(args)
    return _TASKS[key]


def train_memory_run(
    config: MemoryConfig, name: str, seed: int, *, progress: Callable[[], None]
) -> RunResult:
    """One optimizer, one seed (a job of :func:`jobs`)."""
    task = _task(config, seed)
    return train_one(task, name, config.steps, config.lr, lambda _loss: progress())


def jobs(config: MemoryConfig) -> list[Job]:
    """One job per optimizer and seed."""
    if "adamw" not in config.optimizers:
        raise ValueError(
            f"the memory axis compares with AdamW: optimizers must include 'adamw', "
            f"got {config.optimizers}"
        )
    if len(config.seeds) < 2:
        raise ValueError(
            f"the run-to-run spread needs at least two seeds, got {config.seeds}"
        )
    return [
        Job(
            key=("memory", name, seed),
            label=f"{OPTIMIZER_LABELS.get(name, name)} seed {seed}",
            fn=train_memory_run,
            args=(config, name, seed),
            ticks=config.steps,
            cost=config.steps * config.seconds_per_step,
        )
        for name in config.optimizers
        for seed in config.seeds
    ]


@dataclass
class MemoryRow:
    """One optimizer over the seeds."""

    name: str
    val_losses: list[float]  # one per seed
    state_bytes_per_param: float
    step_ms: float  # optimizer.step(), mean over the seeds
    spread: float  # relative difference between its seeds' validation losses
    val_ratio: float  # mean val loss / AdamW's
    verdict: str


def relative_spread(values: Sequence[float]) -> float:
    """(max - min) / mean: how far the seeds of one optimizer land apart."""
    return (max(values) - min(values)) / statistics.fmean(values)


def verdict(ratio: float, spread: float) -> str:
    """The wording of a row: within the spread, or how far outside it."""
    if not math.isfinite(ratio):
        return "did not train (non-finite loss)"
    if abs(ratio - 1) <= spread:
        return f"within run-to-run noise ({100 * (ratio - 1):+.1f} %)"
    word = "worse" if ratio > 1 else "better"
    return f"{100 * abs(ratio - 1):.1f} % {word}, outside it"


def summarise(config: MemoryConfig, results: Mapping) -> dict:
    """Rows, the spread and the table from the jobs' results."""
    runs = {
        name: [results[("memory", name, s)] for s in config.seeds]
        for name in config.optimizers
    }
    spreads = {n: relative_spread([r.val_loss for r in rs]) for n, rs in runs.items()}
    spread = max(spreads.values())
    adamw_val = statistics.fmean(r.val_loss for r in runs["adamw"])
    rows = []
    for name, rs in runs.items():
        vals = [r.val_loss for r in rs]
        ratio = statistics.fmean(vals) / adamw_val
        rows.append(
            MemoryRow(
                name=name,
                val_losses=vals,
                state_bytes_per_param=rs[0].state_bytes_per_param,
                step_ms=statistics.fmean(r.step_ms for r in rs),
                spread=spreads[name],
                val_ratio=ratio,
                verdict="baseline" if name == "adamw" else verdict(ratio, spread),
            )
        )
    return {"rows": rows, "spread": spread, "runs": runs}


def table(summary: dict, config: MemoryConfig) -> str:
    """Markdown table of the memory axis, every ratio to AdamW of the same run."""
    rows = summary["rows"]
    base = next(r for r in rows if r.name == "adamw")
    seeds = ", ".join(f"seed {s}" for s in config.seeds)
    header = [
        "optimizer",
        "state B/param",
        "x AdamW",
        "opt.step ms",
        "x AdamW",
        f"val loss ({seeds})",
        "seed spread",
        "mean val x AdamW",
        "verdict",
    ]
    body = [header, ["---"] + ["---:"] * 7 + ["---"]]
    for r in rows:
        body.append(
            [
                OPTIMIZER_LABELS.get(r.name, r.name),
                fmt(r.state_bytes_per_param, ".3f"),
                fmt(r.state_bytes_per_param / base.state_bytes_per_param, ".3f"),
                fmt(r.step_ms, ".2f"),
                fmt(r.step_ms / base.step_ms, ".2f"),
                ", ".join(fmt(v, ".4f") for v in r.val_losses),
                f"{100 * r.spread:.1f} %",
                fmt(r.val_ratio, ".3f"),
                r.verdict,
            ]
        )
    return markdown_table(body)


def settings(config: MemoryConfig, summary: dict) -> str:
    """One line: the model, the data and the training settings."""
    first = _task(config, config.seeds[0])
    return (
        f"{first.description}; {config.steps} steps, batch {config.batch_size}, "
        f"lr {config.lr}, seeds {', '.join(map(str, config.seeds))}"
    )


EXPLANATION = (
    "State B/param: optimizer_state_nbytes / parameters. Opt.step ms: mean "
    "optimizer.step() time (first step excluded, which builds the state), mean over "
    "the seeds. Val loss: mean over fixed validation batches after training (nats "
    "per byte), one per seed. Seed spread: (max - min) / mean of the optimizer's "
    "validation losses over the seeds. Verdict: the mean validation loss against "
    "AdamW's, 'within run-to-run noise' when the difference is at most the largest "
    "seed spread of the run."
)


def record(summary: dict) -> dict:
    """The axis' entries of compare.json."""
    return {
        "spread": summary["spread"],
        "rows": [asdict(r) for r in summary["rows"]],
        "runs": {name: [asdict(r) for r in rs] for name, rs in summary["runs"].items()},
    }


def plot(ax, summary: dict) -> None:
    """Validation loss per optimizer: one dot per seed, the mean, AdamW's band."""
    rows = summary["rows"]
    base = statistics.fmean(next(r for r in rows if r.name == "adamw").val_losses)
    half = base * summary["spread"]
    ax.axhspan(base - half, base + half, color="0.85", label="AdamW ± spread")
    for k, r in enumerate(rows):
        ax.scatter([k] * len(r.val_losses), r.val_losses, color=f"C{k}", zorder=3)
        ax.hlines(statistics.fmean(r.val_losses), k - 0.25, k + 0.25, color=f"C{k}")
    labels = [
        f"{OPTIMIZER_LABELS.get(r.name, r.name)}\n{r.state_bytes_per_param:.2f} B/param"
        for r in rows
    ]
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set(ylabel="val loss (nats/byte)", title="memory: val loss per seed")
    ax.legend(fontsize=7)
