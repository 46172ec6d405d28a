"""The models and data ``leantrain compare`` trains: :data:`TASKS`.

A :class:`Task` is a seeded model and its data, ready for any optimizer: every
optimizer of a comparison trains a copy of the same initial weights on the same
batches in the same order. ``--model gpt|mlp|cnn`` picks a :class:`TaskSpec`, which
also holds the defaults of ``--steps``, ``--batch-size``, ``--lr`` and ``--data``.

Extending: a model/data pairing is one entry in :data:`TASKS`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from leantrain.compare.devices import to_device
from leantrain.data import (
    TensorBatches,
    TokenBatches,
    fixed_token_batches,
    load_corpus,
    load_digits,
    load_image_folder,
)
from leantrain.models import CNN, GPT, MLP, GPTConfig, lm_loss


@dataclass
class Task:
    """A model and its data, ready to be trained with any optimizer.

    ``batches()`` returns a fresh seeded stream, so every optimizer sees the same
    batches in the same order; ``val_batches`` is a fixed list.
    """

    description: str
    model: nn.Module
    batches: Callable[[], Iterator[tuple[torch.Tensor, ...]]]
    val_batches: list[tuple[torch.Tensor, ...]]
    # criterion(model(batch[0]), batch[1]): split so gradient makers can record the
    # model call and the loss call apart.
    criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The training loss of ``model`` on one batch (inputs, targets)."""
        return self.criterion(model(batch[0]), batch[1])

    def to(self, device: torch.device | str) -> Task:
        """This task on ``device``: the model moved there, every batch moved as it
        is drawn (the stream itself stays the seeded one made on the CPU)."""
        batches = self.batches
        return dataclasses.replace(
            self,
            model=self.model.to(device),
            batches=lambda: (to_device(b, device) for b in batches()),
            val_batches=[to_device(b, device) for b in self.val_batches],
        )


@dataclass(frozen=True)
class TaskSpec:
    """How to build a task, and its default ``--steps/--batch-size/--lr``."""

    build: Callable[[argparse.Namespace], Task]
    steps: int
    batch_size: int
    lr: float
    default_data: str


def gpt_task(args: argparse.Namespace, config: GPTConfig | None = None) -> Task:
    """The GPT task on ``args.data``: ``GPT.default()``, or ``GPT(config)`` (e.g. a
    larger model for step timing, as ``benchmarks/optimizers.py`` runs)."""
    corpus = load_corpus(args.data)
    torch.manual_seed(args.seed)
    model = GPT.default() if config is None else GPT(config)
    name = (
        "GPT.default()"
        if config is None
        else f"GPT(n_layer={config.n_layer}, d_model={config.d_model})"
    )
    T = model.config.block_size
    # Checks block_size against the corpus before any training starts.
    val = fixed_token_batches(
        corpus.val, 8, block_size=T, batch_size=args.batch_size, seed=args.seed + 1
    )
    return Task(
        description=f"{name} ({model.num_params():,} params), byte-level "
        f"text '{corpus.name}' ({len(corpus.train):,} train bytes), T={T}",
        model=model,
        batches=lambda: iter(
            TokenBatches(
                corpus.train, block_size=T, batch_size=args.batch_size, seed=args.seed
            )
        ),
        val_batches=val,
        criterion=lm_loss,
    )


def _image_task(
    make_model: Callable[[tuple[int, int, int], int], nn.Module], name: str
) -> Callable[[argparse.Namespace], Task]:
    def build(args: argparse.Namespace) -> Task:
        split = load_digits() if args.data == "digits" else load_image_folder(args.data)
        torch.manual_seed(args.seed)
        c, h, w = split.image_shape
        model = make_model(split.image_shape, split.num_classes)
        n_params = sum(p.numel() for p in model.parameters())
        return Task(
            description=f"{name} ({n_params:,} params) on images '{args.data}' "
            f"({len(split.train_y)} train / {len(split.val_y)} val, {c}x{h}x{w})",
            model=model,
            batches=lambda: iter(
                TensorBatches(
                    split.train_x,
                    split.train_y,
                    batch_size=args.batch_size,
                    seed=args.seed,
                )
            ),
            val_batches=list(
                zip(split.val_x.split(512), split.val_y.split(512), strict=True)
            ),
            criterion=F.cross_entropy,
        )

    return build


TASKS: dict[str, TaskSpec] = {
    "gpt": TaskSpec(gpt_task, steps=200, batch_size=16, lr=2e-3, default_data="stdlib"),
    "mlp": TaskSpec(
        _image_task(lambda shape, k: MLP((math.prod(shape), 512, 512, k)), "MLP"),
        steps=300,
        batch_size=64,
        lr=1e-3,
        default_data="digits",
    ),
    "cnn": TaskSpec(
        _image_task(lambda shape, k: CNN(shape[0], k), "CNN"),
        steps=300,
        batch_size=64,
        lr=1e-3,
        default_data="digits",
    ),
}


@torch.no_grad()
def evaluate(model: nn.Module, task: Task) -> float:
    """Mean loss over the task's fixed validation batches, in eval mode."""
    was_training = model.training
    model.eval()
    losses = [float(task.loss(model, batch)) for batch in task.val_batches]
    model.train(was_training)
    return sum(losses) / len(losses)


def resolve_defaults(args: argparse.Namespace) -> TaskSpec:
    """Fill ``--steps/--batch-size/--lr/--data`` left unset from the model's spec."""
    spec = TASKS[args.model]
    for name in ("steps", "batch_size", "lr"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(spec, name))
    if args.data is None:
        args.data = spec.default_data
    return spec
