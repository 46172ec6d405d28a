"""Tiny float64 models and batches for the curvature tests (shared helpers)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

N_EXAMPLES = 5


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 5)
        self.fc2 = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(3)
        self.conv2 = nn.Conv2d(3, 2, 2, stride=2, bias=False)
        self.bn1d = nn.BatchNorm1d(8)
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N, 2, 4, 4)
        h = torch.tanh(self.bn(self.conv1(x)))
        h = torch.tanh(self.conv2(h)).flatten(1)  # (N, 8)
        return self.fc(self.bn1d(h))


class EmbedLN(nn.Module):
    """Token model with a per-position output (N, T, C)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 4, padding_idx=0)
        self.ln = nn.LayerNorm(4)
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: (N, T)
        h = self.ln(self.emb(ids))  # (N, T, 4)
        h = torch.tanh(self.fc(h))
        # mixes positions so the per-position outputs share the whole sequence
        h = h + h.mean(dim=1, keepdim=True)
        return self.head(h)  # (N, T, 3)


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(6, 4)
        self.pos = nn.Embedding(3, 4)
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.ln = nn.LayerNorm(4)
        self.head = nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: (N, T=3)
        t = ids.shape[1]
        positions = torch.arange(t, device=ids.device).expand(
            ids.shape[0], t
        )  # batched: (N, T)
        h = self.tok(ids) + self.pos(positions)
        mask = torch.ones(t, t, dtype=torch.bool, device=ids.device).triu(diagonal=1)
        a, _ = self.attn(h, h, h, attn_mask=mask)
        h = self.ln(h + a)
        return self.head(h.mean(dim=1))  # (N, 2)


@dataclass
class Case:
    name: str
    model: nn.Module
    inputs: torch.Tensor
    ce_targets: torch.Tensor
    mse_targets: torch.Tensor


def _perturb(model: nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.copy_(torch.randn(m.num_features, generator=gen))
                m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)


def make_case(name: str, n: int = N_EXAMPLES, seed: int = 0, seq: int = 3) -> Case:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    model = {"mlp": MLP, "cnn": SmallCNN, "embed_ln": EmbedLN, "attn": Attn}[name]()
    model = model.double()
    _perturb(model, gen)
    model.eval()  # BatchNorm on running statistics: examples independent
    if name == "mlp":
        inputs = torch.randn(n, 4, generator=gen, dtype=torch.float64)
    elif name == "cnn":
        inputs = torch.randn(n, 2, 4, 4, generator=gen, dtype=torch.float64)
    elif name == "embed_ln":
        inputs = torch.randint(0, 7, (n, seq), generator=gen)
        inputs[0, -1] = 0  # a padding token
    else:
        inputs = torch.randint(0, 6, (n, seq), generator=gen)
    with torch.no_grad():
        out = model(inputs)
    classes = out.shape[-1]
    ce_targets = torch.randint(0, classes, out.shape[:-1], generator=gen)
    if name == "embed_ln" and n > 1:
        ce_targets[1, -1] = -100  # an ignored position
    mse_targets = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    return Case(name, model, inputs, ce_targets, mse_targets)


MODEL_NAMES = ("mlp", "cnn", "embed_ln", "attn")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))
