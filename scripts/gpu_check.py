"""Write the GPU check's report: the ``gpu`` suite's results and every measured section
(``gpu_sections.py``) in one Markdown file and one JSON file.

Run through ``scripts/gpu_check.sh OUT_DIR [--quick]``, which runs the suite first
and passes its JUnit XML here. A section that raises is recorded with its cause and
the others still run; the exit status is 1 when a section failed or a suite test
failed, else 0. ``--quick`` runs every section at a tiny size (on CPU in about a
minute; the default test suite runs it so the check is never broken when a GPU
arrives).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

import gpu_sections as sections
import torch

SECTIONS = {
    "optimizer_step": sections.optimizer_step,
    "precond_step": sections.precond_step,
    "training": sections.training,
    "depth": sections.depth,
}


def suite_results(xml_path: Path | None) -> dict:
    """Counts and the failed tests (name and the first line of the cause) of a JUnit
    XML file; ``{"ran": False}`` when there is none."""
    if xml_path is None or not xml_path.exists():
        return {"ran": False}
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures = []
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None:
            counts["failed"] += 1
            cause = (bad.get("message") or bad.text or "").strip().splitlines()
            failures.append({"test": name, "cause": cause[0] if cause else ""})
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {"ran": True, **counts, "failures": failures}


def suite_collected(log_path: Path) -> dict:
    """The tests ``pytest --collect-only -q`` listed (one node id per line)."""
    ids = [ln for ln in log_path.read_text().splitlines() if "::" in ln]
    return {"ran": False, "collected": len(ids)}


def environment(device: torch.device) -> dict:
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(" ", "seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(device),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def run_sections(names, size, device) -> dict:
    results = {}
    for name in names:
        started = time.perf_counter()
        try:
            result = SECTIONS[name](size, device)
            results[name] = {"ok": True, "result": result}
        except Exception as exc:  # recorded, so the other sections still run
            results[name] = {
                "ok": False,
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }
        results[name]["seconds"] = time.perf_counter() - started
        print(f"{name}: {results[name]['seconds']:.0f} s", file=sys.stderr, flush=True)
    return results


def _cell(value, fmt: str = ".2f") -> str:
    return "-" if value is None else format(value, fmt)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def _optimizer_md(r: dict) -> list[str]:
    head = [
        f"{r['parameters'] / 1e6:.1f} M parameters in {r['tensors']} tensors; "
        "leantrain.compare.optimizer_step's measurement (the one "
        "benchmarks/gefen_step.py prints, run once): median of the round-robin "
        "steps after a warm-up round, x fused AdamW of the same dtype and run, "
        "bandwidth x p.add_(g)'s, the first step cold (first of its kind) and warm.",
        "",
    ]
    rows = [
        [
            x["dtype"],
            x["optimizer"],
            _cell(x["ms_per_step"], ".2f"),
            str(x["timed_steps"]),
            _cell(x["x_fused_adamw"]),
            _cell(x["state_bytes_per_param"], ".3f"),
            _cell(x["gb_per_s"], ".1f"),
            _cell(x["x_add_bandwidth"]),
            _cell(x["peak_extra_x_param_bytes"], ".3f"),
            _cell(x["first_step_cold_ms"], ".1f"),
            _cell(x["first_step_warm_ms"], ".1f"),
        ]  # fmt: skip
        for x in r["rows"]
    ]
    header = ["dtype", "optimizer", "step ms", "timed", "x fused", "state B/param"]
    header += ["GB/s", "x add_ GB/s", "peak extra / param bytes"]
    header += ["first step cold ms", "warm ms"]
    return head + _table(header, rows)


def _precond_md(r: dict) -> list[str]:
    warm, timed = r["steps"]
    refresh_warm, refresh_timed = r["refresh_steps"]
    head = [
        f"GPT {r['parameters'] / 1e6:.1f} M, batch {r['batch'][0]} x {r['batch'][1]}; "
        "leantrain.compare.precond_step's measurement (the one "
        "benchmarks/precond_step.py --schedule prints on CPU): ms per whole training "
        "step (forward, backward, step) in the user's loop, median of "
        f"{timed} steps after {warm} of warm-up ({refresh_timed} after "
        f"{refresh_warm} for the curvature and refresh arms), x {r['reference']} "
        f"({_cell(r['reference_ms'], '.1f')} ms). A plain step only applies the "
        "preconditioner; a curvature step also updates the statistics; a refresh "
        "step also rebuilds the preconditioner. The schedules (C, I: curvature "
        "every C steps, preconditioner every I) come from the registry "
        "(leantrain.precond.PRECOND_METHODS); the mean step of a run on them is "
        "step_cost.schedule_mean_step of the three. SOAP wraps SGD without "
        "momentum, the others AdamW(fused).",
        "",
    ]
    rows = [
        [
            x["method"],
            str(tuple(x["schedule"])),
            _cell(x["plain_x_adamw"]),
            _cell(x["floor"], ".3f"),
            _cell(x["curvature_ms"], ".1f"),
            _cell(x["refresh_ms"], ".1f"),
            _cell(x["mean_x_adamw"]),
        ]  # fmt: skip
        for x in r["methods"]
    ]
    header = ["method", "schedule (C, I)", "plain x AdamW", "floor"]
    header += ["curvature ms", "refresh ms", "schedule mean x AdamW"]
    arm_rows = [
        [x["arm"], x["kind"], _cell(x["median_ms"], ".1f"), _cell(x["x_adamw"])]
        for x in r["arms"]
    ]
    arms = ["", "Every arm:", ""]
    arms += _table(["arm", "kind", "median ms", "x AdamW"], arm_rows)
    return head + _table(header, rows) + arms


def _training_md(r: dict) -> list[str]:
    head = [
        f"GPT {r['parameters'] / 1e6:.1f} M, batch {r['batch'][0]} x {r['batch'][1]}, "
        "same init and batches; each run stops at its step count or time budget. "
        f"Loss at step {r['common_step']} (the last all reached): mean training loss "
        "of the 10 steps before it.",
        "",
    ]
    rows = [
        [
            name,
            str(x["steps"]),
            _cell(x["ms_per_step"], ".1f"),
            _cell(x["loss_at_common"], ".4f"),
            _cell(x["loss_x_adamw"], ".3f"),
            _cell(x["val_loss"], ".4f"),
        ]  # fmt: skip
        for name, x in r["runs"].items()
    ]
    header = ["optimizer", "steps", "ms/step", "loss at common step", "x AdamW"]
    header += ["held-out loss at its end"]
    return head + _table(header, rows)


def _depth_md(r: dict) -> list[str]:
    lines = [
        "Layer step ms (forward / forward recording / backward / backward with "
        "parameters) per micro-batch count:",
        "",
    ]
    rows = [
        [str(m)]
        + [_cell(t[k], ".3f") for k in ("forward", "forward_record")]
        + [_cell(t[k], ".3f") for k in ("backward", "backward_params")]
        for m, t in r["layer_ms_by_micro_batches"].items()
    ]
    lines += _table(["micro-batches", "fwd", "fwd rec", "bwd", "bwd params"], rows)
    for name, p in r["projections"].items():
        lines += [
            "",
            f"Projected with messages from the {name} ({p['latency_us']:.1f} us, "
            f"{p['bandwidth_gb_s']:.1f} GB/s): best pipeline step / MGRIT step "
            "(> 1, bold: layer-parallel faster)",
            "",
            p["table"],
        ]
    return lines


RENDER = {
    "optimizer_step": ("Optimizer step", _optimizer_md),
    "precond_step": ("Preconditioned training step", _precond_md),
    "training": ("Short training run: AdamW against Gefen", _training_md),
    "depth": ("Depth: layer-parallel against pipeline parallelism", _depth_md),
}


def markdown(report: dict) -> str:
    env, suite = report["environment"], report["suite"]
    lines = ["# leantrain GPU check", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += [f"- quick: {report['quick']}"]
    seconds = f"sections {report['seconds']:.0f}, suite {suite['seconds']}"
    lines += [f"- seconds: {seconds}", ""]
    lines += ["## gpu suite", ""]
    if "collected" in suite:
        lines.append(
            f"not run: no CUDA device; {suite['collected']} tests collected "
            f"(pytest exit {suite['exit']})"
        )
    elif not suite["ran"]:
        lines.append(f"not run (no JUnit XML; pytest exit {suite['exit']})")
    elif suite["exit"] in (2, 124):  # SIGINT at the budget (timeout says 124)
        lines.append("CUT at GPU_CHECK_SUITE_S: the counts are of the tests that ran")
    if suite["ran"]:
        lines.append(
            f"{suite['passed']} passed, {suite['failed']} failed, "
            f"{suite['skipped']} skipped in {_cell(suite['seconds'], '.0f')} s "
            f"(pytest exit {suite['exit']})"
        )
        lines += [f"- FAILED `{f['test']}`: {f['cause']}" for f in suite["failures"]]
    for name, section in report["sections"].items():
        title, render = RENDER[name]
        lines += ["", f"## {title} ({section['seconds']:.0f} s)", ""]
        if section["ok"]:
            lines += render(section["result"])
        else:
            lines += [f"FAILED: {section['error']}", "", "```", section["traceback"]]
            lines += ["```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="report folder")
    parser.add_argument("--suite-xml", type=Path, help="the gpu suite's JUnit XML")
    parser.add_argument(
        "--suite-collected", type=Path,
        help="the log of a collect-only run of the gpu suite (no CUDA here)",
    )  # fmt: skip
    parser.add_argument("--suite-exit", type=int, help="pytest's exit status")
    parser.add_argument("--suite-seconds", type=float, help="the suite's wall time")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CPU)")
    parser.add_argument(
        "--device", default="auto", choices=("auto", "cpu", "cuda"),
        help="auto: cuda when there is one",
    )  # fmt: skip
    parser.add_argument(
        "--sections", default=",".join(SECTIONS),
        help=f"comma-separated subset of {', '.join(SECTIONS)}",
    )  # fmt: skip
    args = parser.parse_args(argv)
    names = [s for s in args.sections.split(",") if s]
    unknown = [s for s in names if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    device = torch.device(args.device)
    size = sections.QUICK if args.quick else sections.FULL
    if args.quick and device.type == "cpu":
        # One intra-op thread, as the test suite runs: on a loaded machine a
        # second OpenMP thread spins for a core others hold (a batched eigh of the
        # preconditioners' 256 x 256 factors took 12 s instead of 15 ms).
        torch.set_num_threads(1)
    started = time.perf_counter()
    report = {
        "environment": environment(device),
        "quick": args.quick,
        "suite": {
            **(
                suite_collected(args.suite_collected)
                if args.suite_collected
                else suite_results(args.suite_xml)
            ),
            "exit": args.suite_exit,
            "seconds": args.suite_seconds,
        },
        "sections": run_sections(names, size, device),
    }
    report["seconds"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(json.dumps(report, indent=1))
    (args.out / "report.md").write_text(markdown(report))
    print(f"report: {args.out / 'report.md'}", file=sys.stderr)
    # pytest: 0 all passed, 1 some failed; anything else means it did not run
    suite_bad = args.suite_exit not in (0, None)
    failed = suite_bad or not all(s["ok"] for s in report["sections"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
