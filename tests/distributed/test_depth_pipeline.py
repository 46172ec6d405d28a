"""GPT pipeline stages (torch.distributed.pipelining) against serial training.

On 2 gloo processes, GPipe and 1F1B with 2 micro-batches must give every parameter
the gradient that plain autograd on the whole model and the whole batch gives, in
float64 to 1e-12, and the same loss; the layout checks and benchmarks/depth.py
refuse what cannot run.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from leantrain.compare.pipeline_baseline import GPTPipeline, check_pipeline_settings
from leantrain.models import GPT, GPTConfig, lm_loss
from tests._helpers.launchers import run_distributed

pytestmark = pytest.mark.distributed

CFG = dict(vocab_size=32, block_size=8, n_layer=4, n_head=2, d_model=8, t_final=1.0)


def _model() -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG)).double()
    for p in model.parameters():  # far from the init: wrong gradients show up
        torch.nn.init.normal_(p, std=0.3)
    return model


def _grad_worker(rank: int, world: int) -> dict[str, dict[str, float]]:
    # both schedules in one spawned group: starting processes is the slow part
    return {s: _grad_check(s) for s in ("gpipe", "1f1b")}


def _grad_check(schedule: str) -> dict[str, float]:
    torch.manual_seed(1)
    idx = torch.randint(0, CFG["vocab_size"], (4, 8))
    tgt = torch.randint(0, CFG["vocab_size"], (4, 8))
    ref = _model()
    ref_loss = lm_loss(ref(idx), tgt)
    ref_loss.backward()
    expect = {n: p.grad for n, p in ref.named_parameters()}

    model = _model()
    pipe = GPTPipeline(model, schedule, micro_batches=2, batch=4, seq_len=8)
    loss = pipe.step(idx, tgt)
    owned = {id(p) for p in pipe.parameters()}
    out = {"loss": abs(loss - ref_loss.item()), "grad": 0.0, "owned": 0.0}
    for name, p in model.named_parameters():
        if id(p) in owned:
            out["owned"] += 1
            out["grad"] = max(out["grad"], (p.grad - expect[name]).abs().max().item())
        elif p.grad is not None:  # another rank's layers stay untouched here
            out["grad"] = float("inf")
    return out


def test_pipeline_gradients_equal_serial():
    per_rank = run_distributed(_grad_worker, 2, timeout=120)
    n_params = len(list(_model().parameters()))
    for schedule in ("gpipe", "1f1b"):
        results = [r[schedule] for r in per_rank]
        # every parameter is owned by exactly one rank
        assert sum(r["owned"] for r in results) == n_params, schedule
        for rank, r in enumerate(results):
            assert r["grad"] < 1e-12, (schedule, rank, r)
            assert r["loss"] < 1e-12, (schedule, rank, r)


@pytest.mark.parametrize(
    "args,match",
    [
        ((30, 4, 8, 2, "gpipe"), "n_layer=30 is not divisible by the 4"),
        ((32, 2, 8, 3, "gpipe"), "micro_batches=3 does not divide the batch size 8"),
        ((32, 4, 8, 2, "1f1b"), "'1f1b' needs micro_batches >= stages"),
        ((32, 2, 8, 2, "interleaved"), "schedule must be one of"),
        ((32, 0, 8, 2, "gpipe"), "stages"),
    ],
)
def test_pipeline_settings_refused(args, match):
    with pytest.raises(ValueError, match=match):
        check_pipeline_settings(*args)


@pytest.fixture(scope="module")
def depth_bench():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "depth.py"
    spec = importlib.util.spec_from_file_location("bench_depth", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_depth"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("bench_depth", None)


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--depths", "16", "33"], "n_layer=33 is not divisible by the 2"),
        (["--micro-batches", "3"], "micro_batches=3 does not divide the batch size 8"),
        (["--depths", "12", "--lp", "2,4,1,1"], "depth 12 on 2 ranks: 6 layers"),
        (["--lp", "2,4,1"], "expected levels,cf,fwd_iters,bwd_iters"),
        (["--lp", "2,x,1,1"], "every field must be an integer"),
        (["--lp", "1,4,1,1"], "needs levels >= 2"),
        (["--steps", "1"], "--steps must be >= 2"),
    ],
)
def test_harness_refuses_bad_settings(depth_bench, argv, match):
    args = depth_bench.build_parser().parse_args(argv)
    with pytest.raises(ValueError, match=match):
        depth_bench.check_settings(args)


def test_harness_runs_and_serial_forward_option(depth_bench):
    args = depth_bench.build_parser().parse_args([])
    runs = depth_bench.check_settings(args)
    labels = [r.label for r in runs]
    assert labels[0] == "serial (1 process)"
    assert "1F1B M=1" not in labels and "1F1B M=2" in labels  # 1F1B needs M >= 2
    assert sum(r.kind == "gpipe" for r in runs) == 4
    assert depth_bench.parse_lp("2,4,serial,1").fwd_iters == 0
