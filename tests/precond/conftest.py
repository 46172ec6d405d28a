"""Small models with the five output patterns of the ASDL paper, and helpers."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """Plain logits."""

    def __init__(self, d_in: int = 5, d_hidden: int = 7, d_out: int = 3) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class LogitsAndLoss(MLP):
    """Returns ``(logits, loss)``, the loss computed inside the model."""

    def forward(self, x: torch.Tensor, t: torch.Tensor):  # type: ignore[override]
        logits = super().forward(x)
        return logits, F.cross_entropy(logits, t)


class DictOutput(MLP):
    """Returns ``{"logits": ..., "hidden": ...}``."""

    def forward(self, x: torch.Tensor):  # type: ignore[override]
        hidden = torch.tanh(self.fc1(x))
        return {"logits": self.fc2(hidden), "hidden": hidden}


@dataclass
class ModelOutput:
    """Shaped like Hugging Face's ``ModelOutput``: named fields, optional loss."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None


class DataclassOutput(MLP):
    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None):  # type: ignore[override]
        logits = super().forward(x)
        loss = None if labels is None else F.cross_entropy(logits, labels)
        return ModelOutput(logits=logits, loss=loss)


class TinyLM(nn.Module):
    """Embedding -> mixing -> vocabulary logits of shape (B, T, V)."""

    def __init__(self, vocab: int = 11, d: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)  # (B, T, d)
        h = h + torch.tanh(self.mix(h)).cumsum(dim=1) / h.shape[1]  # causal mixing
        return self.head(h)  # (B, T, V)


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def assert_grads_close(a: nn.Module, b: nn.Module, **tol) -> None:
    ga, gb = grads_of(a), grads_of(b)
    assert ga.keys() == gb.keys()
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], msg=name, **tol)


def reference_step(model, loss_of, batch, *, damping, curvature=None):
    """Diagonal-empirical-Fisher preconditioned grads of one step, example by example.

    ``loss_of(model, sub_batch)`` is the loss on a slice of the batch (a tuple of
    tensors split along dim 0). Returns ``(preconditioned grads, diag curvature)``;
    a given ``curvature`` is used instead of this batch's (a stale preconditioner).
    """
    params = dict(model.named_parameters())
    per_example = []
    for i in range(batch[0].shape[0]):
        loss = loss_of(model, tuple(b[i : i + 1] for b in batch))
        per_example.append(torch.autograd.grad(loss, list(params.values())))
    diag = {
        n: torch.stack([g[k] for g in per_example]).square().mean(0)
        for k, n in enumerate(params)
    }
    full = torch.autograd.grad(loss_of(model, batch), list(params.values()))
    use = diag if curvature is None else curvature
    return {n: full[k] / (use[n] + damping) for k, n in enumerate(params)}, diag


def assert_dicts_close(a: dict, b: dict, **tol) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=k, **tol)


def twin(model: nn.Module) -> nn.Module:
    """An independent deep copy with the same parameters (the reference run)."""
    return copy.deepcopy(model)


@pytest.fixture
def zoo() -> SimpleNamespace:
    """The models and helpers above (test modules do not import conftest)."""
    torch.manual_seed(0)
    return SimpleNamespace(
        MLP=MLP,
        LogitsAndLoss=LogitsAndLoss,
        DictOutput=DictOutput,
        DataclassOutput=DataclassOutput,
        ModelOutput=ModelOutput,
        TinyLM=TinyLM,
        grads_of=grads_of,
        assert_grads_close=assert_grads_close,
        assert_dicts_close=assert_dicts_close,
        reference_step=reference_step,
        twin=twin,
    )
