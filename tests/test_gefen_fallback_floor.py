"""benchmarks/gefen_fallback_floor.py runs and prints every op as a ratio to fused
AdamW."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gefen_fallback_floor.py"


def test_prints_each_op_against_fused_adamw():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--numel", "4096", "--repeats", "1"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lines = out.strip().splitlines()
    assert lines[0].startswith("4,096 elements")
    assert lines[1].startswith("AdamW(fused=True) step") and lines[1].endswith("1.00x")
    names = ["p.add_(g)", "codes.int()", "index_select", "codes.long()", "bucketize"]
    assert len(lines) == 2 + len(names)
    for line, name in zip(lines[2:], names, strict=True):
        assert name in line
        ratio = float(line.split()[-1].rstrip("x"))
        assert ratio > 0.0
