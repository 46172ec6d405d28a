"""``leantrain compare [memory|curvature|depth]``: the three axes in one report.

Each axis (:mod:`leantrain.compare.memory`, :mod:`leantrain.compare.curvature`,
:mod:`leantrain.compare.depth`) turns its configuration into independent runs
(:class:`~leantrain.compare.jobs.Job`); all runs of the axes asked for go to one
pool of worker processes, one torch thread each, under one progress bar. Then every
axis prints its table, and ``--out`` gets ``compare.md`` (a section per axis),
``compare.json`` (every number) and ``compare.png`` (a panel per axis). Every axis
reports the 1-minute load average when its first run started and when its last one
ended; a row timed while the load average was above the CPU cores of the machine
(:func:`~leantrain.compare.jobs.load_limit`) carries the marker ``†`` and a
footnote.

Extending: an axis is one :class:`Axis` entry in :data:`AXES`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from leantrain.compare import curvature, depth, memory
from leantrain.compare.devices import axis_sizes, device_label
from leantrain.compare.jobs import (
    Job,
    RunStats,
    load_average,
    load_limit,
    run_jobs,
    runs_description,
)
from leantrain.compare.optimizers import label
from leantrain.compare.report import UNDER_LOAD, pyplot, versions


@dataclass(frozen=True)
class Axis:
    """How one axis is configured, run, summarised, printed and drawn.

    ``describe(config)`` and ``seed_help`` are its ``leantrain compare AXIS --help``;
    ``table`` may mark rows with ``summary["under_load"]``, the keys of the jobs
    timed under load.
    """

    title: str
    config: Callable[[argparse.Namespace], Any]  # the options -> its config
    describe: Callable[[Any], str]
    seed_help: str
    jobs: Callable[[Any], list[Job]]
    summarise: Callable[[Any, Mapping], dict]
    settings: Callable[[Any, dict], str]
    explanation: Callable[[dict], str]
    table: Callable[[dict, Any], str]
    record: Callable[[dict], dict]
    plot: Callable[[Any, dict, Any], None]
    verdict: Callable[[dict, Any], str] = lambda summary, config: ""


def _sized(default: Any, axis: str, args: argparse.Namespace, **fields: Any) -> Any:
    """The axis' config for ``args.device`` (``"cpu"`` when absent: the help):
    its CPU ``default`` with the device's sizes (:data:`~.devices.DEVICE_SIZES`)."""
    device = getattr(args, "device", "cpu")
    sizes = axis_sizes(device, axis)
    return dataclasses.replace(default, **sizes, **fields, device=device)


def _memory_config(args: argparse.Namespace) -> memory.MemoryConfig:
    default = memory.DEFAULT  # read at call time (tests shrink it)
    seeds = tuple(args.seed + s for s in default.seeds)
    return _sized(default, "memory", args, seeds=seeds)


def _memory_verdict(summary: dict, config) -> str:
    lines = []
    for r in summary["rows"]:
        if r.name != "adamw":
            name = label(r.name)
            per_seed = ", ".join(f"{v:.3f}" for v in r.val_ratios)
            lines.append(
                f"{name}: {r.state_bytes_per_param:.2f} B/param, val loss "
                f"{r.val_ratio:.3f}x AdamW [{r.low:.3f}, {r.high:.3f}] "
                f"(per seed {per_seed}): {r.verdict}."
            )
    return " ".join(lines)


def _curvature_verdict(summary: dict, config) -> str:
    parts = []
    for r in summary["rows"][1:]:
        if r.status != "ok":
            parts.append(f"{r.name}: {r.status}.")
        elif r.diverged:
            parts.append(
                f"{r.name}: diverged (train loss {r.train_loss:.4g} at the end, "
                f"against AdamW's final {summary['target']:.4g})."
            )
        elif r.steps_to_target is None:
            parts.append(f"{r.name}: did not reach AdamW's final loss.")
        else:
            parts.append(
                f"{r.name}: AdamW's final loss in {r.steps_to_target} steps and "
                f"{r.seconds_to_target:.1f} s, at {r.step_ratio:.1f}x AdamW's step."
            )
    return " ".join(parts)


AXES: dict[str, Axis] = {
    "memory": Axis(
        title="memory: AdamW against Gefen 8-bit and 4-bit",
        config=_memory_config,
        describe=memory.describe,
        seed_help="the first of the seeds: --seed, --seed + 1, --seed + 2",
        jobs=memory.jobs,
        summarise=memory.summarise,
        settings=memory.settings,
        explanation=lambda summary: memory.EXPLANATION,
        table=memory.table,
        record=memory.record,
        plot=lambda ax, summary, config: memory.plot(ax, summary),
        verdict=_memory_verdict,
    ),
    "curvature": Axis(
        title="curvature: AdamW against K-FAC and Shampoo",
        config=lambda args: _sized(
            curvature.DEFAULT, "curvature", args, seed=args.seed
        ),
        describe=curvature.describe,
        seed_help="the MLP's initial weights and the order of the batches",
        jobs=curvature.jobs,
        summarise=curvature.summarise,
        settings=curvature.settings,
        explanation=curvature.explanation,
        table=lambda summary, config: curvature.table(summary),
        record=curvature.record,
        plot=lambda ax, summary, config: curvature.plot(ax, summary),
        verdict=_curvature_verdict,
    ),
    "depth": Axis(
        title="depth: the serial stack against LayerParallel",
        config=lambda args: _sized(depth.DEFAULT, "depth", args, seed=args.seed),
        describe=depth.describe,
        seed_help="the GPT's initial weights and the batch",
        jobs=depth.jobs,
        summarise=depth.summarise,
        settings=depth.settings,
        explanation=lambda summary: depth.EXPLANATION,
        table=depth.table,
        record=depth.record,
        plot=depth.plot,
        verdict=depth.verdict,
    ),
}


def _write_plot(panels: list[tuple[Axis, dict, Any]], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5))
    axes = [axes] if len(panels) == 1 else list(axes)
    for ax, (axis, summary, config) in zip(axes, panels, strict=True):
        axis.plot(ax, summary, config)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _fmt_load(value: float) -> str:
    return "unknown" if value != value else f"{value:.1f}"


def _load_record(jobs: list[Job], stats: Mapping[Any, RunStats]) -> dict:
    """The load average over an axis' runs: when the first started, when the last
    ended, per run (before, after), and the runs above the limit."""
    runs = [stats[job.key] for job in jobs]
    return {
        "start": min(runs, key=lambda r: r.started).load_before,
        "end": max(runs, key=lambda r: r.ended).load_after,
        "limit": load_limit(),
        "runs": {
            j.label: [stats[j.key].load_before, stats[j.key].load_after] for j in jobs
        },
        "under_load": [j.label for j in jobs if stats[j.key].under_load],
    }


def _load_text(load: dict, table: str) -> str:
    """The axis' load line, and the footnote of the rows its table marked."""
    text = (
        f"Machine load (1-minute load average) over this axis' runs: "
        f"{_fmt_load(load['start'])} when the first started, "
        f"{_fmt_load(load['end'])} when the last ended."
    )
    if UNDER_LOAD in table:
        limit = load["limit"]
        peak = max(x for v in load["runs"].values() for x in v if x > limit)
        text += (
            f"\n\n{UNDER_LOAD} Measured under load: the load average passed "
            f"{limit}, the CPU cores of this machine, during the runs of the marked "
            f"rows (it reached {peak:.1f}), so other work shared the cores and "
            "their times are slower and noisier than on an idle machine."
        )
    return text


def run_axes(args: argparse.Namespace, names: list[str]) -> dict[str, dict]:
    """Run the axes ``names`` on ``args.device`` (``"cpu"`` or ``"cuda"``, as
    :func:`~.devices.resolve_device` gives it); print the tables; write
    compare.{md,json,png}."""
    start = time.perf_counter()
    load_start = load_average()
    device = getattr(args, "device", "cpu")
    # Runs on one GPU in parallel processes would time each other's kernels: there
    # they run one after the other in this process.
    workers = 1 if device == "cuda" else args.workers
    configs = {name: AXES[name].config(args) for name in names}
    axis_jobs = {name: AXES[name].jobs(configs[name]) for name in names}
    jobs = [job for name in names for job in axis_jobs[name]]
    results, stats = run_jobs(jobs, workers=workers, threads=args.threads)
    wall_s = time.perf_counter() - start
    summaries = {name: AXES[name].summarise(configs[name], results) for name in names}
    for name in names:
        summaries[name]["under_load"] = {
            job.key for job in axis_jobs[name] if stats[job.key].under_load
        }
    command = "leantrain " + shlex.join(args.argv)
    on = device_label(device, args.threads)
    print(f"Device: {on}")
    md = ["# leantrain compare", "", f"Command: `{command}`", "", f"Device: {on}", ""]
    record: dict[str, Any] = {"command": command, "device": on, "axes": {}}
    for name in names:
        axis, config, summary = AXES[name], configs[name], summaries[name]
        settings = axis.settings(config, summary)
        table = axis.table(summary, config)
        verdict = axis.verdict(summary, config)
        load = _load_record(axis_jobs[name], stats)
        load_text = _load_text(load, table)
        print(f"\n## {axis.title}\n{settings}\n\n{table}\n\n{load_text}\n\n{verdict}")
        md += [
            f"## {axis.title}",
            "",
            settings + ". " + axis.explanation(summary),
            "",
            table,
            "",
            load_text,
            "",
            verdict,
            "",
        ]
        record["axes"][name] = {
            "settings": settings,
            "config": dataclasses.asdict(config),
            "verdict": verdict,
            "load_average": load,
            **axis.record(summary),
        }
    load = (load_start, load_average())
    after = (
        f"Wall time of the whole comparison: {wall_s:.1f} s "
        f"({runs_description(jobs, workers)}, {args.threads} torch thread "
        f"each; machine load, the 1-minute "
        f"load average, {_fmt_load(load[0])} at the start and {_fmt_load(load[1])} "
        f"at the end, on {os.cpu_count()} cores). CPU time of the runs (the "
        f"two-process timing's processes not counted): "
        f"{sum(r.cpu_s for r in stats.values()):.1f} s."
    )
    print(f"\n{after}")
    run_versions = versions()
    run_versions["torch threads"] = str(args.threads)
    record.update(
        wall_s=wall_s,
        workers=workers,
        load_average=list(load),
        cpu_s={job.label: stats[job.key].cpu_s for job in jobs},
        cpu_count=os.cpu_count(),
        versions=run_versions,
    )
    md += [
        after,
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in run_versions.items()),
        "",
        "![one panel per axis](compare.png)",
        "",
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.md").write_text("\n".join(md))
    (out / "compare.json").write_text(json.dumps(record, indent=1))
    panels = [(AXES[n], summaries[n], configs[n]) for n in names]
    _write_plot(panels, out / "compare.png")
    print(f"wrote {out / 'compare.md'}, {out / 'compare.png'}", file=sys.stderr)
    return summaries
