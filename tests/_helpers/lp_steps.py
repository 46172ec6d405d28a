"""Small test steps for the layer-parallel tests."""

from __future__ import annotations

import torch
from torch import nn


class TanhStep(nn.Module):
    """``u + dt * tanh(u W + b)``: a nonlinear residual step with parameters."""

    def __init__(self, d: int, scale: float = 1.0) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        nn.init.normal_(self.lin.weight, std=scale / d**0.5)

    def forward(self, u: torch.Tensor, dt: float) -> torch.Tensor:
        return u + dt * torch.tanh(self.lin(u))


class PairStep(nn.Module):
    """Tuple state ``(x, y) -> (x + dt tanh(xA), y + dt tanh(x B + y C))``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, state, dt: float):
        x, y = state
        y = y + dt * torch.tanh(self.b(x) + self.c(y))
        return x + dt * torch.tanh(self.a(x)), y


class DiagStep(nn.Module):
    """The linear test ODE ``x' = lambda x`` (diagonal): ``u + dt * lambda * u``."""

    def __init__(self, lam: torch.Tensor) -> None:
        super().__init__()
        self.lam = nn.Parameter(lam.clone())

    def forward(self, u: torch.Tensor, dt: float) -> torch.Tensor:
        return u + dt * self.lam * u


def tanh_steps(n: int, d: int, seed: int = 0, scale: float = 1.0) -> nn.ModuleList:
    torch.manual_seed(seed)
    return nn.ModuleList(TanhStep(d, scale) for _ in range(n)).double()
