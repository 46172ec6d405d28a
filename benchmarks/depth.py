"""Depth: a deep, narrow GPT trained serially, pipeline-parallel and layer-parallel,
measured side by side on 2 processes and projected to 2..1024 ranks.

Part 1 (measured). For each depth N (16, 32, 64), the same GPT (d_model 128, 4 heads,
batch 8, 64 tokens, fp32, h = 1/N, AdamW lr 1e-3) starts from the same weights and
trains ``--steps`` steps on the same stdlib-text batches:

* serial: one process, one thread, plain autograd (rank 1 idles in a barrier);
* pipeline: ``torch.distributed.pipelining`` on 2 gloo processes, GPipe with 1, 2, 4,
  8 micro-batches and 1F1B with 2, 4, 8 (1F1B needs M >= stages);
* layer-parallel: ``LayerParallel`` parallelized over the same 2 processes, for
  each ``--lp`` setting ``levels,cf,fwd_iters,bwd_iters`` (``fwd_iters`` ``serial``:
  the exact serial forward with the MGRIT adjoint, ``forward_solver="serial"``).

Each run reports its median step time (steps after the first) as a ratio to serial,
the loss of the trained weights on a held-out batch (evaluated exactly, serially:
pipelines reproduce serial training, MGRIT does not), and each rank's peak resident
memory during the run (VmHWM, reset before the run). The layer times of every
micro-batch size and the message cost are measured in the same processes, while both
are busy, and fed to the two simulators; ``pred/meas`` is the simulated 2-process
step over the measured one.

Part 2 (projected). From those layer times and the measured gloo message cost: step
time of MGRIT (the best of the ``--lp`` settings and the ``--project-lp`` ones, which
are timed by the simulator only) and of the best pipeline (schedule and micro-batch
count up to the batch, layer time of each micro-batch size as measured) for
P = 2..1024 ranks and N = 16..1024 layers; the crossover where MGRIT wins, and a
plot.

The runs are :mod:`leantrain.compare.depth_runs`, the tables
:mod:`leantrain.compare.depth_tables`.

Run: ``python benchmarks/depth.py`` (``--quick``: tiny sizes, a smoke test);
``--plot PATH`` for the PNG (default ``depth_projection.png``); ``--save PATH`` keeps
the measurements as JSON (rewritten after each depth, so a run cut short keeps the
depths it finished) and ``--load PATH`` reprints the tables and the projection from
such a file without measuring.
"""

from __future__ import annotations

import argparse
import time

from leantrain.compare.depth_plot import plot_projection
from leantrain.compare.depth_runs import check_settings, measure, parse_lp
from leantrain.compare.depth_tables import (
    load,
    print_measured,
    print_projection,
    report_depth,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument(
        "--lp",
        nargs="+",
        default=["2,4,1,1", "2,4,2,1"],
        help="MGRIT settings levels,cf,fwd_iters,bwd_iters (fwd_iters 'serial': "
        "exact forward, MGRIT adjoint)",
    )
    parser.add_argument(
        "--project-lp",
        nargs="*",
        default=["3,4,1,1", "4,4,1,1"],
        help="more MGRIT settings for the projection only (not trained here)",
    )
    parser.add_argument(
        "--layer-reps",
        type=int,
        default=9,
        help="layer-time samples per micro-batch size, at least (spread over the runs)",
    )
    parser.add_argument("--plot", default="depth_projection.png")
    parser.add_argument(
        "--save",
        default=None,
        help="write the measurements as JSON to this path, after each depth",
    )
    parser.add_argument(
        "--load",
        default=None,
        help="reprint and reproject a --save file instead of measuring",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.depths, args.d, args.heads, args.tokens = [8, 16], 32, 2, 16
        args.steps, args.layer_reps = 3, 3
    if not any(",serial," in s for s in args.lp):
        args.lp.append("2,4,serial,1")
    runs = check_settings(args)
    for spec in args.project_lp:
        parse_lp(spec)  # refuse a malformed one before the long measurement
    start = time.perf_counter()
    if args.load:
        res = load(args.load, args)
        runs = [
            r for r in check_settings(args) if r.label in res["depths"][args.depths[0]]
        ]
    else:
        res = measure(args, runs, on_depth=report_depth)
    print_measured(args, runs, res)
    settings = [r.lp for r in runs if r.kind == "lp"]
    settings += [parse_lp(spec) for spec in args.project_lp]
    plot_projection(print_projection(args, settings, res), args.plot, "gloo")
    print(f"\nplot: {args.plot}")
    print(f"\n(total {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
