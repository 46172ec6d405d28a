"""The ``leantrain`` command: its subcommands and the console entry point.

``leantrain compare ...`` is :mod:`leantrain.compare.cli`; ``leantrain --version``
prints the version.

Extending: a subcommand is one entry in :data:`COMMANDS` (name -> (help,
add_arguments, run)).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

import leantrain
from leantrain.compare.cli import COMPARE_HELP, add_compare_arguments, dispatch_compare

COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable]] = {
    "compare": (COMPARE_HELP, add_compare_arguments, dispatch_compare),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="leantrain", description="Cheaper deep-network training in PyTorch."
    )
    parser.add_argument(
        "--version", action="version", version=f"leantrain {leantrain.__version__}"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add_arguments, _) in COMMANDS.items():
        add_arguments(sub.add_parser(name, help=help_text))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``leantrain`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        COMMANDS[args.command][2](args)
    except ValueError as err:  # bad data paths, block size too long, ...
        parser.exit(2, f"leantrain {args.command}: error: {err}\n")
    return 0
