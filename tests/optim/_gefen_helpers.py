"""Helpers shared by the Gefen test files."""

from __future__ import annotations


def param_groups(model, lr_decay=1e-2, lr_other=3e-3):
    """Two groups as users write them: decayed matrices, undecayed vectors."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    return [
        {"params": decay, "lr": lr_decay, "weight_decay": 0.1},
        {"params": other, "lr": lr_other, "weight_decay": 0.0},
    ]
