"""The ``leantrain`` command: argument parsing and dispatch.

``leantrain compare`` (no arguments) reports the three axes, memory, curvature and
depth (:mod:`leantrain.compare_axes`); ``leantrain compare memory|curvature|depth``
one of them. With a single-model option (``--model``, ``--optimizers``, ``--steps``,
...) it trains one seeded model with several optimizers (same initial weights, same
batches in the same order) and reports final losses, optimizer state bytes per
parameter and step times, each as a ratio to AdamW (:mod:`leantrain.compare`).
``--peers`` runs the published peer optimizers instead
(:mod:`leantrain.compare_peers`), ``--precond`` the gradient-preconditioning methods
against SGD and AdamW (:mod:`leantrain.compare_precond`). See docs/compare.md.

Extending: a subcommand is one entry in :data:`COMMANDS` (name -> (add_arguments,
run)); optimizers and tasks are registries of :mod:`leantrain.compare`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from leantrain.compare import OPTIMIZERS, TASKS, run_compare
from leantrain.compare_axes import AXES, run_axes
from leantrain.peers import PEERS
from leantrain.precond.registry import PRECOND_METHODS

DEFAULT_OPTIMIZERS = ["adamw", "gefen8", "gefen4"]
# Options of the single-model comparison; any of them selects it.
SINGLE_MODEL_OPTIONS = {
    "model": "--model",
    "data": "--data",
    "optimizers": "--optimizers",
    "peers": "--peers",
    "precond": "--precond",
    "steps": "--steps",
    "batch_size": "--batch-size",
    "lr": "--lr",
}


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _name_list(kind: str, registry: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse type: comma-separated names, each from ``registry``, no repeats."""

    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in registry]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {kind}(s) {unknown or text!r}; allowed: {', '.join(registry)}"
            )
        if len(set(names)) != len(names):
            raise argparse.ArgumentTypeError(f"{kind} listed twice in {text!r}")
        return names

    return parse


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``leantrain compare`` (defaults per model come from TASKS)."""
    parser.add_argument(
        "axis",
        nargs="?",
        choices=list(AXES),
        help="run one axis (default: all three, unless a single-model option "
        "such as --model or --optimizers is given)",
    )
    parser.add_argument(
        "--model",
        choices=list(TASKS),
        default=None,
        help="gpt: GPT.default() on text (the default; with --precond: mlp); "
        "mlp, cnn: image classifiers",
    )
    parser.add_argument(
        "--data",
        default=None,
        help="gpt: 'stdlib' (default) or a text file/folder; mlp/cnn: 'digits' "
        "(default) or a folder of <class>/*.png",
    )
    what = parser.add_mutually_exclusive_group()
    what.add_argument(
        "--optimizers",
        type=_name_list("optimizer", list(OPTIMIZERS)),
        help=f"comma-separated, from: {', '.join(OPTIMIZERS)} (default: "
        f"{','.join(DEFAULT_OPTIMIZERS)})",
    )
    what.add_argument(
        "--peers",
        nargs="?",
        const=list(PEERS),
        type=_name_list("peer", list(PEERS)),
        help="compare with the published peer optimizers instead: all of them, or "
        f"a comma-separated list from: {', '.join(PEERS)} (adamw-foreach, the "
        "baseline of the ratios, is always run)",
    )
    what.add_argument(
        "--precond",
        type=_name_list("preconditioning method", list(PRECOND_METHODS)),
        help="compare preconditioned gradients with SGD and AdamW instead; "
        f"comma-separated from: {', '.join(PRECOND_METHODS)}",
    )
    for option, attr in [("--steps", "steps"), ("--batch-size", "batch_size")]:
        defaults = ", ".join(f"{k}: {getattr(v, attr)}" for k, v in TASKS.items())
        parser.add_argument(option, type=_positive_int, help=f"default {defaults}")
    lrs = ", ".join(f"{k}: {v.lr}" for k, v in TASKS.items())
    parser.add_argument(
        "--lr",
        type=_positive_float,
        help=f"default {lrs} (with --precond: AdamW's only; the methods use the "
        "registry's)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="model init and data order (default 0)"
    )
    parser.add_argument(
        "--out", default="leantrain-compare", help="output folder (%(default)s)"
    )
    # One thread by default: timings stay comparable and robust on shared machines
    # (two threads on two busy cores made steps up to 10x slower here).
    parser.add_argument(
        "--threads",
        type=_positive_int,
        default=1,
        help="torch threads (per process with the axes; %(default)s)",
    )
    parser.add_argument(
        "--workers",
        type=_positive_int,
        default=2,
        help="processes for the axes' independent runs (%(default)s)",
    )


def dispatch_compare(args: argparse.Namespace) -> list:
    """Run the variant of ``leantrain compare`` the options ask for."""
    given = [flag for dest, flag in SINGLE_MODEL_OPTIONS.items() if getattr(args, dest)]
    if args.axis is not None or not given:
        if given:
            raise ValueError(
                f"{', '.join(given)} apply to the single-model comparison; leave "
                f"out the axis {args.axis!r} to run it"
            )
        return run_axes(args, [args.axis] if args.axis else list(AXES))
    if args.model is None:  # preconditioning wants a small model
        args.model = "mlp" if args.precond else "gpt"
    if args.peers:
        from leantrain.compare_peers import run_peers

        return run_peers(args)
    if args.precond:
        from leantrain.compare_precond import run_precond

        return run_precond(args)
    if args.optimizers is None:
        args.optimizers = list(DEFAULT_OPTIMIZERS)
    return run_compare(args)


COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Callable]] = {
    "compare": (add_compare_arguments, dispatch_compare),
}
COMMAND_HELP = {
    "compare": "the three axes (memory, curvature, depth) side by side, or one "
    "model with AdamW and Gefen (or the peers, or the preconditioning methods) "
    "from the same start; print and save the tables",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="leantrain", description="Cheaper deep-network training in PyTorch."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (add_arguments, _) in COMMANDS.items():
        add_arguments(sub.add_parser(name, help=COMMAND_HELP.get(name)))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``leantrain`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        COMMANDS[args.command][1](args)
    except ValueError as err:  # bad data paths, block size too long, ...
        parser.exit(2, f"leantrain {args.command}: error: {err}\n")
    return 0
