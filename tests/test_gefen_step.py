"""benchmarks/gefen_step.py, the thin script over leantrain.compare.optimizer_step
(whose measurement tests/compare/test_optimizer_step.py checks), in its quick mode
(GPT-2's layout, tiny) on CPU: every contender steps, the ratios come from one run,
and the tables are written and printed."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gefen_step.py"


def test_quick_run_writes_both_dtypes_tables(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--threads", "1", "--repeats", "3"]
        + ["--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "gefen_step.json").read_text())
    assert result["tensors"] == 28 and result["device"] == "cpu"
    for dtype in ("float32", "bfloat16"):
        rows = {r["optimizer"]: r for r in result["dtypes"][dtype]}
        assert rows["AdamW(fused=True)"]["x_fused_adamw"] == 1.0
        assert rows["p.add_(g) (traffic reference)"]["x_add_bandwidth"] == 1.0
        for name in ("Gefen 8-bit (defaults)", "Gefen 4-bit (defaults)"):
            row = rows[name]
            assert math.isfinite(row["x_fused_adamw"]) and row["timed_steps"] >= 3
            assert row["first_step_cold_ms"] > 0 and row["first_step_warm_ms"] > 0
        # the state sizes are what the optimizers keep (every matrix factored)
        assert 1.0 < rows["Gefen 8-bit (defaults)"]["state_bytes_per_param"] < 1.2
        assert 0.5 < rows["Gefen 4-bit (defaults)"]["state_bytes_per_param"] < 0.7
        assert rows["Gefen 8-bit, blocks v"]["state_bytes_per_param"] < 1.05
    assert "| Gefen 8-bit (defaults) |" in (tmp_path / "gefen_step.md").read_text()
    assert "**bfloat16 parameters**" in proc.stdout


def test_bad_arguments_are_named(capsys):
    spec = importlib.util.spec_from_file_location("gefen_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit):
        module.parse_args(["--quick", "--dtypes", "float33"])
    assert "'float33'" in capsys.readouterr().err
