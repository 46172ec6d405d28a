"""``leantrain compare --model ...``: one model, several optimizers, one table.

One seeded model (:data:`~leantrain.compare.tasks.TASKS`) is trained with several
optimizers of :data:`~leantrain.compare.optimizers.VARIANTS` (same initial weights,
same batches in the same order); :func:`run_compare` reports final losses,
optimizer state bytes per parameter and step times, each as a ratio to AdamW. The
``--peers`` and ``--precond`` variants live in :mod:`leantrain.compare.peers` and
:mod:`leantrain.compare.precond` and reuse the tasks and
:func:`~leantrain.compare.report.publish`. See docs/compare.md.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from leantrain.compare.optimizers import label
from leantrain.compare.report import (
    publish,
    pyplot,
    torch_threads,
    train_each,
    versions,
)
from leantrain.compare.tasks import resolve_defaults
from leantrain.compare.training import RunResult, train_one

METRICS = [  # (column title, RunResult attribute, format)
    ("train loss", "train_loss", "{:.4f}"),
    ("val loss", "val_loss", "{:.4f}"),
    ("state B/param", "state_bytes_per_param", "{:.3f}"),
    ("opt.step ms", "step_ms", "{:.2f}"),
    ("fwd+bwd ms", "fwd_bwd_ms", "{:.2f}"),
]


def results_table(results: Sequence[RunResult], baseline: str) -> str:
    """Markdown table: every metric followed by its ratio to the ``baseline`` row."""
    base = next(r for r in results if r.name == baseline)
    base_label = label(baseline)
    header = ["optimizer"]
    for title, _, _ in METRICS:
        header += [title, f"x {base_label}"]
    rows = [header, ["---"] + ["---:"] * (len(header) - 1)]
    for r in results:
        row = [label(r.name)]
        for _, attr, fmt in METRICS:
            value, ref = getattr(r, attr), getattr(base, attr)
            row += [fmt.format(value), f"{value / ref:.2f}" if ref else "n/a"]
        rows.append(row)
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def write_plot(results: Sequence[RunResult], path: Path) -> None:
    """Loss curves of every optimizer and a bar chart of state bytes/param."""
    plt = pyplot()
    fig, (ax_loss, ax_mem) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        losses = torch.tensor(r.train_losses)
        k = max(1, len(losses) // 20)  # moving average: single batches are noisy
        smooth = losses.unfold(0, k, 1).mean(1) if len(losses) >= k else losses
        steps = torch.arange(len(smooth)) + k
        ax_loss.plot(steps, smooth, label=label(r.name))
    ax_loss.set(xlabel="step", ylabel="train loss (moving average)", title="Loss")
    ax_loss.legend()
    labels = [label(r.name) for r in results]
    bars = ax_mem.bar(labels, [r.state_bytes_per_param for r in results])
    ax_mem.bar_label(bars, fmt="%.2f")
    ax_mem.set(ylabel="bytes / parameter", title="Optimizer state")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_compare(args: argparse.Namespace) -> list[RunResult]:
    """``leantrain compare``: train, print the table, write compare.{md,png,json}."""
    start = time.perf_counter()
    spec = resolve_defaults(args)
    with torch_threads(args.threads):
        task = spec.build(args)

        def train(name: str, bar) -> RunResult:
            def progress(loss: float) -> None:
                bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
                bar.update()

            return train_one(task, name, args.steps, args.lr, progress)

        results = train_each(args.optimizers, args.steps, train, label)
        run_versions = versions()  # records the thread count the run used
    wall_s = time.perf_counter() - start  # data, model, training, evaluation
    baseline = "adamw" if "adamw" in args.optimizers else args.optimizers[0]
    publish(
        args,
        settings=f"{task.description}; {args.steps} steps, batch {args.batch_size}, "
        f"lr {args.lr}, seed {args.seed}",
        table=results_table(results, baseline),
        explanation="Train loss: mean of the last 10% of steps; val loss: mean "
        f"over {len(task.val_batches)} fixed validation batches. Times are means "
        "over all steps but the first (which builds the optimizer state).",
        after="First step (ms, includes state set-up): "
        + ", ".join(f"{r.name} {r.first_step_ms:.1f}" for r in results)
        + f". Wall time of the whole comparison: {wall_s:.1f} s.",
        results=results,
        wall_s=wall_s,
        run_versions=run_versions,
        baseline=baseline,
        plot=lambda path: write_plot(results, path),
    )
    return results
