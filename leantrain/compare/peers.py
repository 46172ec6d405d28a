"""``leantrain compare --peers``: leantrain's optimizers against the published peers.

Every optimizer asked for (by default :data:`leantrain.compare.optimizers.PEERS`)
trains a copy of one seeded model (``--model gpt|mlp|cnn``, the tasks of
:mod:`leantrain.compare.tasks`) on the same batches
in the same order, and the table says, per optimizer: state bytes per parameter,
the extra resident memory during ``step()``, the median step time and its ratio to
AdamW (foreach) of the same run, the first step's time and the final validation
loss -- the table of ``benchmarks/optimizers.py``, for the model a user picks.

A peer that is not installed, does not import or fails while training is a row
``failed: <reason>``: never hidden, never a crash of the comparison.
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from leantrain.compare.measure import measured_step, state_nbytes
from leantrain.compare.optimizers import OPTIMIZERS, WEIGHT_DECAY
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

BASELINE = "adamw-foreach"


@dataclass
class PeerResult:
    """What one peer's run measured (NaN where it failed before measuring)."""

    name: str
    note: str = ""
    status: str = "ok"  # or "failed: <reason>"
    state_bytes_per_param: float = math.nan
    peak_step_mib: float = math.nan  # largest over the steps after the first
    step_ms: float = math.nan  # median step() time, first step excluded
    first_step_s: float = math.nan  # includes lazy state set-up / compilation
    val_loss: float = math.nan
    train_losses: list[float] = field(default_factory=list)


def _failure(error: BaseException) -> str:
    # One short line that fits a table cell.
    return "failed: " + f"{type(error).__name__}: {error}".splitlines()[0][:160]


def train_peer(
    task: Task,
    name: str,
    steps: int,
    lr: float,
    progress: Callable[[], None],
    *,
    weight_decay: float = WEIGHT_DECAY,
) -> PeerResult:
    """Train a copy of ``task.model`` with peer ``name``; a failure is a status."""
    result = PeerResult(name, note=OPTIMIZERS[name].note)
    gc.collect()  # once per run, so one peer's garbage does not land in the next
    model = copy.deepcopy(task.model)  # same initial weights for every peer
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    try:
        optimizer = OPTIMIZERS[name].factory(model, lr, weight_decay)
        times, peaks = [], []
        for i, batch in zip(range(steps), task.batches(), strict=False):
            optimizer.zero_grad(set_to_none=True)
            loss = task.loss(model, batch)
            loss.backward()
            result.train_losses.append(loss.item())
            seconds, peak = measured_step(optimizer)
            if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
                raise FloatingPointError(f"non-finite parameters after step {i + 1}")
            if i == 0:  # builds the state (partition, codebook, compilation)
                result.first_step_s = seconds
            else:
                times.append(seconds)
                if peak is not None:
                    peaks.append(peak / 2**20)
            progress()
        result.step_ms = 1e3 * statistics.median(times) if times else math.nan
        result.peak_step_mib = max(peaks) if peaks else math.nan
        result.state_bytes_per_param = state_nbytes(optimizer) / n_params
        result.val_loss = evaluate(model, task)
    except Exception as error:  # noqa: BLE001 - a failing peer is a table row
        result.status = _failure(error)
    return result


PEER_COLUMNS = [
    "optimizer",
    "state B/param",
    "peak step MiB",
    "step ms",
    "x AdamW",
    "first step s",
    "val loss",
    "note",
]


def peers_table(results: Sequence[PeerResult]) -> str:
    """Markdown table; the step-time ratio is to :data:`BASELINE` of the same run."""
    base = next((r for r in results if r.name == BASELINE and r.status == "ok"), None)
    rows = [PEER_COLUMNS, ["---"] + ["---:"] * 6 + ["---"]]
    for r in results:
        if r.status != "ok":
            rows.append(failed_row(r.name, r.status, r.note, len(PEER_COLUMNS)))
            continue
        ratio = r.step_ms / base.step_ms if base else math.nan
        rows.append(
            [
                r.name,
                fmt(r.state_bytes_per_param, ".3f"),
                fmt(r.peak_step_mib, ".1f"),
                fmt(r.step_ms, ".2f"),
                fmt(ratio, ".2f"),
                fmt(r.first_step_s, ".3f"),
                fmt(r.val_loss, ".4f"),
                r.note,
            ]
        )
    return markdown_table(rows)


def write_peers_plot(results: Sequence[PeerResult], path: Path) -> None:
    """Loss curves of every peer that ran and a bar chart of state bytes/param."""
    plt = pyplot()
    ok = [r for r in results if r.status == "ok"]
    fig, (ax_loss, ax_mem) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in ok:
        k = max(1, len(r.train_losses) // 20)  # single batches are noisy
        ax_loss.plot(moving_average(r.train_losses, k), label=r.name, linewidth=1)
    ax_loss.set(xlabel="step", ylabel="train loss (moving average)", title="Loss")
    ax_loss.legend(fontsize=7)
    bars = ax_mem.bar([r.name for r in ok], [r.state_bytes_per_param for r in ok])
    ax_mem.bar_label(bars, fmt="%.2f", fontsize=7)
    ax_mem.tick_params(axis="x", labelrotation=60, labelsize=7)
    failed = [r.name for r in results if r.status != "ok"]
    title = "Optimizer state" + (f" (failed: {', '.join(failed)})" if failed else "")
    ax_mem.set(ylabel="bytes / parameter", title=title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_peers(args: argparse.Namespace) -> list[PeerResult]:
    """``leantrain compare --peers``: train, print the table, write compare.*."""
    start = time.perf_counter()
    spec = resolve_defaults(args)
    # The ratio column needs the baseline in the same run.
    names = ([BASELINE] if BASELINE not in args.peers else []) + list(args.peers)
    with torch_threads(args.threads):
        task = spec.build(args)
        results = train_each(
            names,
            args.steps,
            lambda name, bar: train_peer(task, name, args.steps, args.lr, bar.update),
        )
        run_versions = versions()
    wall_s = time.perf_counter() - start
    publish(
        args,
        settings=f"{task.description}; {args.steps} steps, batch {args.batch_size}, "
        f"lr {args.lr}, weight decay {WEIGHT_DECAY}, seed {args.seed}",
        table=peers_table(results),
        explanation="State B/param: every tensor of the optimizer's state (tensor "
        "subclasses opened, top-level tensors such as codebooks included, each "
        "storage once) / parameters. Peak step MiB: extra resident memory during "
        "step(), the largest over the steps after the first, measured as VmHWM "
        "after the step minus VmRSS before it, VmHWM reset through "
        "/proc/self/clear_refs after malloc_trim(0) (memory the allocator reuses "
        "is not seen: a lower bound). Step ms: median step() time after the first "
        f"step; x AdamW: its ratio to {BASELINE} of this run. First step s: the "
        "first step() (state set-up, codebooks, compilation). Val loss: mean over "
        f"{len(task.val_batches)} fixed validation batches after training. A peer "
        "that is missing or fails is a row 'failed: <reason>'.",
        after=f"Wall time of the whole comparison: {wall_s:.1f} s.",
        results=results,
        wall_s=wall_s,
        run_versions=run_versions,
        baseline=BASELINE,
        plot=lambda path: write_peers_plot(results, path),
    )
    return results
