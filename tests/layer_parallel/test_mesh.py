"""Validation of the distributed entry points that needs no process group (the
distributed behaviour itself is tested in tests/distributed/test_layer_parallel*.py)."""

from __future__ import annotations

import datetime

import pytest
import torch
from torch import nn

from leantrain.layer_parallel import LayerParallel
from leantrain.layer_parallel.comm import DistExchange, _timedelta, all_reduce_max
from leantrain.layer_parallel.mesh import LayerParallelConfig, ParallelDims, parallelize
from tests._helpers.lp_steps import tanh_steps


def test_parallel_dims_validate_and_count():
    assert ParallelDims(dp=3, lp=2).world_size == 6
    with pytest.raises(ValueError, match="dp must be >= 1, got 0"):
        ParallelDims(dp=0)
    with pytest.raises(TypeError, match="lp must be an int"):
        ParallelDims(lp=2.0)


def test_parallelize_rejects_models_without_layer_parallel():
    with pytest.raises(ValueError, match="contains no LayerParallel"):
        parallelize(nn.Linear(2, 2), mesh=None)
    with pytest.raises(TypeError, match="must be an nn.Module"):
        parallelize([nn.Linear(2, 2)], mesh=None)
    assert LayerParallelConfig().average_gradients


def test_exchange_needs_a_process_group():
    with pytest.raises(RuntimeError, match="initialised torch.distributed"):
        DistExchange()
    with pytest.raises(RuntimeError, match="initialised torch.distributed"):
        ParallelDims(lp=2).build_mesh()


def test_timeouts_and_local_reduction():
    assert _timedelta(None).total_seconds() == 300
    assert _timedelta(2.5) == datetime.timedelta(seconds=2.5)
    with pytest.raises(ValueError, match="timeout must be > 0 seconds, got 0"):
        _timedelta(0)
    with pytest.raises(TypeError, match="timeout must be seconds or a timedelta"):
        _timedelta("5")
    assert all_reduce_max([0.5, 2.0]) == [0.5, 2.0]  # no process group: identity


def test_one_process_stack_reports_all_layers_as_owned():
    stack = LayerParallel(tanh_steps(8, 2), cf=2)
    assert not stack.is_distributed and stack.owned_layers == range(8)
    assert len(stack.local_parameters()) == len(list(stack.parameters()))
    stack.synchronize_layers()  # a no-op without a process group
    stack.set_iterations(fwd=5, bwd=3)
    assert (stack.fwd_options.iterations, stack.bwd_options.iterations) == (5, 3)
    with pytest.raises(ValueError, match="fwd_iters must be >= 1"):
        stack.set_iterations(fwd=0)
    x = torch.randn(3, 2, dtype=torch.float64)
    assert stack(x).shape == x.shape
