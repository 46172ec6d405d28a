"""The launcher itself: results come back per rank; a failing rank is reported."""

import pytest
import torch
import torch.distributed as dist

from tests._helpers.launchers import run_distributed

pytestmark = pytest.mark.distributed


def _all_reduce_rank(rank: int, world_size: int) -> float:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank one")
    dist.barrier()


def test_all_reduce_sums_ranks():
    assert run_distributed(_all_reduce_rank, 3) == [3.0, 3.0, 3.0]


def test_failure_on_one_rank_is_reported_on_time():
    with pytest.raises(RuntimeError, match="boom on rank one"):
        run_distributed(_fail_on_rank_one, 2, timeout=10)
