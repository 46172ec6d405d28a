"""Shared by the ``leantrain compare`` variants: threads, progress, the report files.

Every variant prints one table and writes ``compare.md`` (command, settings, table,
versions), ``compare.json`` (every number) and ``compare.png`` into ``--out``.
"""

from __future__ import annotations

import contextlib
import json
import platform
import shlex
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

import leantrain
from leantrain._optional import optional_import

EXTRA = "compare"  # the extra of leantrain that installs tqdm and matplotlib


def versions() -> dict[str, str]:
    """Versions and the torch thread count, for the record of a run."""
    import numpy

    return {
        "leantrain": leantrain.__version__,
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch threads": str(torch.get_num_threads()),
    }


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Use ``threads`` torch threads inside; callers (tests) keep their own after."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def progress_bar(total: int, desc: str, unit: str = "step"):  # -> tqdm
    """A progress bar of ``total`` ``unit``s on stderr (stdout holds the table),
    labelled ``desc`` (tqdm is imported late: only the CLI needs it)."""
    tqdm = optional_import("tqdm", EXTRA).tqdm
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr)


def pyplot():  # -> matplotlib.pyplot
    """matplotlib's pyplot, drawing to files only (the Agg backend: no display)."""
    optional_import("matplotlib", EXTRA).use("Agg")
    return optional_import("matplotlib.pyplot", EXTRA)


# Marks a table row timed while the machine was loaded (see jobs.RunStats).
UNDER_LOAD = "†"


def mark_under_load(label: str, under_load: bool) -> str:
    """``label`` with the :data:`UNDER_LOAD` marker when its run was under load."""
    return f"{label} {UNDER_LOAD}" if under_load else label


def write_report(
    out: Path,
    *,
    command: str,
    settings: str,
    explanation: str,
    table: str,
    after: str,
    record: dict,
    plot: Callable[[Path], None],
) -> None:
    """Write ``compare.md`` (text + table), ``compare.json`` and ``compare.png``."""
    out.mkdir(parents=True, exist_ok=True)
    md = [
        "# leantrain compare",
        "",
        f"Command: `{command}`",
        "",
        settings + ". " + explanation,
        "",
        table,
        "",
        after,
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in record["versions"].items()),
        "",
        "![loss curves and state bytes](compare.png)",
        "",
    ]
    (out / "compare.md").write_text("\n".join(md))
    (out / "compare.json").write_text(json.dumps(record, indent=1))
    plot(out / "compare.png")
    print(f"wrote {out / 'compare.md'}, {out / 'compare.png'}", file=sys.stderr)


def train_each(
    names: Sequence[str],
    steps: int,
    train: Callable[[str, Any], Any],
    label: Callable[[str], str] = str,
) -> list:
    """``train(name, bar)`` for every name under one progress bar of
    ``steps * len(names)`` ticks (``train`` ticks ``bar`` once a step); a run that
    stops early (a failure) has its remaining ticks filled in."""
    results = []
    with progress_bar(steps * len(names), "training steps") as bar:
        for k, name in enumerate(names):
            bar.set_description(label(name))
            results.append(train(name, bar))
            bar.update(steps * (k + 1) - bar.n)
    return results


def publish(
    args: Any,
    *,
    settings: str,
    table: str,
    explanation: str,
    after: str,
    results: Sequence[Any],
    wall_s: float,
    run_versions: dict[str, str],
    plot: Callable[[Path], None],
    **extra: Any,
) -> None:
    """Prints the settings and the table, and writes the report of a compare run
    (``extra``: the variant's own entries of compare.json, e.g. its baseline)."""
    print(settings)
    print(table)
    command = "leantrain " + shlex.join(args.argv)
    write_report(
        Path(args.out),
        command=command,
        settings=settings,
        explanation=explanation,
        table=table,
        after=after,
        record={
            "command": command,
            "settings": settings,
            "wall_s": wall_s,
            **extra,
            "versions": run_versions,
            "results": [asdict(r) for r in results],
        },
        plot=plot,
    )


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Mean of the last ``window`` values at every index (fewer at the start)."""
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / min(i + 1, window)
        for i in range(len(values))
    ]


def fmt(value: float, spec: str) -> str:
    """``value`` formatted with ``spec``; "-" for NaN or infinity (not measured)."""
    import math

    return format(value, spec) if math.isfinite(value) else "-"


def failed_row(name: str, status: str, note: str, width: int) -> list[str]:
    """A table row of ``width`` cells for a run that did not finish: its status in
    place of the numbers, so a failing peer or method is shown, never hidden."""
    return [name, status] + [""] * (width - 3) + [note]


def markdown_table(rows: Sequence[Sequence[str]]) -> str:
    """Rows of cells as a Markdown table (``|`` inside a cell escaped as ``\\|``)."""
    return "\n".join(
        "| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows
    )
