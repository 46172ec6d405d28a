"""Gefen's codebook, learned once from the first gradients (single process or
FSDP2 shards, whose histograms add up to the global one)."""

from __future__ import annotations

import torch
from torch import Tensor

from . import _dist
from ._sharded import local_histogram, partial_absmax
from ._state import qblock_for
from .codebook import histogram_on_device, learn_codebook, with_exact_zero

# Histogram bins of the first-gradient codebook (codebook.histogram's default).
BINS = 4096


def learn_first_codebook(bits: int, members: list[tuple[dict, Tensor, int]]) -> Tensor:
    """The shared codebook of ``bits`` from the first gradients of ``members``
    ((group, parameter, period) triples): their histograms of g / block absmax
    (qblock blocks, global ones under FSDP2), summed, fed to the exact 1-D k-means;
    its code nearest 0 then moved to 0 (``codebook.with_exact_zero``), so that a
    momentum that is exactly 0 is stored exactly and stays 0.

    The histograms are made and summed on the parameters' device; the host reads
    one small tensor back (the 4096 counts and a non-finite flag), the input of the
    dynamic program, which runs on the host. On CUDA that is the one wait of this
    function.

    Raises:
        ValueError: a first gradient holds NaN or infinite values.
    """
    device = _dist.local(members[0][1]).device
    counts = torch.zeros(BINS, dtype=torch.float64, device=device)
    finite = torch.ones((), dtype=torch.bool, device=device)
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
            part, ok = histogram_on_device(g, qblock_for(period), BINS)
            counts += part.to(device)
            finite &= ok.to(device)
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
        local = torch.zeros(BINS, dtype=torch.float64, device=device)
        for g, span, qblock, absmax in parts:
            local += local_histogram(g, span, qblock, absmax, BINS).to(device)
        # Reduced on the parameters' device (NCCL reduces device tensors only).
        counts += _dist.all_reduce(local, "sum", group)
    # One read on the host: the counts and the flag together.
    host = torch.cat([counts, (~finite).to(torch.float64).view(1)]).cpu().numpy()
    if host[BINS] != 0:
        raise ValueError("x holds NaN or infinite values; cannot build a histogram")
    learned = learn_codebook(torch.from_numpy(host[:BINS]), 2**bits)
    codebook = with_exact_zero(learned.to(torch.float32))
    return codebook.to(device)
