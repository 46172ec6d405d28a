"""``scripts/gpu_check.sh`` — the one command a machine with a GPU runs — in its quick
mode on CPU, so it is never broken when a GPU is lent.

The quick run goes through the same code as the full one (the shell script, the
``gpu`` suite, every section, the report), at tiny sizes. What can be checked
without a GPU is checked: the suite collects (its tests fail on purpose without CUDA,
so the script only collects them here),
every section reports finite numbers, the state sizes are what the optimizers
keep (measured, not restated), the runs from one init train, and a failing section
or suite test turns into a named failure and exit status 1 instead of a crash.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from leantrain.compare import optimizer_step
from leantrain.precond import PRECOND_METHODS, PreconditioningConfig
from leantrain.precond.step_cost import schedule_mean_step

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check  # noqa: E402


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out), "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "report.json").read_text()), (out / "report.md")


def test_the_gpu_suite_is_collected_without_cuda(quick):
    report, md = quick
    suite = report["suite"]
    assert not suite["ran"] and suite["exit"] == 0
    assert suite["collected"] >= 30  # the gpu-marked tests of every axis
    assert f"{suite['collected']} tests collected" in md.read_text()


def test_the_optimizer_step_is_measured_once(quick):
    """gpu_check.sh no longer runs benchmarks/gefen_step.py beside the section: the
    section's rows are the one measurement, each dtype's in the contenders' order."""
    out = quick[1].parent
    assert not (out / "gefen_step").exists() and not (out / "gefen_step.log").exists()
    rows = quick[0]["sections"]["optimizer_step"]["result"]["rows"]
    names = list(optimizer_step.contenders(torch.device("cpu")))
    assert [(r["dtype"], r["optimizer"]) for r in rows] == [
        (dtype, name) for dtype in ("float32", "bfloat16") for name in names
    ]


def test_every_section_reports_and_the_markdown_shows_it(quick):
    report, md = quick
    text = md.read_text()
    assert set(report["sections"]) == set(gpu_check.SECTIONS)
    for name, section in report["sections"].items():
        assert section["ok"], (name, section.get("error"))
        assert gpu_check.RENDER[name][0] in text
    assert "FAILED" not in text


def test_optimizer_step_rows_measure_time_and_state(quick):
    result = quick[0]["sections"]["optimizer_step"]["result"]
    rows = {(r["dtype"], r["optimizer"]): r for r in result["rows"]}
    for dtype, elem in (("float32", 4), ("bfloat16", 2)):
        fused = rows[(dtype, "AdamW(fused=True)")]
        assert fused["x_fused_adamw"] == 1.0
        # AdamW keeps two moments in the parameter's dtype (plus a step counter)
        assert 2 * elem <= fused["state_bytes_per_param"] < 2 * elem + 0.05
        assert rows[(dtype, "Gefen 8-bit (defaults)")]["state_bytes_per_param"] < 1.1
        assert rows[(dtype, "Gefen 4-bit (defaults)")]["state_bytes_per_param"] < 0.65
        floor = rows[(dtype, "p.add_(g) (traffic reference)")]
        assert floor["x_add_bandwidth"] == 1.0
        for (d, _), r in rows.items():
            if d == dtype:
                assert r["ms_per_step"] > 0 and math.isfinite(r["x_fused_adamw"])
                assert r["timed_steps"] >= 3
                # the nominal bytes over the measured time, from the same row
                assert r["gb_per_s"] / floor["gb_per_s"] == pytest.approx(
                    r["x_add_bandwidth"]
                )


def test_precond_and_training_rows(quick):
    sections = quick[0]["sections"]
    result = sections["precond_step"]["result"]
    arms = {a["arm"]: a for a in result["arms"]}
    adamw_ms = arms[result["reference"]]["median_ms"]
    assert arms[result["reference"]]["x_adamw"] == 1.0
    assert result["reference_ms"] == adamw_ms
    methods = result["methods"]
    assert [m["method"] for m in methods] == [
        m.row for m in gpu_check.sections.PRECOND_METHODS
    ]
    for m in methods:
        label, (c, i) = m["method"], m["schedule"]
        # the schedules are the registry's, read here from the makers' own config
        registry = PRECOND_METHODS[m["registry"]].config
        config = dataclasses.replace(PreconditioningConfig(), **registry)
        assert (c, i) == (config.curvature_interval, config.preconditioner_interval)
        plain = arms[f"{label} loop"]["median_ms"]
        refresh = arms[f"{label} refresh"]["median_ms"]
        assert plain > 0 and refresh > 0 and m["refresh_ms"] == refresh
        # a curvature-only arm exactly when the schedule has such steps
        assert (f"{label} curvature" in arms) == (i > c)
        curvature = arms[f"{label} curvature"]["median_ms"] if i > c else refresh
        assert m["plain_x_adamw"] == pytest.approx(plain / adamw_ms)
        expected = schedule_mean_step(plain, curvature, refresh, c, i) / adamw_ms
        assert m["mean_x_adamw"] == pytest.approx(expected)
        assert m["floor"] > 1
        for arm in arms.values():
            assert arm["x_adamw"] == pytest.approx(arm["median_ms"] / adamw_ms)
    runs = sections["training"]["result"]["runs"]
    assert list(runs) == list(gpu_check.sections.TRAIN_OPTIMIZERS)
    for name, run in runs.items():
        losses = run["losses"]
        assert len(losses) == run["steps"] and all(map(math.isfinite, losses))
        assert sum(losses[-5:]) / 5 < losses[0], name  # from one init, each trains
        assert math.isfinite(run["val_loss"])


def test_depth_projects_with_every_message_model(quick):
    result = quick[0]["sections"]["depth"]["result"]
    assert set(result["layer_ms_by_micro_batches"]) == {"1", "2", "4", "8"}
    for p in result["projections"].values():
        assert p["latency_us"] > 0 and p["bandwidth_gb_s"] > 0
        assert p["table"].startswith("| N |")
        assert all(c["serial_ms"] > 0 for c in p["cells"])


def test_a_failing_section_is_named_and_fails_the_check(tmp_path, monkeypatch):
    def broken(size, device):
        raise RuntimeError("no kernel image is available")

    monkeypatch.setitem(gpu_check.SECTIONS, "depth", broken)
    status = gpu_check.main(
        ["--out", str(tmp_path), "--quick", "--device", "cpu", "--sections", "depth"]
    )
    assert status == 1
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["sections"]["depth"]["error"] == (
        "RuntimeError: no kernel image is available"
    )
    text = (tmp_path / "report.md").read_text()
    assert "FAILED: RuntimeError: no kernel image" in text


def test_suite_failures_are_listed_with_their_cause(tmp_path):
    xml = tmp_path / "suite.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.optim.test_fused" name="test_a"/>'
        '<testcase classname="tests.optim.test_fused" name="test_b">'
        '<failure message="AssertionError: codes differ by 16">trace</failure>'
        "</testcase>"
        '<testcase classname="tests.x" name="test_c"><skipped message="no"/></testcase>'
        "</testsuite></testsuites>"
    )
    got = gpu_check.suite_results(xml)
    assert (got["passed"], got["failed"], got["skipped"]) == (1, 1, 1)
    assert got["failures"] == [
        {
            "test": "tests.optim.test_fused::test_b",
            "cause": "AssertionError: codes differ by 16",
        }
    ]
    status = gpu_check.main(
        ["--out", str(tmp_path), "--quick", "--sections", "", "--suite-xml", str(xml),
         "--suite-exit", "1"]
    )  # fmt: skip
    assert status == 1


def test_unknown_section_is_refused_by_name(tmp_path, capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path), "--sections", "speed"])
    assert "unknown section(s) ['speed']" in capsys.readouterr().err


def test_a_suite_cut_at_its_budget_is_reported_as_cut(tmp_path):
    # timeout(1) exits 124 after SIGINT stopped pytest; the XML holds what ran.
    xml = tmp_path / "suite.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.a" name="test_a"/>'
        "</testsuite></testsuites>"
    )
    status = gpu_check.main(
        ["--out", str(tmp_path), "--quick", "--sections", "", "--suite-xml", str(xml),
         "--suite-exit", "124"]
    )  # fmt: skip
    assert status == 1
    text = (tmp_path / "report.md").read_text()
    assert "CUT at GPU_CHECK_SUITE_S" in text and "1 passed, 0 failed" in text
