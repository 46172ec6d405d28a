"""Gefen under DDP, FSDP2 and DCP (gloo, spawned ranks) versus one process.

Every run sees the same union batch (``GLOBAL_BATCH`` of
``tests._helpers.gefen_workers``, split over the ranks) and float64 parameters, so
the fp32 gradients Gefen reads are the same in every layout; the partition and the
codebook must then be identical, and the parameters equal to fp32 summation order.
"""

from __future__ import annotations

import pytest
import torch

from tests._helpers import gefen_workers as workers
from tests._helpers.launchers import run_distributed


def _rel(params: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    return max(
        float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
        for a, b in zip(params, ref, strict=True)
    )


def _agree(params: list[torch.Tensor], ref: list[torch.Tensor], rtol: float) -> bool:
    """Every element within ``rtol`` of the reference (relative to its tensor's
    largest entry), except at most 1 in 1000 that are off by a momentum code step.

    The layouts' fp32 updates differ in the last ulp (their sums run in another
    order), so a stored 8-bit momentum that lands within an ulp of the midpoint of
    two codes can take the other code on one side: that element then moves by one
    code step (here 4e-5 of its tensor's scale, 2.4e-4 after a few more such
    flips; 4 of 6033 elements after 20 steps) while the rest stay within 3e-7. A
    wrong step (a shard's sum or absmax missing) moves every element.
    """
    off, worst, total = 0, 0.0, 0
    for a, b in zip(params, ref, strict=True):
        rel = (a - b).abs() / b.abs().max().clamp_min(1e-30)
        off += int((rel > rtol).sum())
        worst = max(worst, float(rel.max()))
        total += rel.numel()
    return worst <= rtol or (off <= total // 1000 and worst <= 1e-3)


def _exact(params: list[torch.Tensor], ref: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(params, ref, strict=True))


def _run(world: int, root: str, sources: tuple[str, ...]) -> list[dict]:
    return run_distributed(workers.everything, world, root, sources, timeout=900)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("gefen_dcp"))
    workers.first_half(1, 0, f"{root}/one")  # a one-process DCP checkpoint
    return root, _run(2, root, ("one",))


def check_training(results: list[dict], world: int) -> None:
    for rank, out in enumerate(results):
        train = out["train"]
        for bits in (8, 4):
            for kind in ("ddp", "fsdp"):
                # the defaults factor whole matrices (DDP, one process) but keep
                # blocks for FSDP2 shards (a column factor spans the ranks)
                blocks = kind == "fsdp" and world > 1
                second_moment = "blocks" if blocks else "auto"
                ref_params, ref = workers.reference(
                    world, bits, workers.STEPS, second_moment
                )
                params, got = train[f"{kind}{bits}"]
                where = f"rank {rank}, {kind}, {bits}-bit"
                assert got["periods"] == ref["periods"], where
                assert torch.equal(got["codebook"], ref["codebook"]), where
                assert _agree(params, ref_params, 1e-5), where
        # the meta-initialised FSDP2 run: shards keep blocks ("auto" factors whole
        # matrices in one process)
        init_layout = "blocks" if world > 1 else "auto"
        init_ref, init_summary = workers.reference(world, 8, 5, init_layout)
        assert train["init"]["summary"]["periods"] == init_summary["periods"]
        assert torch.equal(
            train["init"]["summary"]["codebook"], init_summary["codebook"]
        )
        assert _rel(train["init"]["params"], init_ref) <= 1e-5
        assert train["nonfinite"] == {"skipped": 1, "unchanged": True}, rank
    for out in results[1:]:  # every rank holds the same global parameters
        assert _exact(out["train"]["fsdp8"][0], results[0]["train"]["fsdp8"][0])


def check_dcp(results: list[dict], world: int) -> None:
    ref, _ = workers.reference(world, 8, workers.STEPS, workers.DCP_SECOND_MOMENT)
    for out in results:
        dcp = out["dcp"]
        # DCP's zero-gradient lr-0 step left provisional states and changed nothing
        assert set(dcp["template_periods"]) == {0}
        assert _exact(dcp["after_template"], dcp["uninterrupted"])
        assert _exact(dcp["resumed"][0], dcp["uninterrupted"])
        for source, params in dcp["from"].items():
            assert _agree(params, ref, 1e-6), source
        errors = dcp["errors"]
        assert "Size mismatch" in errors["model"] and "0.weight" in errors["model"]
        assert "exp_avg_codes" in errors["bits"] or "codebook" in errors["bits"]
        assert "exp_avg" in errors["adamw"]
        if world > 1:  # sharded: a clear error; one process: it trains
            assert "ValueError" in errors["factored"], errors["factored"]
            assert "FSDP2-sharded" in errors["factored"]
        else:
            assert errors["factored"] == ""
        # the 4-bit default factors whole matrices, and keeps blocks for shards (the
        # 8-bit default too; the checkpoints above are blocks, see DCP_SECOND_MOMENT)
        assert dcp["auto_4bit_factored"] == (world == 1)


def test_two_ranks_ddp_and_fsdp2_equal_one_process(two_ranks):
    check_training(two_ranks[1], 2)


def test_two_ranks_dcp_round_trips(two_ranks):
    check_dcp(two_ranks[1], 2)


def test_two_rank_checkpoint_resumes_in_one_process(two_ranks):
    root, _ = two_ranks
    ref, _ = workers.reference(1, 8, workers.STEPS, workers.DCP_SECOND_MOMENT)
    params, summary = workers.resume(1, 0, f"{root}/w2")
    assert _agree(params, ref, 1e-6)
    assert summary["periods"] == workers.reference(1, steps=1)[1]["periods"]


@pytest.mark.slow
def test_four_ranks(tmp_path):
    root = str(tmp_path)
    workers.first_half(1, 0, f"{root}/one")
    run_distributed(workers.save_first_half, 2, f"{root}/w2", timeout=600)
    results = _run(4, root, ("one", "w2"))
    check_training(results, 4)
    check_dcp(results, 4)
