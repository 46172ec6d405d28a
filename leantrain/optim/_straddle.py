"""Gefen under FSDP2 when blocks straddle ranks: the layout and the two-phase step.

A ``Shard(0)`` parameter whose local shard does not hold a whole number of blocks
shares the second moment (and the momentum's absmax) of its edge blocks with the
neighbouring rank. Its step is split around the exchange (``_sharded.begin_step``,
one SUM and one MAX all_reduce for every such parameter, then
``_sharded.finish_step``); everything else steps as in a single process.
"""

from __future__ import annotations

from torch import Tensor

from . import _dist
from ._options import options_of
from ._sharded import begin_step, finish_step


def straddle_layout(state: dict, param: Tensor, cache: dict) -> tuple | None:
    """(span, shared second-moment blocks, shared momentum blocks) of a sharded
    parameter with blocks straddling ranks; None when its local shard is a whole
    number of blocks (then the local step is the single-process one). ``cache``
    keeps the answer per parameter until its period changes."""
    if not _dist.is_sharded(param):
        return None
    period = int(state["period"])
    if param not in cache or cache[param][0] != period:
        qblock = int(state["qblock"]) if "qblock" in state else period
        shared_v = _dist.shared_for(param, period)
        shared_q = _dist.shared_for(param, qblock) if "qblock" in state else []
        span = _dist.my_span(param)
        layout = (span, shared_v, shared_q) if shared_v or shared_q else None
        cache[param] = (period, layout)
    return cache[param][1]


def straddling_step(states: dict, items: list[tuple[dict, Tensor, tuple]]) -> None:
    """Steps sharded parameters whose blocks straddle ranks (``items``: group,
    parameter, its ``straddle_layout``, its rounding seed): local halves around one
    SUM and one MAX all_reduce for all of them together. ``states``: the
    optimizer's state."""
    sums, maxes, begun = _dist.SharedReduce(), _dist.SharedReduce(), []
    for group, param, (span, shared_v, shared_q), _ in items:
        state = states[param]
        g, sq, m, amax = begin_step(
            param.grad.to_local(),
            state,
            span,
            beta1=float(group["betas"][0]),
            maximize=group["maximize"],
        )
        sums.add(sq, span, int(state["period"]), shared_v)
        if amax is not None:
            maxes.add(amax, span, int(state["qblock"]), shared_q)
        begun.append((g, sq, m, amax))
    process_group = _dist.group_of(items[0][1])
    sums.run("sum", process_group)
    maxes.run("max", process_group)
    for (group, param, (span, _, _), seed), (g, sq, m, amax) in zip(
        items, begun, strict=True
    ):
        finish_step(
            param.to_local(),
            states[param],
            span,
            g,
            sq,
            m,
            amax,
            options_of(group, states[param]),
            seed=seed,
        )
