"""The tiny leantrain GPT of the tests: one builder for every test that needs one.

Tests built it three ways (each file its own seed, sizes and dtype); :func:`tiny_gpt`
is the one builder, its keywords the :class:`~leantrain.models.GPTConfig` fields a
test sets.
"""

from __future__ import annotations

import torch

from leantrain.models import GPT, GPTConfig


def tiny_gpt(
    *,
    seed: int | None = 0,
    dtype: torch.dtype = torch.float32,
    block_size: int = 16,
    n_layer: int = 2,
    n_head: int = 2,
    d_model: int = 32,
    **config,
) -> GPT:
    """``GPT(GPTConfig(...))`` of a few thousand weights, after
    ``torch.manual_seed(seed)`` (``seed=None``: the caller's generator state), in
    ``dtype``; ``config``: further GPTConfig fields (``vocab_size``, ``t_final``, ...).
    """
    if seed is not None:
        torch.manual_seed(seed)
    config = GPTConfig(
        block_size=block_size, n_layer=n_layer, n_head=n_head, d_model=d_model, **config
    )
    return GPT(config).to(dtype)
