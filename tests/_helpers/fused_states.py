"""Helpers shared by the fused-step tests (the ``backend`` fixture: conftest.py)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import torch

from leantrain.optim._state import new_state

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, maximize=False)
SHAPES = [(1, 1), (1001, 7), (999, 1), (4096, 64), (3001, 3001), (20000, 100)]


def codebook(bits: int, power: float = 1.7) -> torch.Tensor:
    """A sorted, non-uniform codebook with the end codes pinned to -1 and +1."""
    t = torch.linspace(-1, 1, 2**bits, dtype=torch.float64)
    return (t.sign() * t.abs() ** power).float()


def copy_state(state: dict) -> dict:
    return {k: (v if k == "codebook" else v.clone()) for k, v in state.items()}


def codes_of(state: dict, n: int) -> torch.Tensor:
    """The state's codes, one per element (4-bit: element 2i is the low nibble)."""
    raw = state["exp_avg_codes"]
    if state["codebook"].numel() == 256:
        return raw.clone()
    return torch.stack([raw & 15, raw >> 4], dim=1).reshape(-1)[:n]


def exact_nearest(x: torch.Tensor, cb: torch.Tensor) -> torch.Tensor:
    """Index of the code nearest each x, ties to the lower code, decided exactly.

    float64 distances settle all but near-ties (a denormal x next to a midpoint at
    0 ties in float64); those are decided with exact rationals.
    """
    dist = (x.double()[:, None] - cb.double()[None, :]).abs()
    best = dist.argmin(dim=1)
    near = (dist - dist.min(dim=1, keepdim=True).values) <= 1e-12
    for i in torch.nonzero(near.sum(dim=1) > 1).flatten().tolist():
        xi = Fraction(float(x[i]))
        cands = torch.nonzero(near[i]).flatten().tolist()
        best[i] = min(cands, key=lambda j: (abs(xi - Fraction(float(cb[j]))), j))
    return best


def ulps(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> float:
    """Largest |a - b| in units of the fp32 spacing at ``scale``."""
    spacing = torch.from_numpy(np.spacing(scale.abs().numpy().astype(np.float32)))
    return float(((a - b).abs() / spacing).max())


def random_state(n: int, period: int, bits: int | None, seed: int) -> dict:
    """A state after some training: random codes, absmax and v (m != 0)."""
    g = torch.Generator().manual_seed(seed)
    state = new_state(torch.empty(n), period, bits, codebook(bits) if bits else None)
    state["step"] += 3
    state["exp_avg_sq"].copy_(torch.rand(state["exp_avg_sq"].shape, generator=g) * 0.1)
    if bits is None:
        state["exp_avg"].normal_(generator=g)
        return state
    codes = torch.randint(0, 2**bits, (n,), generator=g, dtype=torch.uint8)
    if bits == 4:
        codes = torch.cat([codes, codes.new_zeros(n % 2)])
        codes = codes[0::2] | (codes[1::2] << 4)
    state["exp_avg_codes"].copy_(codes)
    state["exp_avg_absmax"].copy_(
        torch.rand(state["exp_avg_absmax"].shape, generator=g)
    )
    return state


def spaced_codebook(bits: int, seed: int = 1) -> torch.Tensor:
    """Codes at distinct histogram-bin centres, like a learned codebook: at most one
    midpoint per lookup cell, the kernel's one-comparison path."""
    bins = torch.randperm(4096, generator=torch.Generator().manual_seed(seed))
    inner = -1 + (torch.sort(bins[: 2**bits - 2]).values + 0.5) / 2048
    return torch.cat([torch.tensor([-1.0]), inner, torch.tensor([1.0])])
