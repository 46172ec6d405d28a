"""The simulator's measured inputs: layer-step samples and the stack spec."""

import pytest
import torch

from leantrain.layer_parallel.costs.timing import (
    LayerSampler,
    StackSpec,
    layer_times,
    measure_two_process,
)
from leantrain.models import GPT, GPTConfig


def test_layer_sampler_times_the_four_kinds_of_step():
    spec = StackSpec(n_layers=4, d_model=16, n_head=2, batch=2, tokens=8)
    block = spec.blocks()[0]
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


def test_stack_spec_builds_the_gpt_blocks_of_its_seed():
    spec = StackSpec(n_layers=4, d_model=16, n_head=2, batch=3, tokens=8, seed=7)
    torch.manual_seed(7)
    gpt = GPT(GPTConfig(block_size=8, n_layer=4, n_head=2, d_model=16, t_final=1.0))
    for built, ref in zip(spec.blocks(), gpt.stack.steps, strict=True):
        for a, b in zip(built.parameters(), ref.parameters(), strict=True):
            assert torch.equal(a, b)
    assert spec.state_bytes == 3 * 8 * 16 * 4  # one fp32 state


def test_unsplittable_stack_raises_before_spawning():
    with pytest.raises(ValueError, match="n_layers=6"):
        measure_two_process(StackSpec(n_layers=6, cf=4))
