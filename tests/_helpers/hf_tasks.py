"""One tiny training task per Hugging Face model family, shared by the Gefen tests.

A task is a model factory, a fixed list of batches and the model's own loss (the
``.loss`` HF computes from ``labels``), so two optimizers can be run from the same
initial weights on the same batches and their losses compared.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tests._helpers.hf_models import (
    VOCAB,
    image_batch,
    tiny_bert,
    tiny_gpt2,
    tiny_llama,
    tiny_vit,
    token_batch,
)

MASK_ID = VOCAB - 1  # the tiny BERT's stand-in [MASK] token


def _lm_batch(seed: int) -> dict:
    ids = token_batch(seed=seed)
    return {"input_ids": ids, "labels": ids}  # HF shifts the labels itself


def _mlm_batch(seed: int) -> dict:
    """A quarter of the positions masked; only those are predicted."""
    ids = token_batch(seed=seed)
    g = torch.Generator().manual_seed(1000 + seed)
    masked = torch.rand(ids.shape, generator=g) < 0.25
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    return {"input_ids": torch.where(masked, MASK_ID, ids), "labels": labels}


def _image_batch(seed: int) -> dict:
    images, labels = image_batch(seed=seed)
    return {"pixel_values": images, "labels": labels}


@dataclass(frozen=True)
class Task:
    """A model family's factory and batches."""

    build: Callable[..., nn.Module]
    batch: Callable[[int], dict]

    def batches(self, n: int = 4, seed: int = 0) -> list[dict]:
        return [self.batch(seed * 100 + i) for i in range(n)]


TASKS = {
    "gpt2": Task(tiny_gpt2, _lm_batch),
    "llama": Task(tiny_llama, _lm_batch),
    "bert": Task(tiny_bert, _mlm_batch),
    "vit": Task(tiny_vit, _image_batch),
}


def cast_batch(batch: dict, dtype: torch.dtype) -> dict:
    """Floating inputs (pixels) in ``dtype``; ids and labels unchanged."""
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}


def train(
    model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[dict], steps: int
) -> list[float]:
    """``steps`` optimizer steps cycling through ``batches``; the loss of each."""
    losses = []
    dtype = next(model.parameters()).dtype
    for step in range(steps):
        batch = cast_batch(batches[step % len(batches)], dtype)
        optimizer.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return losses


def mean_loss(model: nn.Module, batches: list[dict]) -> float:
    """The model's mean loss over ``batches`` (no gradient)."""
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        return sum(float(model(**cast_batch(b, dtype)).loss) for b in batches) / len(
            batches
        )
