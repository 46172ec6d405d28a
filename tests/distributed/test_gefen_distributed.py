"""Gefen under DDP and FSDP2 (gloo, spawned ranks) equals one process (union batch)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import _gefen_workers as workers
from tests.distributed.launch import run_distributed


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _check_world(world: int) -> None:
    results = run_distributed(workers.ddp_and_fsdp2, world, timeout=600)
    for rank, out in enumerate(results):
        for bits in (8, 4):
            ref_params, ref = out[f"ref{bits}"]
            for kind in ("ddp", "fsdp"):
                params, got = out[f"{kind}{bits}"]
                where = f"rank {rank}, {kind}, {bits}-bit"
                assert got["periods"] == ref["periods"], where
                assert torch.equal(got["codebook"], ref["codebook"]), where
                for p, q in zip(params, ref_params, strict=True):
                    assert _rel(p, q) <= 1e-5, where
        # sharded init (meta -> fully_shard -> to_empty -> copy) trains like eager
        init_ref, init_sum = workers.reference(world, 8, steps=5)
        assert out["init"]["summary"]["periods"] == init_sum["periods"]
        assert torch.equal(out["init"]["summary"]["codebook"], init_sum["codebook"])
        for p, q in zip(out["init"]["params"], init_ref, strict=True):
            assert _rel(p, q) <= 1e-5
    # every rank holds the same global parameters
    for out in results[1:]:
        for p, q in zip(out["fsdp8"][0], results[0]["fsdp8"][0], strict=True):
            assert torch.equal(p, q)


def test_ddp_and_fsdp2_two_ranks_equal_one_process():
    _check_world(2)


@pytest.mark.slow
def test_ddp_and_fsdp2_four_ranks_equal_one_process():
    _check_world(4)
