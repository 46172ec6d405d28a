"""``leantrain compare [memory|curvature|depth]`` with tiny settings per axis.

Every number in the tables is recomputed here from the per-step records in
compare.json (or from an independent reference: the serial network, the simulator
called directly, AdamW's state size by its definition).
"""

import dataclasses
import json
import math
import os
import re
import statistics

import pytest

from leantrain.cli import main
from leantrain.compare import curvature as compare_curvature
from leantrain.compare import depth as compare_depth
from leantrain.compare import jobs as compare_jobs
from leantrain.compare import memory as compare_memory
from leantrain.compare.memory import verdict
from leantrain.compare.report import pyplot
from leantrain.layer_parallel.costs import CommModel, LayerTimes, simulate
from leantrain.layer_parallel.costs.timing import TwoProcessTiming
from leantrain.models import GPT, GPTConfig
from tests._helpers.compare_configs import TINY_DEPTH

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


IDLE = 0.5  # a 1-minute load average below any machine's cores


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setattr(compare_memory, "DEFAULT", TINY_MEMORY)
    monkeypatch.setattr(compare_curvature, "DEFAULT", TINY_CURVATURE)
    monkeypatch.setattr(compare_depth, "DEFAULT", TINY_DEPTH)
    # The runs in this process see an idle machine, whatever the real load (the
    # marking of rows timed under load is tested on its own).
    monkeypatch.setattr(compare_jobs, "load_average", lambda: IDLE)


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
    from leantrain.compare.precond import MethodResult

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

    def simulated(n_layers: int, ranks: int):
        return simulate(
            n_layers,
            ranks,
            layers,
            levels=2,
            cf=2,
            fwd_iters=2,
            bwd_iters=1,
            comm=comm,
            state_bytes=state_bytes,
        )

    for ranks, speedup in axis["projected_speedup"]["measured"].items():
        assert speedup == pytest.approx(simulated(256, int(ranks)).speedup)
    assert list(axis["projected_speedup"]["gpu"]) == ["8", "32", "128"]
    # The simulated 2-process row: the simulator on the 8 layers, two ranks.
    two = simulated(8, 2)
    assert axis["simulated_two_speedup"] == pytest.approx(two.speedup)
    assert axis["simulated_two_serial_s"] == pytest.approx(two.serial)
    rows = {r[0]: r[1:] for r in _rows(md, "depth")}
    assert rows["measured"] == [
        f"{axis['serial_step_s'] * 1e3:.1f}",
        f"{axis['parallel_step_s'] * 1e3:.1f}",
        f"{axis['measured_speedup']:.2f}",
    ]
    assert rows["simulated from the layer times and messages above"] == [
        f"{two.serial * 1e3:.1f}",
        f"{two.step * 1e3:.1f}",
        f"{two.speedup:.2f}",
    ]
    assert _rows(md, "depth") == _rows(stdout, "depth")
    assert "†" not in md  # an idle machine: nothing marked, no footnote


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


def test_rows_timed_under_load_are_marked_with_a_footnote(
    tiny, tmp_path, monkeypatch, capsys
):
    # One process: the runs go adamw, kfac, shampoo, each reading the load
    # average before and after; only kfac ends above the machine's cores.
    busy = (os.cpu_count() or 1) + 1.5
    loads = iter([0.25, 0.5, 0.75, busy, 1.0, 1.25])
    monkeypatch.setattr(compare_jobs, "load_average", lambda: next(loads))
    md, stdout, record = _run(tmp_path, capsys, "curvature")
    names = [r[0] for r in _rows(md, "curvature")[2:]]
    assert names == ["adamw", "kfac †", "shampoo"]
    assert names == [r[0] for r in _rows(stdout, "curvature")[2:]]
    section = md.split("## curvature", 1)[1]
    assert "over this axis' runs: 0.2 when the first started, 1.2 when the" in section
    assert f"† Measured under load: the load average passed {os.cpu_count()}" in section
    assert f"(it reached {busy:.1f})" in section
    load = record["axes"]["curvature"]["load_average"]
    assert load["runs"] == {
        "adamw": [0.25, 0.5],
        "kfac": [0.75, busy],
        "shampoo": [1.0, 1.25],
    }
    assert load["under_load"] == ["kfac"] and load["limit"] == os.cpu_count()
    assert (load["start"], load["end"]) == (0.25, 1.25)


def test_progress_bar_counts_what_the_summary_counts(tiny, tmp_path, capsys):
    # The depth axis: its two-process timing runs alone first, then the pool.
    out = tmp_path / "out"
    assert main(["compare", "depth", "--out", str(out), "--workers", "2"]) == 0
    err = capsys.readouterr().err
    md = (out / "compare.md").read_text()
    # tqdm's last refresh: "steps of 2 runs on 2 processes: 100%|###| 2/2 [..step/s]"
    bar = re.findall(
        r"steps of (\d+) runs on 2 processes: 100%.*?\| (\d+)/(\d+) (\[.*?\])", err
    )
    assert bar, err
    runs, done, total, rate = bar[-1]
    assert "step/s" in rate or "s/step" in rate  # the unit
    jobs = compare_depth.jobs(TINY_DEPTH)
    assert runs == str(len(jobs)) and done == total == str(sum(j.ticks for j in jobs))
    assert f"({runs} runs on 2 processes, " in md


def _depth_summary(serial_s, parallel_s, under_load=()):
    """The depth axis' summary of a made-up timing (the simulator as it is)."""
    timing = TwoProcessTiming(
        parallel=parallel_s,
        serial=serial_s,
        layers=LayerTimes(forward=1e-3, backward=2e-3, forward_record=1.2e-3),
        comm=CommModel(latency=2e-3, bandwidth=3e8),
    )
    accuracy = compare_depth.DepthAccuracy(1e-2, 9e-2, 0.09, 0.11, 30_000)
    results = {("depth", "timing"): timing, ("depth", "accuracy"): accuracy}
    summary = compare_depth.summarise(TINY_DEPTH, results)
    summary["under_load"] = set(under_load)
    return summary


def test_depth_table_and_panel_show_the_same_quantities():
    plt = pyplot()
    summary = _depth_summary(0.076, 0.2111)
    table = compare_depth.table(summary, TINY_DEPTH)
    tables = [_rows(f"## depth\n{t}", "depth") for t in table.split("\n\n")]
    for rows in tables:  # one unit a column (or a row, named with it), never two
        assert all(re.fullmatch(r"[-+.0-9e]+", c) for row in rows[2:] for c in row[1:])
    steps = {r[0]: r[1:] for r in tables[1]}
    header = tables[1][0]
    assert header[1:] == [
        "serial, 1 process (ms)",
        "layer-parallel, 2 processes (ms)",
        "speedup vs serial (x)",
    ]
    fig, ax = plt.subplots()
    compare_depth.plot(ax, summary, TINY_DEPTH)
    plotted = {line.get_label(): line.get_ydata()[0] for line in ax.get_lines()}
    plt.close(fig)
    assert steps["measured"][2] == f"{plotted['measured, 2 processes']:.2f}" == "0.36"
    simulated = steps["simulated from the layer times and messages above"]
    assert simulated[2] == f"{plotted['simulated, 2 processes']:.2f}"
    assert float(simulated[2]) == pytest.approx(
        float(simulated[0]) / float(simulated[1]), abs=0.01
    )
    projected = tables[2]
    assert projected[0][1:] == ["8 ranks", "32 ranks", "128 ranks"]
    measured_projection = summary["projected"]["measured"]
    assert projected[2][1:] == [f"{v:.2f}" for v in measured_projection.values()]


@pytest.mark.parametrize(
    "serial_s, parallel_s, under_load, words",
    [
        (0.076, 0.2111, (), ["slower than serial (0.36x measured, "]),
        (0.2, 0.1, (), ["faster than serial (2.00x measured, "]),
        (0.076, 0.2111, [("depth", "timing")], ["0.36x measured under load, "]),
    ],
)
def test_depth_sentence_is_worded_from_the_numbers(
    serial_s, parallel_s, under_load, words
):
    summary = _depth_summary(serial_s, parallel_s, under_load)
    sentence = compare_depth.verdict(summary, TINY_DEPTH)
    assert f"On 2 processes of this {os.cpu_count()}-core CPU" in sentence
    assert all(w in sentence for w in words), sentence
    assert f"{summary['simulated_two_speedup']:.2f}x simulated" in sentence
    projected = summary["projected"]["measured"]
    assert ", ".join(f"{v:.2f}x at {p}" for p, v in projected.items()) in sentence
    faster = [str(p) for p, v in projected.items() if v > 1]
    assert (f"faster than serial at {', '.join(faster)} ranks." in sentence) == bool(
        faster
    )
    assert sentence.endswith("slower than serial at every one of them.") != bool(faster)
    table = compare_depth.table(summary, TINY_DEPTH)
    assert ("| measured † |" in table) == bool(under_load)
