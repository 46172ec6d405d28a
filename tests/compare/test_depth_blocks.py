"""The depth axis's block factory: the GPT blocks the two-process timing runs."""

import torch

from leantrain.compare.depth import gpt_blocks
from leantrain.layer_parallel.costs import StackSpec
from leantrain.models import GPT, GPTConfig


def test_gpt_blocks_are_the_gpt_blocks_of_the_spec_seed():
    spec = StackSpec(n_layers=4, d_model=16, n_head=2, batch=3, tokens=8, seed=7)
    torch.manual_seed(7)
    gpt = GPT(GPTConfig(block_size=8, n_layer=4, n_head=2, d_model=16, t_final=1.0))
    for built, ref in zip(gpt_blocks(spec), gpt.stack.steps, strict=True):
        for a, b in zip(built.parameters(), ref.parameters(), strict=True):
            assert torch.equal(a, b)
    assert spec.state_bytes == 3 * 8 * 16 * 4  # one fp32 state
