"""Shared by the GefenMuon tests: a matrix-only MLP and a relative difference."""

from __future__ import annotations

import torch
from torch import nn


def matrix_mlp(seed: int = 0) -> nn.Module:
    """Only 2-D parameters (no biases): every parameter is a Muon parameter."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(12, 32, bias=False),
        nn.Tanh(),
        nn.Linear(32, 24, bias=False),
        nn.Tanh(),
        nn.Linear(24, 5, bias=False),
    )


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())
