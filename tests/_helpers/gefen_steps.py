"""Helpers shared by the Gefen test files."""

from __future__ import annotations

import torch


def param_groups(model, lr_decay=1e-2, lr_other=3e-3):
    """Two groups as users write them: decayed matrices, undecayed vectors."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    return [
        {"params": decay, "lr": lr_decay, "weight_decay": 0.1},
        {"params": other, "lr": lr_other, "weight_decay": 0.0},
    ]


def one_step(model, opt, d_in):
    """One step of ``opt`` on a random batch of width ``d_in`` (mean-square loss)."""
    opt.zero_grad()
    model(torch.randn(32, d_in)).square().mean().backward()
    opt.step()
