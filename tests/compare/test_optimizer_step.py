"""leantrain.compare.optimizer_step on CPU, at GPT-2's layout shrunk (quick shapes).

The shapes are checked against torch modules built the GPT-2 way, the bytes a step
moves against the count per parameter the module's docstring gives (AdamW 28 bytes
per fp32 parameter, ``p.add_(g)`` 12), the bandwidth column against those bytes over
the measured time of the same row, the clock against a stand-in time source, the
peak memory against a known allocation, and the round budget against its rule.
"""

from __future__ import annotations

import doctest
import math

import pytest
import torch
from torch import nn

from leantrain.compare import optimizer_step

CPU = torch.device("cpu")


def gpt2_module_shapes(layers, width, vocab, context) -> list[tuple[int, ...]]:
    """GPT-2's parameters as torch modules hold them, in GPT-2's order."""
    modules = [nn.Embedding(vocab, width), nn.Embedding(context, width)]
    for _ in range(layers):
        modules += [
            nn.LayerNorm(width),
            nn.Linear(width, 3 * width),
            nn.Linear(width, width),
            nn.LayerNorm(width),
            nn.Linear(width, 4 * width),
            nn.Linear(4 * width, width),
        ]
    modules.append(nn.LayerNorm(width))
    return [tuple(p.shape) for m in modules for p in m.parameters()]


def test_gpt2_shapes_are_gpt2s():
    assert optimizer_step.quick_shapes() == gpt2_module_shapes(2, 64, 512, 64)
    assert optimizer_step.gpt2_shapes(3, 32, 100, 16) == gpt2_module_shapes(
        3, 32, 100, 16
    )
    full = optimizer_step.gpt2_shapes()
    # GPT-2 small as published: 148 tensors, 124,439,808 parameters
    assert len(full) == 148 and sum(math.prod(s) for s in full) == 124_439_808


@pytest.mark.parametrize(
    "dtype, adamw, add", [(torch.float32, 28, 12), (torch.bfloat16, 14, 6)]
)
def test_nominal_bytes_count_each_tensor_once(dtype, adamw, add):
    params = optimizer_step.make_params([(7, 5), (11,)], dtype, CPU)
    n = sum(p.numel() for p in params)
    assert optimizer_step.nominal_bytes(params, None) == add * n
    opt = torch.optim.AdamW(params, lr=1e-3)
    opt.step()  # m and v in the parameter's dtype; the 0-dim step is not counted
    assert optimizer_step.nominal_bytes(params, opt) == adamw * n


def test_make_params_is_seeded_and_steps_see_fixed_gradients():
    a = optimizer_step.make_params([(4, 3)], torch.float32, CPU, seed=1)
    b = optimizer_step.make_params([(4, 3)], torch.float32, CPU, seed=1)
    assert torch.equal(a[0], b[0]) and torch.equal(a[0].grad, b[0].grad)
    assert not torch.equal(a[0], a[0].grad)


def test_clock_on_cpu_reads_its_time_source():
    readings = iter([10.0, 10.25])
    clock = optimizer_step.Clock(CPU, time_fn=lambda: next(readings))
    calls = []
    assert clock.time(lambda: calls.append(1)) == 0.25 and calls == [1]
    assert clock.wall(lambda: None) >= 0.0


def test_peak_extra_bytes_sees_a_temporary():
    size = 32 << 20

    def step():
        torch.ones(size // 4)  # 32 MiB, freed on return

    extra = optimizer_step.peak_extra_bytes(step, CPU)
    if extra is None:
        pytest.skip("no /proc/self/clear_refs here")
    assert extra >= 0.9 * size


@pytest.fixture(scope="module")
def rows():
    torch.manual_seed(0)
    clock = optimizer_step.Clock(CPU)
    shapes = optimizer_step.quick_shapes()
    return optimizer_step.measure(
        shapes, torch.float32, CPU, repeats=3, budget_s=60.0, clock=clock
    )


def test_measure_rows_follow_the_contenders_and_their_ratios(rows):
    assert [r["optimizer"] for r in rows] == list(optimizer_step.contenders(CPU))
    by_name = {r["optimizer"]: r for r in rows}
    base = by_name[optimizer_step.BASELINE]
    floor = by_name[optimizer_step.FLOOR]
    assert base["x_fused_adamw"] == 1.0 and floor["x_add_bandwidth"] == 1.0
    for r in rows:
        assert r["timed_steps"] == 3 and r["ms_per_step"] > 0
        assert r["x_fused_adamw"] == pytest.approx(
            r["ms_per_step"] / base["ms_per_step"]
        )
        assert r["x_add_bandwidth"] == pytest.approx(r["gb_per_s"] / floor["gb_per_s"])
    assert (
        floor["state_bytes_per_param"] is None and floor["first_step_cold_ms"] is None
    )


def test_measure_bandwidth_is_the_nominal_bytes_over_the_time(rows):
    n = sum(math.prod(s) for s in optimizer_step.quick_shapes())
    by_name = {r["optimizer"]: r for r in rows}
    for name, per_param in ((optimizer_step.BASELINE, 28), (optimizer_step.FLOOR, 12)):
        r = by_name[name]
        moved = r["gb_per_s"] * 1e9 * r["ms_per_step"] / 1e3
        assert moved == pytest.approx(per_param * n, rel=1e-9)


def test_measure_state_sizes_are_what_the_optimizers_keep(rows):
    by_name = {r["optimizer"]: r for r in rows}
    assert 8 <= by_name[optimizer_step.BASELINE]["state_bytes_per_param"] < 8.05
    assert 1.0 < by_name["Gefen 8-bit (defaults)"]["state_bytes_per_param"] < 1.2
    assert 0.5 < by_name["Gefen 4-bit (defaults)"]["state_bytes_per_param"] < 0.7
    for r in rows[:-1]:
        assert r["first_step_cold_ms"] > 0 and r["first_step_warm_ms"] > 0


def test_measure_stops_after_three_rounds_past_its_budget():
    shapes = [(8, 4), (4,)]
    rows = optimizer_step.measure(
        shapes, torch.float32, CPU, repeats=20, budget_s=1e-9,
        clock=optimizer_step.Clock(CPU),
    )  # fmt: skip
    assert {r["timed_steps"] for r in rows} == {3}


def test_markdown_has_one_table_per_dtype(rows):
    result = {
        "model": "gpt2 (quick)", "parameters": 1234, "tensors": 28, "device": "cpu",
        "torch": "x", "threads": 1, "repeats": 3, "load_before": 0.5,
        "load_after": 0.7, "dtypes": {"float32": rows, "bfloat16": rows},
    }  # fmt: skip
    text = optimizer_step.markdown(result)
    assert text.startswith("gpt2 (quick): 1,234 parameters in 28 tensors on cpu")
    assert text.count("| optimizer | ms/step |") == 2
    floor_line = next(ln for ln in text.splitlines() if ln.startswith("| p.add_"))
    assert floor_line.split(" | ")[3] == "n/a"  # no state
    assert "**bfloat16 parameters**" in text


def test_run_quick_reports_its_setting():
    result = optimizer_step.run(
        quick=True, dtypes=["float32"], repeats=1, budget_s=1.0, threads=1,
        clock="cpu",
    )  # fmt: skip
    shapes = optimizer_step.quick_shapes()
    assert result["model"] == "gpt2 (quick)" and result["clock"] == "cpu"
    assert result["tensors"] == 28 and result["threads"] == 1
    assert result["parameters"] == sum(math.prod(s) for s in shapes)
    assert list(result["dtypes"]) == ["float32"]


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"model": "gpt3"}, "'gpt3'"),
        ({"dtypes": ["float33"]}, "'float33'"),
        ({"dtypes": []}, "[]"),
        ({"clock": "gpu"}, "'gpu'"),
        ({"repeats": 0}, "got 0"),
        ({"budget_s": -1.0}, "got -1.0"),
        ({"threads": 0}, "got 0"),
    ],
)
def test_run_names_a_bad_argument(kwargs, named):
    with pytest.raises(ValueError) as info:
        optimizer_step.run(**kwargs)
    assert named in str(info.value)


def test_run_refuses_cuda_without_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="'cuda:1': CUDA is not available"):
        optimizer_step.run(quick=True, device="cuda:1")


def test_measure_names_a_bad_repeat_count():
    with pytest.raises(ValueError, match="got 0"):
        optimizer_step.measure(
            [(2,)], torch.float32, CPU, repeats=0, budget_s=1.0,
            clock=optimizer_step.Clock(CPU),
        )  # fmt: skip


def test_the_docstring_example_runs():
    result = doctest.testmod(optimizer_step)
    assert result.attempted >= 3 and result.failed == 0
