"""Independent block structure of the test models (from first principles)."""

from __future__ import annotations

import torch
from torch import nn


def param_offsets(model: nn.Module) -> dict[int, int]:
    offsets, start = {}, 0
    for p in model.parameters():
        if p.requires_grad:
            offsets[id(p)] = start
            start += p.numel()
    return offsets


def module_groups(model: nn.Module) -> dict[str, list[int]]:
    """Global flat indices of each parameter-owning module's own parameters."""
    offsets = param_offsets(model)
    groups = {}
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if own:
            groups[name] = [offsets[id(p)] + i for p in own for i in range(p.numel())]
    return groups


def unit_groups(model: nn.Module) -> list[list[int]]:
    """Per output unit, the global indices of ``[weight row, bias entry]``."""
    off = param_offsets(model)
    units = []
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            w, b = module.weight, module.bias
            per_row = w[0].numel()
            for r in range(w.shape[0]):
                unit = [off[id(w)] + r * per_row + j for j in range(per_row)]
                units.append(unit + ([off[id(b)] + r] if b is not None else []))
        elif isinstance(module, nn.Embedding):
            vocab, dim = module.weight.shape
            for d in range(dim):
                units.append(
                    [off[id(module.weight)] + v * dim + d for v in range(vocab)]
                )
        elif isinstance(module, (nn.LayerNorm, nn.BatchNorm1d, nn.BatchNorm2d)):
            for i in range(module.weight.numel()):
                units.append([off[id(module.weight)] + i, off[id(module.bias)] + i])
        elif isinstance(module, nn.MultiheadAttention):
            w, b = module.in_proj_weight, module.in_proj_bias
            cols = w.shape[1]
            for r in range(w.shape[0]):
                units.append(
                    [off[id(w)] + r * cols + j for j in range(cols)] + [off[id(b)] + r]
                )
    return units


def block_mask(groups: list[list[int]], size: int) -> torch.Tensor:
    mask = torch.zeros(size, size, dtype=torch.bool)
    for g in groups:
        idx = torch.tensor(g)
        mask[idx.unsqueeze(-1), idx.unsqueeze(-2)] = True
    return mask


def masked(reference: torch.Tensor, model: nn.Module, shape: str) -> torch.Tensor:
    """The part of a dense matrix a representation keeps."""
    size = reference.shape[0]
    if shape == "full":
        return reference
    if shape == "diag":
        return torch.diag(reference.diagonal())
    groups = (
        list(module_groups(model).values()) if shape == "layer" else unit_groups(model)
    )
    return reference * block_mask(groups, size)
