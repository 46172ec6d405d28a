"""benchmarks/gefen_step_floor.py runs and prints each step's cost per element, in
memory and in cache, against fused AdamW's from the same run."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gefen_step_floor.py"


def test_prints_every_contender_against_fused_adamw():
    out = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--big",
            "512x256",
            "--small",
            "64x64",
            "--repeats",
            "1",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lines = out.strip().splitlines()
    assert lines[0].startswith("torch ") and "memory: 512x256" in lines[0]
    rows = {line[:42].strip(): line[42:].split() for line in lines[3:-1]}
    assert list(rows) == [
        "torch AdamW (fused=True)",
        "p.add_(g) (bandwidth reference)",
        "Gefen 8-bit (defaults)",
        "Gefen 4-bit (defaults)",
        "Gefen 8-bit, blocks v, nearest codes",
        "Gefen 8-bit, factored v, nearest codes",
        "Gefen 8-bit, blocks v, stochastic codes",
    ]
    assert rows["torch AdamW (fused=True)"][3] == "1.00"  # mem /fused of itself
    for values in rows.values():
        assert len(values) == 5
        float(values[0]), float(values[1])  # numbers, whatever their sign at this size


def test_rejects_a_bad_shape():
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--big", "1x100"], capture_output=True, text=True
    )
    assert run.returncode == 2 and "ROWSxCOLS" in run.stderr
