"""benchmarks/gefen_seeds.py: the multi-seed quality study's statistics and one run."""

from __future__ import annotations

import importlib.util
import math
import statistics
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def seeds_module():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # it imports gefen_quality
    try:
        path = ROOT / "benchmarks" / "gefen_seeds.py"
        spec = importlib.util.spec_from_file_location("bench_gefen_seeds", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_parse_seeds(seeds_module):
    assert seeds_module.parse_seeds("0-3") == [0, 1, 2, 3]
    assert seeds_module.parse_seeds("5,2") == [5, 2]
    with pytest.raises(ValueError, match="empty"):
        seeds_module.parse_seeds("3-1")


def test_summary_is_the_geometric_mean_with_a_t_interval(seeds_module):
    ratios = [0.97, 1.05, 1.01, 1.10]
    mean, low, high = seeds_module.summary(ratios)
    logs = [math.log(r) for r in ratios]
    assert mean == pytest.approx(math.exp(statistics.fmean(logs)))
    half = 3.18 * statistics.stdev(logs) / 2  # t(0.975, 3 dof), sqrt(4)
    assert low == pytest.approx(mean * math.exp(-half))
    assert high == pytest.approx(mean * math.exp(half))
    # sixteen and more seeds still use t (20 dof: 2.09), not the normal 1.96
    many = [1.0 + 0.01 * (i % 5) for i in range(21)]
    logs = [math.log(r) for r in many]
    mean, low, _ = seeds_module.summary(many)
    half = 2.09 * statistics.stdev(logs) / math.sqrt(21)
    assert low == pytest.approx(mean * math.exp(-half))
    same = seeds_module.summary([1.02, 1.02, 1.02])
    assert same == pytest.approx((1.02, 1.02, 1.02))
    one = seeds_module.summary([1.3])
    assert one[0] == pytest.approx(1.3) and math.isnan(one[1]) and math.isnan(one[2])


def test_unknown_variant_is_refused(seeds_module):
    with pytest.raises(ValueError, match="adamw-eps"):
        seeds_module.register("adamw-big")


def test_a_diverged_run_makes_the_summary_nan(seeds_module):
    for bad in (math.nan, math.inf):
        assert all(math.isnan(x) for x in seeds_module.summary([1.0, bad, 1.1]))


def test_short_run_prints_every_seed_and_the_summary(seeds_module, capsys, tmp_path):
    from leantrain import compare

    registry, threads = dict(compare.OPTIMIZERS), torch.get_num_threads()
    seeds_module.main(
        [
            "--model",
            "mlp",
            "--seeds",
            "0-1",
            "--steps",
            "3",
            "--threads",
            "1",
            "--variants",
            "adamw-eps,8:auto",
            "--plot",
            str(tmp_path / "seeds.png"),
        ]
    )
    out = capsys.readouterr().out
    rows = [
        line.split() for line in out.splitlines() if line.split()[:1] in (["0"], ["1"])
    ]
    assert len(rows) == 2
    for row in rows:
        eps_ratio, gefen_ratio = float(row[2]), float(row[3])
        # three steps of AdamW with eps 1e-7 instead of 1e-8: the same loss to ~1e-3
        assert eps_ratio == pytest.approx(1.0, abs=1e-2)
        assert math.isfinite(gefen_ratio) and gefen_ratio > 0
    assert "geo-mean" in out and "8:auto" in out
    # the summary also holds each variant's training-loss ratio and its interval
    after_header = out.split("geo-mean")[1].splitlines()
    eps_row = next(line.split() for line in after_header if "adamw-eps" in line)
    eps_train = float(eps_row[4])  # name, mean, [low, high], train mean, ...
    assert eps_train == pytest.approx(1.0, abs=1e-2)
    assert "train loss" in out
    png = (tmp_path / "seeds.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    # the study leaves compare's registry and the thread count as it found them
    assert compare.OPTIMIZERS == registry and torch.get_num_threads() == threads
