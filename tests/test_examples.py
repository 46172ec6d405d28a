"""The layer-parallel demo (examples/lp_demo.py): the learning-rate schedule, the
perturbation that measures a run's noise floor, and the ViT demo end to end."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from lp_demo import lr_factor, perturb_  # noqa: E402


def test_lr_factor_warms_up_linearly_then_follows_the_schedule():
    steps, warmup = 100, 10
    ramp = [lr_factor(s, steps, "cosine", warmup) for s in range(warmup)]
    assert ramp == pytest.approx([(s + 1) / warmup for s in range(warmup)])
    assert [lr_factor(s, steps, "constant", warmup) for s in range(warmup, steps)] == [
        1.0
    ] * (steps - warmup)
    cosine = [lr_factor(s, steps, "cosine", warmup) for s in range(warmup, steps)]
    assert cosine[0] == 1.0
    assert all(a > b for a, b in zip(cosine, cosine[1:], strict=False))
    half = warmup + (steps - warmup) // 2
    assert lr_factor(half, steps, "cosine", warmup) == pytest.approx(0.5)
    assert 0 < cosine[-1] < 1e-3  # decays to ~0 at the end
    assert lr_factor(0, steps, "cosine") == 1.0  # no warm-up


@pytest.mark.parametrize(
    ("schedule", "warmup"), [("linear", 0), ("cosine", -1), ("cosine", 100)]
)
def test_lr_factor_rejects_bad_arguments(schedule, warmup):
    with pytest.raises(ValueError, match="schedule|warmup"):
        lr_factor(0, 100, schedule, warmup)


def test_perturb_is_relative_seeded_and_zero_is_identity():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    before = [p.detach().clone() for p in model.parameters()]
    perturb_(model, 0.0)
    assert all(
        torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True)
    )
    perturb_(model, 1e-3, seed=1)
    rel = torch.cat(
        [
            ((p.detach() - q) / q).flatten()
            for p, q in zip(model.parameters(), before, strict=True)
        ]
    )
    assert 0.8e-3 < float(rel.std()) < 1.2e-3 and math.isfinite(float(rel.abs().max()))
    twin = torch.nn.Linear(64, 32)
    with torch.no_grad():
        for p, q in zip(twin.parameters(), before, strict=True):
            p.copy_(q)
    perturb_(twin, 1e-3, seed=1)
    assert all(
        torch.equal(p, q)
        for p, q in zip(model.parameters(), twin.parameters(), strict=True)
    )
    with pytest.raises(ValueError, match="rel"):
        perturb_(model, -1.0)


@pytest.mark.parametrize("data", ["shapes", "digits"])
def test_lp_vit_runs_end_to_end_in_one_process(data, tmp_path, capsys):
    """A few steps of the ViT demo, serial and layer-parallel (one-process solver):
    the demo wires data, model and solver together, and before any step the two runs
    see the same model (the same first evaluation, up to the MGRIT forward's error)."""
    from lp_demo import make_demo, parser, run

    args = parser("test").parse_args(
        [
            "--model",
            "vit",
            "--data",
            data,
            "--steps",
            "4",
            "--layers",
            "8",
            "--procs",
            "1",
            "--eval-every",
            "2",
            "--fwd-iters",
            "2",
            "--bwd-iters",
            "2",
            "--switch-at",
            "0.5",
            "--lr",
            "1e-3",
            "--out",
            str(tmp_path / "vit.png"),
        ]
    )
    result = run(make_demo, args)
    serial, parallel = result["serial"]["curve"], result["parallel"]["curve"]
    assert [s for s, _ in serial] == [0, 2, 4] == [s for s, _ in parallel]
    assert serial[0][1] == pytest.approx(parallel[0][1], rel=1e-5)
    assert all(math.isfinite(v) for _, v in serial + parallel)
    assert (tmp_path / "vit.png").exists()
    assert "relative difference" in capsys.readouterr().out
