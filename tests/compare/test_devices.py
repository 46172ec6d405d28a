"""``leantrain compare --device``: which device the axes run on, at which sizes.

Runs on the CPU: ``--device cpu`` and ``auto`` run (auto is the CPU here), the
report names the device, ``cuda`` without CUDA stops with a message naming what is
available, and the sizes the CLI picks for ``cuda`` are the table's (checked with a
stand-in ``torch.cuda.is_available``, without running anything on a GPU). The
one-GPU timing of the depth axis runs here on the CPU, through the same summary,
table, sentence and panel as on a GPU.
"""

import argparse
import dataclasses
import json
import math

import pytest
import torch

from leantrain.cli import build_parser, main
from leantrain.compare import axes as compare_axes
from leantrain.compare import curvature as compare_curvature
from leantrain.compare import depth as compare_depth
from leantrain.compare import jobs as compare_jobs
from leantrain.compare import memory as compare_memory
from leantrain.compare.depth_device import GPU_INTERCONNECT, time_on_device
from leantrain.compare.devices import (
    DEVICE_SIZES,
    device_clock,
    device_label,
    resolve_device,
)
from leantrain.compare.report import pyplot
from leantrain.models import GPTConfig
from tests._helpers.compare_configs import TINY_DEPTH

TINY_CURVATURE = dataclasses.replace(
    compare_curvature.DEFAULT, methods=("kfac",), steps=4, batch_size=16
)


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def stand_in_cuda(monkeypatch):
    """``torch.cuda.is_available()`` says yes; nothing may run on it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["compare", *argv])


def test_auto_is_cuda_only_where_torch_finds_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    assert resolve_device("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda"
    assert resolve_device("cuda") == "cuda"
    assert resolve_device("cpu") == "cpu"
    assert _parse().device == "auto"


def test_cuda_without_cuda_exits_2_naming_what_is_available(no_cuda, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["compare", "--device", "cuda"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--device cuda" in err and "available" in err and "cpu" in err
    with pytest.raises(ValueError, match="--device cuda.*available are: cpu"):
        resolve_device("cuda")


def test_bad_device_names_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["compare", "--device", "tpu"])
    assert exit_.value.code == 2
    assert "invalid choice: 'tpu'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="'tpu' is not one of auto, cpu, cuda"):
        resolve_device("tpu")


def test_single_model_comparison_refuses_cuda(stand_in_cuda, capsys):
    with pytest.raises(SystemExit):
        main(["compare", "--model", "mlp", "--device", "cuda"])
    assert "single-model comparison (--model) runs on the CPU" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_axis_runs_on_the_cpu_and_the_report_names_it(
    device, monkeypatch, tmp_path, capsys
):
    monkeypatch.setattr(compare_curvature, "DEFAULT", TINY_CURVATURE)
    monkeypatch.setattr(compare_jobs, "load_average", lambda: 0.5)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "out"
    argv = ["compare", "curvature", "--device", device, "--threads", "2"]
    assert main([*argv, "--out", str(out), "--workers", "1"]) == 0
    stdout = capsys.readouterr().out
    record = json.loads((out / "compare.json").read_text())
    assert record["device"] == "cpu (2 threads)" == device_label("cpu", 2)
    assert "Device: cpu (2 threads)" in stdout
    assert "Device: cpu (2 threads)" in (out / "compare.md").read_text()
    assert record["axes"]["curvature"]["config"]["device"] == "cpu"
    assert [r["status"] for r in record["axes"]["curvature"]["rows"]] == ["ok"] * 2


def test_cuda_sizes_are_the_table_the_cli_picks(stand_in_cuda, monkeypatch):
    args = _parse("--device", "cuda", "--seed", "3")
    args.device = resolve_device(args.device)
    cuda = DEVICE_SIZES["cuda"]
    configs = {name: axis.config(args) for name, axis in compare_axes.AXES.items()}
    assert configs["memory"] == dataclasses.replace(
        compare_memory.DEFAULT, **cuda["memory"], seeds=(3, 4, 5), device="cuda"
    )
    assert configs["curvature"] == dataclasses.replace(
        compare_curvature.DEFAULT, **cuda["curvature"], seed=3, device="cuda"
    )
    assert configs["depth"] == dataclasses.replace(
        compare_depth.DEFAULT, **cuda["depth"], seed=3, device="cuda"
    )
    # The memory axis on a GPU: GPT-2 small's shape on bytes.
    memory = configs["memory"]
    assert (memory.n_layer, memory.d_model, memory.n_head) == (12, 768, 12)
    assert GPTConfig().vocab_size == 256
    # On the CPU the defaults stand, and the help describes them.
    cpu_args = _parse("--device", "cpu", "--seed", "3")
    assert compare_axes.AXES["depth"].config(cpu_args) == dataclasses.replace(
        compare_depth.DEFAULT, seed=3
    )
    assert compare_axes.AXES["depth"].config(argparse.Namespace(seed=0)).device == (
        "cpu"
    )

    # The runs share one GPU, so they go one at a time in this process: the
    # pool is asked for one worker whatever --workers says (stopped before running).
    class Stop(Exception):
        pass

    asked = {}

    def stand_in_run_jobs(jobs, workers, threads):
        asked.update(workers=workers, devices={job.args[0].device for job in jobs})
        raise Stop

    monkeypatch.setattr(compare_axes, "run_jobs", stand_in_run_jobs)
    args.workers = 4
    with pytest.raises(Stop):
        compare_axes.run_axes(args, list(compare_axes.AXES))
    assert asked == {"workers": 1, "devices": {"cuda"}}


def test_one_device_depth_timing_through_the_table_sentence_and_panel():
    """The depth axis' CUDA path (one device: serial step and layer times measured,
    messages assumed), run here on the CPU."""
    plt = pyplot()
    timing = time_on_device(TINY_DEPTH.stack_spec(), compare_depth.gpt_blocks, "cpu")
    assert timing.serial > 0 and timing.layers.forward > 0
    assert timing.comm == GPU_INTERCONNECT and math.isnan(timing.speedup)
    accuracy = compare_depth.DepthAccuracy(1e-2, 9e-2, 0.09, 0.11, 30_000)
    results = {("depth", "timing"): timing, ("depth", "accuracy"): accuracy}
    summary = compare_depth.summarise(TINY_DEPTH, results)
    assert list(summary["projected"]) == ["gpu"]  # no measured messages
    table = compare_depth.table(summary, TINY_DEPTH)
    assert "| measured on one GPU (cpu) |" in table
    assert f"| {timing.serial * 1e3:.1f} | - | - |" in table
    assert "message latency (us) (assumed: one GPU sends none) | 10 |" in table
    sentence = compare_depth.verdict(summary, TINY_DEPTH)
    assert sentence.startswith("On one GPU (cpu) the serial step")
    projected = summary["projected"]["gpu"]
    assert ", ".join(f"{v:.2f}x at {p}" for p, v in projected.items()) in sentence
    fig, ax = plt.subplots()
    compare_depth.plot(ax, summary, TINY_DEPTH)
    labels = [line.get_label() for line in ax.get_lines()]
    plt.close(fig)
    assert "simulated, 2 processes" in labels
    assert not any(label.startswith("measured") for label in labels)


def test_device_clock_is_the_host_clock_on_the_cpu():
    import time

    assert device_clock("cpu") is time.perf_counter
