"""``leantrain compare``: its options and which comparison they run.

``leantrain compare`` (no arguments) reports the three axes, memory, curvature and
depth (:mod:`leantrain.compare.axes`); ``leantrain compare memory|curvature|depth``
one of them. With a single-model option (``--model``, ``--optimizers``, ``--steps``,
...) it trains one seeded model with several optimizers (same initial weights, same
batches in the same order) and reports final losses, optimizer state bytes per
parameter and step times, each as a ratio to AdamW
(:mod:`leantrain.compare.single_model`). ``--peers`` runs the published peer
optimizers instead (:mod:`leantrain.compare.peers`), ``--precond`` the
gradient-preconditioning methods against SGD and AdamW
(:mod:`leantrain.compare.precond`). ``leantrain compare --help`` describes the
axes, ``leantrain compare AXIS --help`` one axis' settings. See docs/compare.md.

Its packages (tqdm, matplotlib, scikit-learn) are the ``compare`` extra:
:func:`dispatch_compare` checks them before any run starts.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from leantrain._optional import optional_import
from leantrain.compare.axes import AXES, run_axes
from leantrain.compare.devices import DEVICE_CHOICES, resolve_device
from leantrain.compare.optimizers import PEERS, VARIANTS
from leantrain.compare.report import EXTRA
from leantrain.compare.single_model import run_compare
from leantrain.compare.tasks import TASKS
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


# The options of every run of ``leantrain compare`` and their defaults.
RUN_DEFAULTS = {
    "seed": 0,
    "out": "leantrain-compare",
    "threads": 1,
    "workers": 2,
    "device": "auto",
}

COMPARE_DESCRIPTION = (
    "With no axis and no single-model option: the three axes (memory, curvature, "
    "depth; listed at the end), each against its baseline on the embedded data, "
    "their independent runs on --workers processes under one progress bar; prints "
    "one table per axis and writes compare.md, compare.json and compare.png to "
    "--out (docs/compare.md). 'leantrain compare AXIS' runs one axis, 'leantrain "
    "compare AXIS --help' gives its settings. Any single-model option trains one "
    "model with several optimizers instead."
)


def _add_run_options(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    *,
    seed_help: str,
    workers_help: str,
    defaults: bool,
) -> None:
    """``--seed``, ``--out``, ``--threads``, ``--workers``, ``--device``. An axis'
    parser leaves
    them unset unless given (``defaults=False``): argparse copies a subcommand's
    defaults over what ``leantrain compare`` parsed before it."""

    def default(name: str):
        return RUN_DEFAULTS[name] if defaults else argparse.SUPPRESS

    parser.add_argument(
        "--seed", type=int, default=default("seed"), help=f"{seed_help} (default 0)"
    )
    parser.add_argument(
        "--out",
        default=default("out"),
        help="output folder (default leantrain-compare)",
    )
    # One thread by default: timings stay comparable and robust on shared machines
    # (two threads on two busy cores made steps up to 10x slower here).
    parser.add_argument(
        "--threads",
        type=_positive_int,
        default=default("threads"),
        help="torch threads per process (default 1)",
    )
    parser.add_argument(
        "--workers",
        type=_positive_int,
        default=default("workers"),
        help=f"{workers_help} (default 2)",
    )
    parser.add_argument(
        "--device",
        choices=DEVICE_CHOICES,
        default=default("device"),
        help="where the axes run: auto (the default: cuda when torch finds a CUDA "
        "device, else cpu), cpu or cuda; on cuda each axis runs at its GPU size "
        "and the runs one at a time (docs/compare.md). The single-model comparison "
        "runs on the CPU.",
    )


def _add_axis_parsers(parser: argparse.ArgumentParser) -> None:
    """``leantrain compare memory|curvature|depth``, each with its own help."""
    axes = parser.add_subparsers(
        dest="axis",
        title="one axis (default: all three)",
        metavar="AXIS",
        prog=parser.prog,  # not derived from the usage line
    )
    for name, axis in AXES.items():
        config = axis.config(argparse.Namespace(seed=RUN_DEFAULTS["seed"]))
        sub = axes.add_parser(name, help=axis.title, description=axis.describe(config))
        n_runs = len(axis.jobs(config))
        _add_run_options(
            sub,
            seed_help=axis.seed_help,
            workers_help=f"processes for the axis' {n_runs} independent runs",
            defaults=False,
        )
        # Accepted only to be refused by dispatch_compare, naming the axis.
        for dest, flag in SINGLE_MODEL_OPTIONS.items():
            sub.add_argument(
                flag,
                dest=dest,
                nargs="?",
                const=True,
                default=argparse.SUPPRESS,
                help=argparse.SUPPRESS,
            )


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``leantrain compare`` (defaults per model come from TASKS)."""
    parser.description = COMPARE_DESCRIPTION
    parser.usage = "%(prog)s [AXIS] [options]"
    _add_run_options(
        parser.add_argument_group("options of the axes and the single-model run"),
        seed_help="axes: the seed (memory: the first of three); single model: "
        "initial weights and data order",
        workers_help="processes for the axes' independent runs (not used by the "
        "single-model comparison)",
        defaults=True,
    )
    single = parser.add_argument_group(
        "single-model comparison",
        "Any of these trains one seeded model with several optimizers instead of "
        "running the axes.",
    )
    single.add_argument(
        "--model",
        choices=list(TASKS),
        default=None,
        help="gpt: GPT.default() on text (the default; with --precond: mlp); "
        "mlp, cnn: image classifiers",
    )
    single.add_argument(
        "--data",
        default=None,
        help="gpt: 'stdlib' (default) or a text file/folder; mlp/cnn: 'digits' "
        "(default) or a folder of <class>/*.png",
    )
    what = single.add_mutually_exclusive_group()
    what.add_argument(
        "--optimizers",
        type=_name_list("optimizer", list(VARIANTS)),
        help=f"comma-separated, from: {', '.join(VARIANTS)} (default: "
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
        single.add_argument(option, type=_positive_int, help=f"default {defaults}")
    lrs = ", ".join(f"{k}: {v.lr}" for k, v in TASKS.items())
    single.add_argument(
        "--lr",
        type=_positive_float,
        help=f"default {lrs} (with --precond: AdamW's only; the methods use the "
        "registry's)",
    )
    _add_axis_parsers(parser)


def require_compare_extra() -> None:
    """Raise ImportError naming ``leantrain[compare]`` if one of its packages is
    missing: before a run starts, not at its plot."""
    for module in ("tqdm", "matplotlib", "sklearn"):
        optional_import(module, EXTRA)


def dispatch_compare(args: argparse.Namespace) -> list:
    """Run the variant of ``leantrain compare`` the options ask for.

    Raises:
        ValueError: conflicting options, or ``--device cuda`` where no CUDA
            device is available or with a single-model option.
    """
    require_compare_extra()
    given = [flag for dest, flag in SINGLE_MODEL_OPTIONS.items() if getattr(args, dest)]
    if args.axis is not None or not given:
        if given:
            raise ValueError(
                f"{', '.join(given)} apply to the single-model comparison; leave "
                f"out the axis {args.axis!r} to run it"
            )
        args.device = resolve_device(args.device)
        return run_axes(args, [args.axis] if args.axis else list(AXES))
    if args.device == "cuda":
        raise ValueError(
            "--device cuda applies to the axes; the single-model comparison "
            f"({', '.join(given)}) runs on the CPU (--device cpu or auto)"
        )
    args.device = "cpu"
    if args.model is None:  # preconditioning wants a small model
        args.model = "mlp" if args.precond else "gpt"
    if args.peers:
        from leantrain.compare.peers import run_peers

        return run_peers(args)
    if args.precond:
        from leantrain.compare.precond import run_precond

        return run_precond(args)
    if args.optimizers is None:
        args.optimizers = list(DEFAULT_OPTIMIZERS)
    return run_compare(args)


COMPARE_HELP = (
    "the three axes (memory, curvature, depth) side by side, or one model with "
    "AdamW and Gefen (or the peers, or the preconditioning methods) from the same "
    "start; print and save the tables"
)
