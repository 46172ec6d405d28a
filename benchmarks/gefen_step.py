"""Gefen's whole-model optimizer step against torch's AdamW, on CPU or CUDA.

Prints :func:`leantrain.compare.optimizer_step.run`'s tables, one per parameter
dtype: ms per step (median of round-robin steps; CUDA events on a GPU), x fused
AdamW, state bytes per parameter, bandwidth x ``p.add_(g)``'s, the peak extra memory
of a step and the first step cold and warm. What each column means, and the
contenders, are in that module's docstring.

Usage::

    python benchmarks/gefen_step.py --device cuda --out gefen_step/  # GPT-2 small
    python benchmarks/gefen_step.py --quick                     # tiny, CPU, seconds
    OMP_NUM_THREADS=1 python benchmarks/gefen_step.py --model stack --threads 1 \\
        --repeats 7 --clock cpu --dtypes float32
    python benchmarks/gefen_step.py --model gpt --threads 1 --repeats 21

``--out DIR`` also writes ``DIR/gefen_step.md`` and ``DIR/gefen_step.json``.
``LEANTRAIN_NO_NATIVE=1`` times Gefen's PyTorch fallback on CPU.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from leantrain.compare import optimizer_step


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N)")
    parser.add_argument(
        "--model", choices=sorted(optimizer_step.MODELS), default="gpt2"
    )
    parser.add_argument("--quick", action="store_true", help="tiny GPT-2 layout")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=20, help="timed steps at most")
    parser.add_argument(
        "--budget-s", type=float, default=60.0, help="stop after 3 rounds past it"
    )
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--clock",
        choices=optimizer_step.CLOCKS,
        default="wall",
        help="CPU only: cpu is process CPU time (with --threads 1 on a busy machine)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write .md and .json")
    args = parser.parse_args(argv)
    try:
        optimizer_step.dtypes_named(args.dtypes.split(","))
    except ValueError as exc:
        parser.error(f"--dtypes: {exc}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available here")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = optimizer_step.run(
        args.model,
        quick=args.quick,
        device=args.device,
        dtypes=args.dtypes.split(","),
        repeats=args.repeats,
        budget_s=args.budget_s,
        threads=args.threads,
        clock=args.clock,
    )
    text = optimizer_step.markdown(result)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gefen_step.md").write_text(text)
        (args.out / "gefen_step.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
