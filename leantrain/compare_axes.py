"""``leantrain compare [memory|curvature|depth]``: the three axes in one report.

Each axis (:mod:`leantrain.compare_memory`, :mod:`leantrain.compare_curvature`,
:mod:`leantrain.compare_depth`) turns its configuration into independent runs
(:class:`~leantrain.compare_jobs.Job`); all runs of the axes asked for go to one
pool of worker processes, one torch thread each, under one progress bar. Then every
axis prints its table, and ``--out`` gets ``compare.md`` (a section per axis),
``compare.json`` (every number) and ``compare.png`` (a panel per axis).

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

from leantrain import compare_curvature, compare_depth, compare_memory
from leantrain._report import versions
from leantrain.compare_jobs import Job, run_jobs


@dataclass(frozen=True)
class Axis:
    """How one axis is configured, run, summarised, printed and drawn."""

    title: str
    config: Callable[[argparse.Namespace], Any]  # the options -> its config
    jobs: Callable[[Any], list[Job]]
    summarise: Callable[[Any, Mapping], dict]
    settings: Callable[[Any, dict], str]
    explanation: Callable[[dict], str]
    table: Callable[[dict, Any], str]
    record: Callable[[dict], dict]
    plot: Callable[[Any, dict, Any], None]
    verdict: Callable[[dict, Any], str] = lambda summary, config: ""


def _memory_config(args: argparse.Namespace) -> compare_memory.MemoryConfig:
    default = compare_memory.DEFAULT  # read at call time (tests shrink it)
    seeds = tuple(args.seed + s for s in default.seeds)
    return dataclasses.replace(default, seeds=seeds)


def _memory_verdict(summary: dict, config) -> str:
    lines = []
    for r in summary["rows"]:
        if r.name != "adamw":
            label = compare_memory.OPTIMIZER_LABELS.get(r.name, r.name)
            per_seed = ", ".join(f"{v:.3f}" for v in r.val_ratios)
            lines.append(
                f"{label}: {r.state_bytes_per_param:.2f} B/param, val loss "
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


def _depth_verdict(summary: dict, config) -> str:
    t = summary["timing"]
    p = summary["projected"]["measured"]
    return (
        f"Measured on 2 processes: {t.speedup:.2f}x serial; projected for "
        f"{config.projected_layers} layers: "
        + ", ".join(f"{s:.2f}x at {r}" for r, s in p.items())
        + " ranks (messages as measured)."
    )


AXES: dict[str, Axis] = {
    "memory": Axis(
        title="memory: AdamW against Gefen 8-bit and 4-bit",
        config=_memory_config,
        jobs=compare_memory.jobs,
        summarise=compare_memory.summarise,
        settings=compare_memory.settings,
        explanation=lambda summary: compare_memory.EXPLANATION,
        table=compare_memory.table,
        record=compare_memory.record,
        plot=lambda ax, summary, config: compare_memory.plot(ax, summary),
        verdict=_memory_verdict,
    ),
    "curvature": Axis(
        title="curvature: AdamW against K-FAC and Shampoo",
        config=lambda args: dataclasses.replace(
            compare_curvature.DEFAULT, seed=args.seed
        ),
        jobs=compare_curvature.jobs,
        summarise=compare_curvature.summarise,
        settings=compare_curvature.settings,
        explanation=compare_curvature.explanation,
        table=lambda summary, config: compare_curvature.table(summary),
        record=compare_curvature.record,
        plot=lambda ax, summary, config: compare_curvature.plot(ax, summary),
        verdict=_curvature_verdict,
    ),
    "depth": Axis(
        title="depth: the serial stack against LayerParallel",
        config=lambda args: dataclasses.replace(compare_depth.DEFAULT, seed=args.seed),
        jobs=compare_depth.jobs,
        summarise=compare_depth.summarise,
        settings=compare_depth.settings,
        explanation=lambda summary: compare_depth.EXPLANATION,
        table=compare_depth.table,
        record=compare_depth.record,
        plot=compare_depth.plot,
        verdict=_depth_verdict,
    ),
}


def _write_plot(panels: list[tuple[Axis, dict, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5))
    axes = [axes] if len(panels) == 1 else list(axes)
    for ax, (axis, summary, config) in zip(axes, panels, strict=True):
        axis.plot(ax, summary, config)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _load() -> float:
    """The 1-minute load average (NaN where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return float("nan")


def _fmt_load(value: float) -> str:
    return "unknown" if value != value else f"{value:.1f}"


def run_axes(args: argparse.Namespace, names: list[str]) -> dict[str, dict]:
    """Run the axes ``names``; print the tables; write compare.{md,json,png}."""
    start = time.perf_counter()
    load_start = _load()
    configs = {name: AXES[name].config(args) for name in names}
    jobs = [job for name in names for job in AXES[name].jobs(configs[name])]
    results, cpu = run_jobs(jobs, workers=args.workers, threads=args.threads)
    wall_s = time.perf_counter() - start
    summaries = {name: AXES[name].summarise(configs[name], results) for name in names}
    command = "leantrain " + shlex.join(args.argv)
    md = ["# leantrain compare", "", f"Command: `{command}`", ""]
    record: dict[str, Any] = {"command": command, "axes": {}}
    for name in names:
        axis, config, summary = AXES[name], configs[name], summaries[name]
        settings = axis.settings(config, summary)
        table = axis.table(summary, config)
        verdict = axis.verdict(summary, config)
        print(f"\n## {axis.title}\n{settings}\n\n{table}\n\n{verdict}")
        md += [
            f"## {axis.title}",
            "",
            settings + ". " + axis.explanation(summary),
            "",
            table,
            "",
            verdict,
            "",
        ]
        record["axes"][name] = {
            "settings": settings,
            "config": dataclasses.asdict(config),
            "verdict": verdict,
            **axis.record(summary),
        }
    workers = f"{args.workers} process" + ("es" if args.workers > 1 else "")
    load = (load_start, _load())
    after = (
        f"Wall time of the whole comparison: {wall_s:.1f} s ({len(jobs)} runs on "
        f"{workers}, {args.threads} torch thread each; machine load, the 1-minute "
        f"load average, {_fmt_load(load[0])} at the start and {_fmt_load(load[1])} "
        f"at the end, on {os.cpu_count()} cores). CPU time of the runs (the "
        f"two-process timing's processes not counted): {sum(cpu.values()):.1f} s."
    )
    print(f"\n{after}")
    run_versions = versions()
    run_versions["torch threads"] = str(args.threads)
    record.update(
        wall_s=wall_s,
        workers=args.workers,
        load_average=list(load),
        cpu_s={job.label: cpu[job.key] for job in jobs},
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
