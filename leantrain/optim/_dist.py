"""Gefen across ranks: DTensor layouts and the few small collectives Gefen needs.

This is the only module of ``leantrain.optim`` that touches ``torch.distributed``.
Supported parameter layouts:

* plain tensors (single process, DDP, FSDP1 with ``use_orig_params=True`` on an
  unsharded rank view): nothing to communicate, the gradient is already the global
  one;
* DTensors on a 1-D mesh, ``Shard(0)`` (FSDP2 ``fully_shard``) or ``Replicate()``.

For a ``Shard(0)`` parameter a rank holds whole rows ``[r0, r1)`` of the global
tensor, i.e. the element range ``[r0 * d, r1 * d)`` of the flattened tensor (``d``
= elements per row), with the row ranges of ``torch.chunk`` (the rule DTensor and
FSDP2 use). Every rank can compute every rank's range, so the blocks shared between
ranks are known without communication.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from ._dtensor import dtensor_api, is_dtensor, is_sharded, local  # noqa: F401
from ._sharded import Span, block_window, shared_blocks


def all_spans(param: Tensor) -> list[Span]:
    """Element range of every rank of a Shard(0) DTensor (``torch.chunk`` rows)."""
    shape = tuple(param.shape)
    n = math.prod(shape)
    rows = shape[0] if shape else 1
    per_row = n // rows if rows else 0
    world = param.device_mesh.size()
    chunk = -(-rows // world) if rows else 0
    spans = []
    for k in range(world):
        r0, r1 = min(k * chunk, rows), min((k + 1) * chunk, rows)
        spans.append(Span(r0 * per_row, r1 * per_row, n))
    return spans


def my_span(param: Tensor) -> Span:
    """This rank's element range; checked against the DTensor's real local shard."""
    spans = all_spans(param)
    span = spans[param.device_mesh.get_local_rank()]
    if span.stop - span.start != param.to_local().numel():
        raise ValueError(
            f"unexpected Shard(0) layout: local shard of shape "
            f"{tuple(param.to_local().shape)} for global shape {tuple(param.shape)}; "
            f"Gefen expects torch.chunk rows {span}"
        )
    return span


def group_of(param: Tensor):
    """The process group over which ``param`` is sharded."""
    return param.device_mesh.get_group(0)


def all_reduce(t: Tensor, op: str, group) -> Tensor:
    """``all_reduce`` returning the result ("sum", "max" or "min")."""
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    out = t.clone()
    dist.all_reduce(out, op=ops[op], group=group)
    return out


class SharedReduce:
    """Batches the reduction of shared (straddling) blocks of many parameters.

    ``add(values, span, block, shared)`` registers a rank-local per-block array (the
    window of ``span``); ``run(op, group)`` reduces the entries of the shared blocks
    of all registered arrays in one ``all_reduce`` and writes them back in place.
    """

    def __init__(self) -> None:
        self.items: list[tuple[Tensor, int, list[int], int]] = []

    def add(self, values: Tensor, span: Span, block: int, shared: list[int]) -> None:
        b0, b1 = block_window(span, block)
        self.items.append((values, b0, shared, b1))

    def run(self, op: str, group) -> None:
        sizes = [len(shared) for _, _, shared, _ in self.items]
        if not sum(sizes):
            return
        device = self.items[0][0].device
        buf = torch.zeros(sum(sizes), dtype=torch.float32, device=device)
        pos = 0
        for values, b0, shared, b1 in self.items:
            for j, b in enumerate(shared):
                if b0 <= b < b1:
                    buf[pos + j] = values[b - b0]
            pos += len(shared)
        dist.all_reduce(
            buf, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group
        )
        pos = 0
        for values, b0, shared, b1 in self.items:
            for j, b in enumerate(shared):
                if b0 <= b < b1:
                    values[b - b0] = buf[pos + j]
            pos += len(shared)


def shared_for(param: Tensor, block: int) -> list[int]:
    """Blocks of length ``block`` of ``param`` that straddle ranks."""
    return shared_blocks(all_spans(param), block)


def reduce_sum_fn(group):
    """``x -> all_reduce(x, SUM)`` over ``group`` (for ``_reducible_partition``)."""
    return lambda x: all_reduce(x, "sum", group)
