"""Gefen's codebook, learned once from the first gradients (single process or
FSDP2 shards, whose histograms add up to the global one)."""

from __future__ import annotations

import torch
from torch import Tensor

from . import _dist
from ._sharded import local_histogram, partial_absmax
from ._state import qblock_for
from .codebook import histogram, learn_codebook, with_exact_zero

# Histogram bins of the first-gradient codebook (codebook.histogram's default).
BINS = 4096


def learn_first_codebook(bits: int, members: list[tuple[dict, Tensor, int]]) -> Tensor:
    """The shared codebook of ``bits`` from the first gradients of ``members``
    ((group, parameter, period) triples): their histograms of g / block absmax
    (qblock blocks, global ones under FSDP2), summed, fed to the exact 1-D k-means;
    its code nearest 0 then moved to 0 (``codebook.with_exact_zero``), so that a
    momentum that is exactly 0 is stored exactly and stays 0."""
    counts = torch.zeros(BINS, dtype=torch.float64)
    sharded = []
    for group, param, period in members:
        g = _dist.local(param.grad).reshape(-1).float()
        if group.get("maximize", False):  # GefenMuon has no maximize
            g = -g
        # Normalize by the momentum's own quantization blocks (qblock): the
        # codebook must fit m / absmax, also for per-element second moments.
        if _dist.is_sharded(param):
            sharded.append((param, g, qblock_for(period)))
        else:
            counts += histogram(g, qblock_for(period), BINS).cpu()
    if sharded:
        # Blocks straddling ranks need their global absmax before anyone
        # normalizes; the sum of the ranks' histograms is the global one.
        reduce = _dist.SharedReduce()
        parts = []
        for param, g, qblock in sharded:
            span = _dist.my_span(param)
            absmax = partial_absmax(g, span, qblock)
            reduce.add(absmax, span, qblock, _dist.shared_for(param, qblock))
            parts.append((g, span, qblock, absmax))
        group = _dist.group_of(sharded[0][0])
        reduce.run("max", group)
        local = torch.zeros(BINS, dtype=torch.float64)
        for g, span, qblock, absmax in parts:
            local += local_histogram(g, span, qblock, absmax, BINS).cpu()
        # Reduced on the parameters' device (NCCL reduces device tensors only).
        device = _dist.local(sharded[0][0]).device
        counts += _dist.all_reduce(local.to(device), "sum", group).cpu()
    codebook = with_exact_zero(learn_codebook(counts, 2**bits).to(torch.float32))
    return codebook.to(_dist.local(members[0][1]).device)
