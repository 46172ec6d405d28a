"""``leantrain compare [memory|curvature|depth]`` with tiny settings per axis.

Every number in the tables is recomputed here from the per-step records in
compare.json (or from an independent reference: the serial network, the simulator
called directly, AdamW's state size by its definition).
"""

import dataclasses
import json
import math
import re
import statistics

import pytest

from leantrain import compare_curvature, compare_depth, compare_memory
from leantrain.cli import main
from leantrain.compare_memory import verdict
from leantrain.layer_parallel import LayerTimes
from leantrain.layer_parallel.simulate import CommModel, simulate
from leantrain.models import GPT, GPTConfig

PNG = b"\x89PNG\r\n\x1a\n"
TINY_MEMORY = dataclasses.replace(
    compare_memory.DEFAULT,
    d_model=32,
    n_head=4,
    block_size=16,
    steps=3,
    warmup=2,
    batch_size=2,
    val_batches=2,
)
TINY_CURVATURE = dataclasses.replace(compare_curvature.DEFAULT, steps=6, batch_size=16)
TINY_DEPTH = dataclasses.replace(
    compare_depth.DEFAULT,
    n_layer=8,
    d_model=16,
    n_head=2,
    tokens=8,
    batch=2,
    cf=2,
    repeats=2,
    layer_reps=2,
    projected_layers=256,
)


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setattr(compare_memory, "DEFAULT", TINY_MEMORY)
    monkeypatch.setattr(compare_curvature, "DEFAULT", TINY_CURVATURE)
    monkeypatch.setattr(compare_depth, "DEFAULT", TINY_DEPTH)


def _rows(markdown: str, section: str) -> list[list[str]]:
    """The table rows under the ``## section`` heading."""
    text = markdown.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    lines = [ln for ln in text.splitlines() if ln.startswith("| ")]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", ln[1:-1])] for ln in lines]


def _run(tmp_path, capsys, *argv, workers="1"):
    out = tmp_path / "out"
    assert main(["compare", *argv, "--out", str(out), "--workers", workers]) == 0
    stdout = capsys.readouterr().out
    record = json.loads((out / "compare.json").read_text())
    assert (out / "compare.png").read_bytes()[:8] == PNG
    return (out / "compare.md").read_text(), stdout, record


def test_memory_axis_spread_verdict_and_state_bytes(tiny, tmp_path, capsys):
    md, stdout, record = _run(tmp_path, capsys, "memory", "--seed", "5")
    axis = record["axes"]["memory"]
    assert list(record["axes"]) == ["memory"]
    assert axis["config"]["seeds"] == [5, 6, 7]  # --seed shifts every seed
    runs = axis["runs"]
    # Same init and first batch within a seed, different ones across seeds.
    for s in range(3):
        assert len({rs[s]["train_losses"][0] for rs in runs.values()}) == 1
    assert runs["adamw"][0]["train_losses"][0] != runs["adamw"][1]["train_losses"][0]
    # Paired ratios, their interval and the verdicts, recomputed from the losses.
    vals = {n: [r["val_loss"] for r in rs] for n, rs in runs.items()}
    body = _rows(md, "memory")[2:]
    assert body == _rows(stdout, "memory")[2:]  # printed == saved
    assert [r[0] for r in body] == ["AdamW", "Gefen 8-bit", "Gefen 4-bit"]
    for row, name in zip(body, ["adamw", "gefen8", "gefen4"], strict=True):
        assert row[5] == ", ".join(f"{v:.4f}" for v in vals[name])
        ratios = [v / a for v, a in zip(vals[name], vals["adamw"], strict=True)]
        assert row[6] == ", ".join(f"{r:.3f}" for r in ratios)
        if name == "adamw":
            continue
        logs = [math.log(r) for r in ratios]
        half = 4.30 * statistics.stdev(logs) / math.sqrt(3)  # t(0.975, 2 dof)
        mean = math.exp(statistics.fmean(logs))
        low, high = mean * math.exp(-half), mean * math.exp(half)
        assert row[7] == f"{mean:.3f} [{low:.3f}, {high:.3f}]"
        assert row[8] == verdict(mean, low, high)
        assert row[8] in axis["verdict"]
    # AdamW: two fp32 moments per element and a 4-byte step per tensor.
    model = GPT(GPTConfig(d_model=32, n_layer=1, n_head=4, block_size=16))
    n_params = model.num_params()
    n_tensors = len(list(model.parameters()))
    rows = {r["name"]: r for r in axis["rows"]}
    assert rows["adamw"]["state_bytes_per_param"] == pytest.approx(
        8 + 4 * n_tensors / n_params
    )
    assert 0.9 < rows["gefen8"]["state_bytes_per_param"] < 1.5
    assert 0.4 < rows["gefen4"]["state_bytes_per_param"] < 1.0
    assert "within run-to-run noise" in md or "outside it" in md
    assert len(record["load_average"]) == 2 and "load average" in md


@pytest.mark.parametrize(
    "ratio, low, high, expected",
    [
        (1.004, 0.99, 1.02, "within run-to-run noise (+0.4 %)"),
        (1.05, 0.91, 1.21, "within run-to-run noise (+5.0 %)"),
        (0.992, 0.95, 1.0, "within run-to-run noise (-0.8 %)"),
        (1.05, 1.01, 1.09, "5.0 % worse, outside it"),
        (0.93, 0.90, 0.96, "7.0 % better, outside it"),
        (math.nan, math.nan, math.nan, "did not train (non-finite loss)"),
    ],
)
def test_verdict_wording(ratio, low, high, expected):
    assert verdict(ratio, low, high) == expected


def test_curvature_axis_steps_and_seconds_to_target(tiny, tmp_path, capsys):
    md, stdout, record = _run(tmp_path, capsys, "curvature")
    axis = record["axes"]["curvature"]
    runs = {r["name"]: r for r in axis["runs"]}
    assert list(runs) == ["adamw", *TINY_CURVATURE.methods]
    assert all(r["status"] == "ok" for r in runs.values()), runs
    steps = TINY_CURVATURE.steps
    window = max(1, steps // 10)
    target = sum(runs["adamw"]["train_losses"][-window:]) / window
    assert axis["target"] == pytest.approx(target)
    body = _rows(md, "curvature")[2:]
    assert body == _rows(stdout, "curvature")[2:]
    for row, r in zip(body, runs.values(), strict=True):
        losses = r["train_losses"]
        hit = next(
            (
                s
                for s in range(window, steps + 1)
                if sum(losses[s - window : s]) / window <= target
            ),
            None,
        )
        assert row[1] == ("-" if hit is None else str(hit))
        if hit is not None:
            assert row[3] == f"{sum(r['step_times'][:hit]):.2f}"
        timed = r["step_times"][1:]
        assert r["step_ms"] == pytest.approx(1e3 * sum(timed) / len(timed))
        base = runs["adamw"]["step_ms"]
        assert row[6] == f"{r['step_ms'] / base:.2f}"
        assert row[7] == f"{r['train_loss']:.4g}"
        assert row[9].startswith("diverged") == (r["train_loss"] > losses[0])
    # AdamW's last window is the target itself: it always reaches it.
    assert body[0][1] != "-" and body[0][2] == body[0][4] == "1.00"
    # Same init and batches: every row starts from the same loss.
    assert len({round(r["train_losses"][0], 5) for r in runs.values()}) == 1


def test_curvature_marks_a_finite_divergence():
    from leantrain.compare_precond import MethodResult

    def run(name, losses):
        return MethodResult(
            name,
            step_ms=1.0,
            train_loss=losses[-1],
            train_losses=losses,
            step_times=[1e-3] * len(losses),
        )

    config = dataclasses.replace(TINY_CURVATURE, steps=4, methods=("kfac",))
    results = {
        ("curvature", "adamw"): run("adamw", [2.0, 1.5, 1.0, 0.5]),
        ("curvature", "kfac"): run("kfac", [2.0, 0.4, 30.0, 1e5]),
    }
    rows = compare_curvature.summarise(config, results)["rows"]
    assert [r.diverged for r in rows] == [False, True]
    # It passed the target on the way up: the steps count, the row says diverged.
    assert rows[1].steps_to_target == 2
    table = compare_curvature.table(compare_curvature.summarise(config, results))
    assert "| 1e+05 |" in table and "diverged; " in table


def test_depth_axis_against_the_serial_network_and_the_simulator(
    tiny, tmp_path, capsys
):
    md, stdout, record = _run(tmp_path, capsys, "depth")
    axis = record["axes"]["depth"]
    acc = axis["accuracy"]
    # Two cycles on 8 layers are approximate, not exact; the factor shrinks errors.
    assert 1e-6 < acc["output_rel_diff"] < 0.1
    assert 0 < acc["forward_factor"] < 1 and 0 <= acc["backward_factor"] < 1
    assert axis["measured_speedup"] == pytest.approx(
        axis["serial_step_s"] / axis["parallel_step_s"]
    )
    # The projections are the simulator's, from the layer times and message cost
    # recorded in this run.
    layers = LayerTimes(**axis["layer_times_s"])
    comm = CommModel(axis["latency_s"], axis["bandwidth_bytes_per_s"])
    state_bytes = TINY_DEPTH.batch * TINY_DEPTH.tokens * TINY_DEPTH.d_model * 4
    for ranks, speedup in axis["projected_speedup"]["measured"].items():
        expected = simulate(
            256,
            int(ranks),
            layers,
            levels=2,
            cf=2,
            fwd_iters=2,
            bwd_iters=1,
            comm=comm,
            state_bytes=state_bytes,
        ).speedup
        assert speedup == pytest.approx(expected)
    assert list(axis["projected_speedup"]["gpu"]) == ["8", "32", "128"]
    body = dict((r[0], r[1]) for r in _rows(md, "depth")[2:])
    assert body["measured speedup, 2 processes vs serial"] == (
        f"{axis['measured_speedup']:.2f}x"
    )
    assert _rows(md, "depth") == _rows(stdout, "depth")


def test_depth_accuracy_is_exact_with_enough_cycles():
    # N/(2 cf) + 1 cycles make MGRIT exact: parallel equals the serial network up
    # to float32 rounding, so the comparison itself is checked here.
    n, cf = 8, 2
    exact = dataclasses.replace(
        TINY_DEPTH, fwd_iters=n // (2 * cf) + 1, bwd_iters=n // (2 * cf) + 1
    )
    acc = compare_depth.depth_accuracy(exact, progress=lambda: None)
    assert acc.output_rel_diff < 1e-5 and acc.grad_rel_diff < 1e-4
    loose = compare_depth.depth_accuracy(
        dataclasses.replace(TINY_DEPTH, fwd_iters=1, bwd_iters=1),
        progress=lambda: None,
    )
    assert loose.output_rel_diff > 10 * acc.output_rel_diff


def test_worker_processes_reproduce_the_in_process_runs(tiny, tmp_path, capsys):
    # One thread per run: the spawned pool trains bit-identically to this process.
    _, _, pooled = _run(tmp_path / "a", capsys, "curvature", workers="2")
    _, _, local = _run(tmp_path / "b", capsys, "curvature", workers="1")
    for a, b in zip(
        local["axes"]["curvature"]["runs"],
        pooled["axes"]["curvature"]["runs"],
        strict=True,
    ):
        assert a["name"] == b["name"] and a["train_losses"] == b["train_losses"]
    md = (tmp_path / "a" / "out" / "compare.md").read_text()
    assert pooled["workers"] == 2 and "3 runs on 2 processes" in md


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["memory", "--optimizers", "adamw"], ["--optimizers", "memory"]),
        (["depth", "--steps", "3"], ["--steps"]),
        (["--workers", "0"], ["positive"]),
        (["speed"], ["speed", "memory", "curvature", "depth"]),
    ],
)
def test_bad_axis_options_exit_2(argv, needles, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["compare", "--out", str(tmp_path), *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert all(n in err for n in needles), err


def test_axis_configs_are_checked():
    with pytest.raises(ValueError, match="adamw"):
        compare_memory.jobs(dataclasses.replace(TINY_MEMORY, optimizers=("gefen8",)))
    with pytest.raises(ValueError, match="two seeds"):
        compare_memory.jobs(dataclasses.replace(TINY_MEMORY, seeds=(0,)))
    with pytest.raises(ValueError, match="nope"):
        compare_curvature.jobs(dataclasses.replace(TINY_CURVATURE, methods=("nope",)))
    with pytest.raises(ValueError, match="projected_layers=100"):
        compare_depth.jobs(dataclasses.replace(TINY_DEPTH, projected_layers=100))
