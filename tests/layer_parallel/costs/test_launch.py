"""The measurement tools' launcher: a function on local gloo processes."""

import pytest
import torch

from leantrain.layer_parallel.costs.launch import free_port, run_on_gloo


def _sum_of_ranks(rank: int, offset: int) -> tuple[int, float]:
    import torch.distributed as dist

    t = torch.tensor([float(rank + offset)])
    dist.all_reduce(t)
    return rank, t.item()


def _rank_one_fails(rank: int) -> None:
    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")


def test_run_on_gloo_returns_rank_zeros_result_of_a_collective():
    assert run_on_gloo(_sum_of_ranks, 2, 10, timeout=120) == (0, 21.0)


def test_a_failing_rank_raises_instead_of_hanging():
    with pytest.raises(RuntimeError, match="exit codes"):
        run_on_gloo(_rank_one_fails, 2, timeout=120)


@pytest.mark.parametrize("world_size", [0, 1.5, True])
def test_bad_world_size_is_refused(world_size):
    with pytest.raises(ValueError, match="world_size"):
        run_on_gloo(_sum_of_ranks, world_size, 0)


def test_free_port_is_a_port():
    assert 0 < free_port() < 65536
