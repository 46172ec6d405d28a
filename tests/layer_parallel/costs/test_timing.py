"""The simulator's measured inputs: layer-step samples and the stack spec."""

import pytest
import torch

from leantrain.layer_parallel.costs.timing import (
    LayerSampler,
    StackSpec,
    layer_times,
    measure_two_process,
)
from leantrain.models.blocks import TransformerBlock


def test_layer_sampler_times_the_four_kinds_of_step():
    spec = StackSpec(n_layers=4, d_model=16, n_head=2, batch=2, tokens=8)
    torch.manual_seed(0)
    block = TransformerBlock(spec.d_model, spec.n_head, causal=True)
    x = torch.randn(spec.batch, spec.tokens, spec.d_model)
    sampler = LayerSampler(block, x, 0.25)
    for _ in range(3):
        sampler()
    assert len(sampler.samples) == 3 and all(len(s) == 4 for s in sampler.samples)
    t = sampler.times()
    # Medians of the samples, in LayerTimes' field order.
    for k, value in enumerate(
        (t.forward, t.backward, t.forward_record, t.backward_params)
    ):
        column = sorted(s[k] for s in sampler.samples)
        assert value == column[1] and value > 0
    assert layer_times(block, x, 0.25, reps=2).serial_step > 0
    # Sampling uses torch.autograd.grad: the block's .grad stays untouched.
    assert all(p.grad is None for p in block.parameters())


def _never_built(spec: StackSpec) -> list:
    raise AssertionError("the stack is checked before any process is spawned")


def test_unsplittable_stack_raises_before_spawning():
    with pytest.raises(ValueError, match="n_layers=6"):
        measure_two_process(StackSpec(n_layers=6, cf=4), _never_built)
