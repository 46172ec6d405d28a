"""The depth comparison's saved measurements and its serial prediction."""

import argparse

import pytest

from leantrain.compare.depth_runs import Run
from leantrain.compare.depth_tables import _predict, load, save
from leantrain.layer_parallel.costs import CommModel, LayerTimes, OutsideTimes


def _measurements() -> dict:
    row = {"step": 0.5, "loss": 5.0, "peak": [[400.0, 10.0], [390.0, 1.0]]}
    return {
        "comm": CommModel(latency=1e-4, bandwidth=1e9),
        "state_bytes": 4096.0,
        "act": 1e6,
        "times": {1: LayerTimes(1e-3, 2e-3, 3e-3, 4e-3), 2: LayerTimes(1e-3, 1e-3)},
        "outside": {1: OutsideTimes(1e-3, 2e-3, 3e-3, 4e-4, 5e-3)},
        "depths": {8: {Run("serial").label: row}},
    }


def _args() -> argparse.Namespace:
    return argparse.Namespace(
        d=32,
        heads=2,
        batch=8,
        tokens=16,
        steps=3,
        lr=1e-3,
        micro_batches=[1, 2],
        lp=["2,4,1,1"],
    )


def test_save_then_load_gives_the_measurements_and_the_settings(tmp_path):
    path = tmp_path / "depth.json"
    res = _measurements()
    save(str(path), _args(), res)
    args = argparse.Namespace()
    loaded = load(str(path), args)
    assert loaded == res
    assert vars(args) | {"load_average": None} == vars(_args()) | {
        "depths": [8],
        "load_average": None,
    }


def test_serial_prediction_is_n_layer_steps_plus_the_outside_work():
    res = _measurements()
    step, act = _predict(Run("serial"), 8, res)
    expected = 8 * res["times"][1].serial_step + res["outside"][1].step(8)
    assert step == pytest.approx(expected)
    assert act == [8 * res["act"], 0.0]
