"""benchmarks/gefen_long.py: the long-run benchmark's statistics and quick mode."""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # it imports gefen_quality/_seeds
    try:
        path = ROOT / "benchmarks" / "gefen_long.py"
        spec = importlib.util.spec_from_file_location("bench_gefen_long", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("bench_gefen_long", None)
        sys.path.remove(str(ROOT / "benchmarks"))
        torch.set_num_threads(threads_at_import)


threads_at_import = torch.get_num_threads()


def _record(bench, setting, seed, vals, trains):
    steps = bench.eval_steps(bench.QUICK.steps)
    return {
        "setting": setting,
        "seed": seed,
        "config": asdict(bench.QUICK),
        "bytes_per_param": 1.0,
        "seconds": 0.0,
        "evals": [
            {"step": s, "val": v, "train": t}
            for s, v, t in zip(steps, vals, trains, strict=True)
        ],
    }


def test_ratios_and_interval_match_a_hand_computation(bench):
    n = bench.N_EVALS
    base_vals = {0: 2.0, 1: 3.0, 2: 2.5}
    gefen_vals = {0: 2.1, 1: 3.3, 2: 2.45}
    records = []
    for seed in base_vals:
        records.append(_record(bench, "adamw", seed, [base_vals[seed]] * n, [1.0] * n))
        ramp = [
            1.0 + (gefen_vals[seed] / base_vals[seed] - 1.0) * k / n
            for k in range(1, n + 1)
        ]
        vals = [base_vals[seed] * r for r in ramp]
        records.append(_record(bench, "8:auto", seed, vals, [1.5] * n))
    # A seed without its AdamW run, and a run of another configuration: ignored.
    records.append(_record(bench, "8:auto", 7, [9.0] * n, [9.0] * n))
    other = _record(bench, "8:auto", 0, [9.0] * n, [9.0] * n)
    other["config"] = {**other["config"], "steps": 41}
    records.append(other)

    table = bench.ratios_at(records, bench.QUICK)
    end = bench.QUICK.steps
    assert sorted(table["8:auto"]["seeds"]) == [0, 1, 2]
    ratios = [gefen_vals[s] / base_vals[s] for s in (0, 1, 2)]  # 1.05, 1.1, 0.98
    assert table["8:auto"]["val"][end] == pytest.approx(ratios)
    assert table["8:auto"]["train"][end] == pytest.approx([1.5] * 3)
    logs = [math.log(r) for r in ratios]
    half = 4.30 * statistics.stdev(logs) / math.sqrt(3)  # t(0.975, 2 dof)
    mean = statistics.fmean(logs)
    low, high = math.exp(mean - half), math.exp(mean + half)
    expected = f"{math.exp(mean):.3f} [{low:.3f}, {high:.3f}]"
    text = bench.format_table(records, bench.QUICK, ["adamw", "8:auto"])
    row = next(line for line in text.splitlines() if line.startswith("| 8:auto |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "0,1,2"
    assert cells[-3] == expected  # the end of training
    halfway = [1.0 + (r - 1.0) * (n // 2) / n for r in ratios]
    assert cells[4] == bench._cell(halfway)  # 50 %: the ratio of that step
    assert cells[-2] == "1.500 [1.500, 1.500]"
    assert cells[-1] == " ".join(f"{r:.3f}" for r in ratios)


def test_groups_cover_the_gpt_and_the_swap_makes_an_element_group(bench):
    model = bench.GPT(bench.GPTConfig(n_layer=2, d_model=32, n_head=4, block_size=16))
    groups = {bench.group_of(n, p) for n, p in model.named_parameters()}
    assert groups == set(bench.GROUPS)
    opt = bench.build_optimizer("8:auto+element=mlp/norms", model, 1e-3)
    element = next(g for g in opt.param_groups if g["partition"] == "element")
    names = {id(p): n for n, p in model.named_parameters()}
    got = {names[id(p)] for p in element["params"]}
    expected = {
        n
        for n, p in model.named_parameters()
        if (".mlp." in n and p.ndim == 2) or ".ln_" in n or n.startswith("ln_f.")
    }
    assert got == expected
    assert all(g["momentum_bits"] == 8 for g in opt.param_groups)
    with pytest.raises(ValueError, match="unknown group"):
        bench.build_optimizer("8:auto+element=mlps", model, 1e-3)
    with pytest.raises(ValueError, match="unknown peer"):
        bench.build_optimizer("peer:nope", model, 1e-3)


def test_quick_run_writes_the_results_table_and_plot(bench, tmp_path, capsys):
    out, png = tmp_path / "r.jsonl", tmp_path / "r.png"
    argv = ["--quick", "--seeds", "0-1", "--jobs", "1", "--out", str(out)]
    bench.main([*argv, "--settings", "adamw,8:auto+element=mlp", "--plot", str(png)])
    records = bench.load_results(out)
    assert sorted((r["setting"], r["seed"]) for r in records) == [
        ("8:auto+element=mlp", 0),
        ("8:auto+element=mlp", 1),
        ("adamw", 0),
        ("adamw", 1),
    ]
    assert all(len(r["evals"]) == bench.N_EVALS for r in records)
    assert png.stat().st_size > 0
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if line.startswith("| setting |"))
    assert "| seeds | B/param | 25% (10) | 50% (20) | 75% (30) | 100% (40) |" in header
    row = next(line for line in text.splitlines() if line.startswith("| 8:auto+"))
    end = [e["val"] for r in records for e in r["evals"][-1:]]
    by = {(r["setting"], r["seed"]): r["evals"][-1]["val"] for r in records}
    ratios = [by[("8:auto+element=mlp", s)] / by[("adamw", s)] for s in (0, 1)]
    assert all(math.isfinite(v) for v in end)
    assert row.split("|")[7].strip() == bench._cell(ratios)
    # Resuming: nothing is trained again, and --table reads the file alone.
    bench.main([*argv, "--settings", "adamw,8:auto+element=mlp"])
    assert len(bench.load_results(out)) == 4
    bench.main([*argv, "--table", "--settings", "adamw,8:auto+element=mlp"])
    assert row in capsys.readouterr().out
    assert json.loads(out.read_text().splitlines()[0])["config"] == asdict(bench.QUICK)


@pytest.mark.slow
def test_two_processes_write_one_line_each(bench, tmp_path):
    out = tmp_path / "r.jsonl"
    bench.main(["--quick", "--seeds", "0", "--jobs", "2", "--out", str(out)])
    settings = sorted(r["setting"] for r in bench.load_results(out))
    assert settings == ["4:auto", "8:auto", "adamw"]
