"""The depth comparison's tables: what :mod:`~.depth_runs` measured, next to what the
simulators predict from the sampled layer times, and the projection to 2..1024 ranks;
the measurements saved as JSON and loaded back (``benchmarks/depth.py --save/--load``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from leantrain.compare.depth_runs import RANKS, Run
from leantrain.layer_parallel.costs.projection import (
    MGRITSetting,
    project,
    projection_table,
)
from leantrain.layer_parallel.costs.simulate import (
    CommModel,
    LayerTimes,
    OutsideTimes,
)
from leantrain.layer_parallel.costs.simulate_pipeline import simulate_pipeline

PROJECT_DEPTHS = [16, 32, 64, 128, 256, 512, 1024]
PROJECT_RANKS = [2**k for k in range(1, 11)]


_SAVED_ARGS = ("d", "heads", "batch", "tokens", "steps", "lr", "micro_batches", "lp")


def save(path: str, args, res: dict) -> None:
    """Write the measurements (so far) as JSON; ``--load`` reprints and reprojects."""
    out = {
        "args": {k: getattr(args, k) for k in _SAVED_ARGS},
        "load_average": os.getloadavg()[0],
        "comm": [res["comm"].latency, res["comm"].bandwidth],
        "state_bytes": res["state_bytes"],
        "act": res["act"],
        "times": {
            str(m): [t.forward, t.backward, t.forward_record, t.backward_params]
            for m, t in res["times"].items()
        },
        "outside": {
            str(m): list(dataclasses.astuple(t)) for m, t in res["outside"].items()
        },
        "depths": {str(n): rows for n, rows in res["depths"].items()},
    }
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


def load(path: str, args) -> dict:
    """The measurements saved by :func:`save`; sets the run's settings on ``args``."""
    with open(path) as f:
        data = json.load(f)
    for k, v in data["args"].items():
        setattr(args, k, v)
    args.depths = [int(n) for n in data["depths"]]
    args.load_average = data["load_average"]
    return {
        "comm": CommModel(*data["comm"]),
        "state_bytes": data["state_bytes"],
        "act": data["act"],
        "times": {int(m): LayerTimes(*t) for m, t in data["times"].items()},
        "outside": {
            int(m): OutsideTimes(*t) for m, t in data.get("outside", {}).items()
        }
        or None,
        "depths": {int(n): rows for n, rows in data["depths"].items()},
    }


def _predict(run: Run, depth: int, res: dict) -> tuple[float, list[float]]:
    """Simulated step seconds, and the activation bytes each rank holds at its peak
    (a layer's saved tensors times the layers and micro-batches in flight)."""
    times, comm, sb, act = (res[k] for k in ("times", "comm", "state_bytes", "act"))
    outside = res.get("outside") or {}
    row = res["depths"][depth][run.label]
    if "times" in row:  # sampled between this run's own steps
        times = {int(m): LayerTimes(*t) for m, t in row["times"].items()}
        outside = {int(m): OutsideTimes(*t) for m, t in row["outside"].items()}
    full = times[1]
    if run.kind == "serial":
        ends = outside[1].step(depth) if outside else 0.0
        return depth * full.serial_step + ends, [depth * act, 0.0]
    if run.kind == "lp":  # the final sweep keeps the graphs of the rank's layers
        per_rank = depth // RANKS * act
        step = run.lp.step(depth, RANKS, full, comm, sb, outside.get(1))
        return step, [per_rank] * RANKS
    m = run.micro_batches
    r = simulate_pipeline(
        depth,
        RANKS,
        m,
        times[m],
        schedule=run.kind,
        comm=comm,
        state_bytes=sb / m,
        serial_times=full,
        layer_activation_bytes=act / m,
        outside=outside.get(m),
        serial_outside=outside.get(1),
    )
    return r.step, list(r.activation_bytes)


def print_measured(args, runs: list[Run], res: dict, only: int | None = None) -> None:
    """The part-1 tables (of depth ``only``, with the layer times sampled so far)."""
    comm = res["comm"]
    so_far = " so far" if only else ""
    print(
        f"\n## Measured{so_far}: GPT d={args.d}, {args.heads} heads, batch "
        f"{args.batch}, {args.tokens} tokens, fp32, {args.steps} AdamW steps, "
        f"2 gloo processes x 1 thread; load average "
        f"{getattr(args, 'load_average', os.getloadavg()[0]):.1f}"
    )
    print(
        f"message {comm.latency * 1e6:.0f} us + {comm.bandwidth / 1e6:.0f} MB/s; layer"
        " ms (fwd / fwd+graph / vjp / vjp+params) per micro-batch count: "
        + "; ".join(f"M={m}: {_ms(t)}" for m, t in res["times"].items())
        + f"; a layer saves {res['act'] / 2**20:.1f} MB for its backward (batch)"
    )
    if res.get("outside"):
        print(
            "outside the stack ms (embed / head fwd / head bwd / AdamW per layer / "
            "AdamW embed+head) per micro-batch count: "
            + "; ".join(
                f"M={m}: "
                + " / ".join(f"{v * 1e3:.2f}" for v in dataclasses.astuple(t))
                for m, t in res["outside"].items()
            )
        )
    sys.stdout.flush()
    for depth, rows in res["depths"].items():
        if only is not None and depth != only:
            continue
        serial = rows[runs[0].label]["step"]
        print(f"\n### N = {depth}\n")
        print(
            "| run | step s | vs serial (time ratio) | predicted s | pred/meas "
            "| held-out loss | peak MB (rise) rank 0 / 1 | model activations MB |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for run in runs:
            r = rows[run.label]
            pred, act = _predict(run, depth, res)
            peak = " / ".join(f"{p:.0f} ({d:.0f})" for p, d in r["peak"])
            act_mb = " / ".join(f"{a / 2**20:.0f}" for a in act)
            print(
                f"| {run.label} | {r['step']:.3f} | {r['step'] / serial:.2f} | "
                f"{pred:.3f} | {pred / r['step']:.2f} | {r['loss']:.4f} | {peak} | "
                f"{act_mb} |"
            )
    sys.stdout.flush()


def _ms(t: LayerTimes) -> str:
    parts = (t.forward, t.forward_record, t.backward, t.backward_params)
    return " / ".join(f"{v * 1e3:.1f}" for v in parts)


def print_projection(args, settings: list[MGRITSetting], res: dict) -> list:
    # CPU layer steps dwarf any message here; a GPU projection needs GPU layer times
    cells = project(
        PROJECT_DEPTHS,
        PROJECT_RANKS,
        res["times"],
        settings,
        res["comm"],
        res["state_bytes"],
        res.get("outside"),
    )
    print(
        "\n## Projected, gloo messages as measured: best pipeline step / MGRIT step "
        "(> 1: layer-parallel faster, **bold**; -: a layout cannot run)\n"
    )
    print(projection_table(cells))
    return cells


def report_depth(args, runs: list[Run], results: dict, depth: int) -> None:
    """:func:`~.depth_runs.measure`'s ``on_depth``: print the table of ``depth`` and,
    with ``args.save``, rewrite the JSON (a run cut short keeps the depths done)."""
    print_measured(args, runs, results, only=depth)
    if args.save:
        save(args.save, args, results)
