"""The MGRIT-versus-pipeline projection: best choices against the simulators run
directly, the layout rules, the serial-forward time, the crossover and the table
(the plot: tests/compare/test_depth_plot.py)."""

from __future__ import annotations

import pytest

from leantrain.layer_parallel.costs.projection import (
    MGRITSetting,
    best_pipeline,
    crossover,
    project,
    projection_table,
)
from leantrain.layer_parallel.costs.simulate import (
    CommModel,
    LayerTimes,
    OutsideTimes,
    simulate,
)
from leantrain.layer_parallel.costs.simulate_pipeline import simulate_pipeline

FULL = LayerTimes(1.0, 1.5, 1.2, 2.4)


def _linear(ms):  # a micro-batch of 1/M of the batch takes 1/M of the time
    return {m: LayerTimes(*(v / m for v in (1.0, 1.5, 1.2, 2.4))) for m in sorted(ms)}


def test_best_pipeline_is_the_fastest_valid_schedule():
    comm = CommModel(latency=0.05)
    times = _linear([1, 2, 4, 8])
    step, label = best_pipeline(32, 4, times, FULL, comm, state_bytes=0.0)
    candidates = {
        f"{s} M={m}": simulate_pipeline(
            32, 4, m, t, schedule=s, comm=comm, serial_times=FULL
        ).step
        for m, t in times.items()
        for s in ("gpipe", "1f1b")
        if not (s == "1f1b" and m < 4)
    }
    assert step == min(candidates.values())
    assert candidates[label] == step
    assert best_pipeline(30, 4, times, FULL, comm, 0.0) is None  # 4 does not divide


def test_mgrit_setting_layout_and_step():
    s = MGRITSetting(levels=3, cf=4, fwd_iters=1, bwd_iters=1)
    assert s.valid(64, 4) and not s.valid(64, 8) and not s.valid(60, 8)
    assert s.label == "L3 cf4 fwd 1 bwd 1"
    r = simulate(64, 4, FULL, levels=3, cf=4, fwd_iters=1, bwd_iters=1)
    assert s.step(64, 4, FULL, CommModel(), 0.0) == pytest.approx(r.step)
    # exact serial forward: N recorded forward steps, then the MGRIT adjoint
    sf = MGRITSetting(levels=2, cf=4, fwd_iters=0, bwd_iters=1)
    r = simulate(64, 4, FULL, levels=2, cf=4, fwd_iters=1, bwd_iters=1)
    assert sf.label == "L2 cf4 fwd serial bwd 1"
    assert sf.step(64, 4, FULL, CommModel(), 0.0) == pytest.approx(
        64 * FULL.forward_record + r.backward
    )


def test_projection_and_crossover():
    # Micro-batches that cost as much as the whole batch (a latency-bound device):
    # a pipeline gains nothing (M = 1 runs the stages one after the other, more
    # micro-batches only add work), so MGRIT wins as soon as it beats serial.
    flat = {m: FULL for m in (1, 2, 4, 8)}
    settings = [MGRITSetting(2, 4, 1, 1), MGRITSetting(3, 4, 1, 1)]
    cells = project([64, 256], [2, 4, 8, 16, 32], flat, settings, CommModel(), 0.0)
    assert len(cells) == 10
    for c in cells:
        assert c.serial == c.depth * FULL.serial_step
        if c.pipeline is not None:  # best is the serial step with M=1 GPipe here
            assert c.pipeline == pytest.approx(c.serial)
    cross = crossover(cells, 256)
    assert cross is not None and cross <= 4
    assert all(c.lp_wins == (c.mgrit < c.pipeline) for c in cells if c.mgrit)
    assert crossover(cells, 64) == min(
        c.ranks for c in cells if c.depth == 64 and c.lp_wins
    )
    # with micro-batches that scale linearly and M = 8, the pipeline wins at P = 2
    lin = project([64], [2], _linear([1, 2, 4, 8]), settings, CommModel(), 0.0)
    assert not lin[0].lp_wins and lin[0].pipeline_label.endswith("M=8")
    with pytest.raises(ValueError, match="key 1"):
        project([64], [2], {2: FULL}, settings, CommModel(), 0.0)


def test_table():
    flat = {m: FULL for m in (1, 2, 4, 8)}
    settings = [MGRITSetting(2, 4, 1, 1)]
    cells = project([16, 64], [2, 4, 32], flat, settings, CommModel(), 0.0)
    lines = projection_table(cells).splitlines()
    assert lines[0] == "| N | P=2 | P=4 | P=32 | MGRIT faster at |"
    row16 = lines[2].split(" | ")
    assert row16[3] == "-"  # P=32 > N/4: MGRIT's layout cannot run
    for c in cells:
        if c.pipeline is None or c.mgrit is None:
            continue
        row = lines[2 + [16, 64].index(c.depth)].split(" | ")
        cell = row[1 + [2, 4, 32].index(c.ranks)]
        assert cell.startswith("**") == c.lp_wins
        assert float(cell.strip("*")) == pytest.approx(c.pipeline / c.mgrit, abs=5e-3)
        assert (f"P={c.ranks}" in row[-1]) == c.lp_wins


def test_outside_work_is_charged_to_serial_mgrit_and_pipeline():
    # hand-counted: every MGRIT rank embeds, runs the head and steps N/P layers
    # plus the embedding and head; serial steps all N; a pipeline micro-batch of
    # 1/M carries its own embedding / head times
    out = {m: OutsideTimes(0.1 / m, 0.2 / m, 0.3 / m, 0.05, 0.01) for m in (1, 2)}
    times = {1: FULL, 2: FULL}
    s = MGRITSetting(2, 4, 1, 1)
    (cell,) = project([64], [4], times, [s], CommModel(), 0.0, out)
    assert cell.serial == pytest.approx(64 * FULL.serial_step + 0.61 + 64 * 0.05)
    assert cell.mgrit == pytest.approx(
        s.step(64, 4, FULL, CommModel(), 0.0) + 0.61 + 16 * 0.05
    )
    best = min(
        simulate_pipeline(
            64, 4, m, FULL, schedule=k, serial_times=FULL, outside=out[m]
        ).step
        for m in (1, 2)
        for k in ("gpipe", "1f1b")
        if k == "gpipe" or m >= 4
    )
    assert cell.pipeline == pytest.approx(best)
    with pytest.raises(ValueError, match="keys of times_by_mb"):
        project([64], [4], times, [s], CommModel(), 0.0, {1: out[1]})


def test_setting_parses_a_benchmark_spec_and_gives_layer_parallel_options():
    serial_fwd = MGRITSetting.parse("2,4,serial,1")
    assert serial_fwd == MGRITSetting(2, 4, 0, 1)
    assert serial_fwd.options() == dict(
        levels=2, cf=4, bwd_iters=1, forward_solver="serial"
    )
    assert MGRITSetting.parse("3,2,2,1").options() == dict(
        levels=3, cf=2, bwd_iters=1, fwd_iters=2
    )
    for spec, match in [
        ("2,4,1", "expected levels,cf,fwd_iters,bwd_iters"),
        ("2,x,1,1", "every field must be an integer"),
        ("1,4,1,1", "needs levels >= 2"),
    ]:
        with pytest.raises(ValueError, match=match):
            MGRITSetting.parse(spec)
