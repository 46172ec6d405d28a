r"""Schedule simulator: the critical-path time of one layer-parallel training step.

The simulator runs the real solver, :func:`~leantrain.layer_parallel.mgrit_solve`, on a
stand-in problem whose "layers" only advance clocks: one clock per chunk (rank), a step
into point ``j`` of level ``l`` adds that step's time to the clock of the chunk owning
``j``, and a :class:`~leantrain.layer_parallel.layout.Exchange` moves clocks the way
messages move them:

* ``shift``: chunk ``p`` may continue at ``max(own clock, clock of p-1 + message)``;
* ``relay`` (coarsest level): chunk after chunk, each waiting for its left
  neighbour's last point plus one message;
* ``allreduce_sum`` (residual norm): everyone waits for the slowest, plus the
  reduction time.

So the schedule simulated is exactly the one the distributed code executes, for any
``N``, ``P``, levels, ``cf``, iterations and relaxation. With unit layer times and no
communication it reproduces the cost model :func:`~.cycle_work.solve_time` (tested).

Communication model (:class:`CommModel`): a message of ``b`` bytes costs
``latency + b / bandwidth``; an all-reduce or broadcast over ``P`` ranks costs
``ceil(log2 P)`` messages (a tree; the all-reduce twice that). Per training step the
distributed module also broadcasts the batch seed (8 bytes), the output (last rank to
all) and the input gradient (first rank to all).

Step costs (:class:`LayerTimes`, seconds per layer step): forward without graph
(relaxation and coarse levels), forward with graph (final sweep), adjoint VJP through
a stored graph (level 0), VJP including parameter gradients (final adjoint sweep); a
coarse adjoint step recomputes the layer with a graph and then applies its VJP. The
serial reference step is ``N`` (forward with graph + VJP with parameters).

``forward_solver="serial"`` (the serial-forward / MGRIT-adjoint mode) replaces the
forward solve by the exact serial relay the distributed module runs: chunk after chunk,
each recording its ``N/P`` layers (``forward_record``) once its left neighbour's last
point has arrived, so the forward costs ``N * forward_record + (P - 1)`` messages plus
the output broadcast; the adjoint is the same MGRIT solve as in the default mode.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from leantrain.layer_parallel._checks import check_float, check_int
from leantrain.layer_parallel.layout import ChunkLayout, Exchange
from leantrain.layer_parallel.mgrit import MGRITOptions, mgrit_solve, sequential_solve
from leantrain.layer_parallel.module import FORWARD_SOLVERS
from leantrain.layer_parallel.ode import State


@dataclass(frozen=True)
class LayerTimes:
    """Seconds per layer step (validated; ``None`` copies the simpler cost).

    Args:
        forward: forward step without autograd graph.
        backward: vector-Jacobian product w.r.t. the input through a stored graph.
        forward_record: forward step recording the graph (default ``forward``).
        backward_params: VJP w.r.t. input and parameters (default ``backward``).
    """

    forward: float
    backward: float
    forward_record: float | None = None
    backward_params: float | None = None

    def __post_init__(self) -> None:
        for name in ("forward", "backward", "forward_record", "backward_params"):
            value = getattr(self, name)
            if value is not None:
                check_float(f"LayerTimes.{name}", value, positive=False)
        if self.forward_record is None:
            object.__setattr__(self, "forward_record", float(self.forward))
        if self.backward_params is None:
            object.__setattr__(self, "backward_params", float(self.backward))

    @property
    def serial_step(self) -> float:
        """One layer of plain autograd training: forward with graph + full VJP."""
        return self.forward_record + self.backward_params


@dataclass(frozen=True)
class OutsideTimes:
    """Seconds of a training step's work outside the stack (validated).

    Every rank of a layer-parallel step embeds the batch, runs the head and the loss
    (the stack's output is broadcast to all) and steps its optimizer over its own
    layers plus the embedding and head parameters; a serial step does the same with
    all ``N`` layers; a pipeline's first stage embeds, its last runs the head.

    Args:
        embed: embedding forward + backward.
        head_forward: final norm, head and loss forward.
        head_backward: their backward.
        optimizer_layer: optimizer step over one layer's parameters.
        optimizer_ends: optimizer step over the embedding and head parameters.

    Example:
        >>> OutsideTimes(1.0, 2.0, 3.0, 0.5, 0.25).step(4)
        8.25
    """

    embed: float = 0.0
    head_forward: float = 0.0
    head_backward: float = 0.0
    optimizer_layer: float = 0.0
    optimizer_ends: float = 0.0

    def __post_init__(self) -> None:
        for name in (
            "embed",
            "head_forward",
            "head_backward",
            "optimizer_layer",
            "optimizer_ends",
        ):
            check_float(f"OutsideTimes.{name}", getattr(self, name), positive=False)

    def step(self, layers: int) -> float:
        """A rank's outside work when it steps ``layers`` layers' parameters."""
        return (
            self.embed
            + self.head_forward
            + self.head_backward
            + self.optimizer_ends
            + layers * self.optimizer_layer
        )


@dataclass(frozen=True)
class CommModel:
    """``latency + bytes / bandwidth`` per message (seconds, bytes per second).

    Example:
        >>> CommModel(latency=1e-5, bandwidth=1e9).message(1e6)
        0.00101
    """

    latency: float = 0.0
    bandwidth: float = math.inf

    def __post_init__(self) -> None:
        check_float("latency", self.latency, positive=False)
        if not (isinstance(self.bandwidth, int | float) and self.bandwidth > 0):
            raise ValueError(f"bandwidth must be > 0 bytes/s, got {self.bandwidth!r}")

    def message(self, nbytes: float) -> float:
        """One point-to-point message of ``nbytes``."""
        return self.latency + nbytes / self.bandwidth

    def broadcast(self, nbytes: float, ranks: int) -> float:
        """A tree broadcast over ``ranks``."""
        return math.ceil(math.log2(ranks)) * self.message(nbytes) if ranks > 1 else 0.0

    def allreduce(self, nbytes: float, ranks: int) -> float:
        """A reduce plus broadcast tree over ``ranks``."""
        return 2 * self.broadcast(nbytes, ranks)


@dataclass(frozen=True)
class SimResult:
    """Simulated times of one training step (seconds, or layer steps).

    Attributes:
        forward: critical path of the forward solve, output broadcast included.
        backward: critical path of the adjoint solve, gradient broadcast included.
        step: ``forward + backward`` (plus the seed broadcast and the work
            outside the stack).
        serial: the one-process serial step, ``N * LayerTimes.serial_step`` (plus
            the work outside the stack for ``N`` layers).
        speedup: ``serial / step``.
    """

    forward: float
    backward: float
    step: float
    serial: float

    @property
    def speedup(self) -> float:
        return self.serial / self.step if self.step > 0 else math.inf


class _ClockExchange(Exchange):
    """All chunks in one process, each with a clock that messages synchronise."""

    def __init__(self, chunks: int, comm: CommModel, state_bytes: float) -> None:
        self.local_chunks = list(range(chunks))
        self.clock = [0.0] * chunks
        self.msg = comm.message(state_bytes) if chunks > 1 else 0.0
        self.reduce = comm.allreduce(8, chunks)

    def shift(self, lasts: Sequence[State], first: State) -> list[State]:
        sent = list(self.clock)  # each chunk's last point is ready at its clock
        for p in range(1, len(sent)):
            self.clock[p] = max(self.clock[p], sent[p - 1] + self.msg)
        return [first, *lasts[:-1]]

    def relay(self, fn: Callable[[int, State], State], first: State) -> None:
        ghost = first
        for p in self.local_chunks:
            if p:
                self.clock[p] = max(self.clock[p], self.clock[p - 1] + self.msg)
            ghost = fn(p, ghost)

    def allreduce_sum(self, value: float) -> float:
        t = max(self.clock) + self.reduce
        self.clock = [t] * len(self.clock)
        return value


def _solve_clock(
    layout: ChunkLayout,
    options: MGRITOptions,
    cost: Callable[[int, bool], float],
    comm: CommModel,
    state_bytes: float,
    *,
    serial: bool = False,
) -> float:
    ex = _ClockExchange(layout.chunks, comm, state_bytes)
    gen = torch.Generator().manual_seed(0)

    def prop(level: int, j: int, u: State, *, final: bool = False) -> State:
        owner = (j - 1) // layout.per_chunk(level)
        ex.clock[owner] += cost(level, final)
        # Random stand-in states: residuals never vanish, so no early stop.
        return torch.rand(1, generator=gen, dtype=torch.float64)

    u0 = torch.zeros(1, dtype=torch.float64)
    if serial:  # the exact forward: every layer once, recorded, chunk after chunk
        sequential_solve(prop, u0, layout, exchange=ex)
    else:
        mgrit_solve(prop, u0, layout, options, exchange=ex)
    return max(ex.clock)


def simulate(
    n_steps: int,
    chunks: int,
    times: LayerTimes,
    *,
    levels: int = 2,
    cf: int = 4,
    fwd_iters: int = 2,
    bwd_iters: int = 1,
    relax: int | Sequence[int] = 1,
    skip_downcycle: bool = True,
    comm: CommModel | None = None,
    state_bytes: float = 0.0,
    forward_solver: str = "mgrit",
    outside: OutsideTimes | None = None,
) -> SimResult:
    """Critical-path time of one training step on ``chunks`` ranks.

    Args:
        n_steps: ODE layers ``N``.
        chunks: ranks ``P``; ``N/P`` must be a multiple of ``cf**(levels-1)``.
        times: per-layer step times.
        levels, cf, fwd_iters, bwd_iters, relax, skip_downcycle: MGRIT options, as in
            :class:`~leantrain.layer_parallel.module.LayerParallel`.
        comm: the communication model (default: free).
        state_bytes: bytes of one state (batch x tokens x d_model x element size).
        forward_solver: ``"mgrit"`` or ``"serial"`` (exact serial forward relayed
            rank to rank, MGRIT adjoint), as in
            :class:`~leantrain.layer_parallel.module.LayerParallel`.
        outside: the work outside the stack (default: none); every rank does it
            for its ``N/P`` layers, the serial step for all ``N``.

    Returns:
        A :class:`SimResult`.

    Raises:
        ValueError: for an invalid layout or options.

    Example:
        >>> r = simulate(64, 4, LayerTimes(1.0, 1.0), cf=4, fwd_iters=1)
        >>> round(r.speedup, 2)
        1.6
    """
    check_int("n_steps", n_steps, 1)
    check_float("state_bytes", state_bytes, positive=False)
    if forward_solver not in FORWARD_SOLVERS:
        raise ValueError(
            f"forward_solver must be one of {FORWARD_SOLVERS}, got {forward_solver!r}"
        )
    comm = comm if comm is not None else CommModel()
    layout = ChunkLayout(n_steps, chunks, cf, levels)
    relax = tuple(relax) if not isinstance(relax, int) else relax
    fwd_opts = MGRITOptions(levels, cf, fwd_iters, relax, skip_downcycle)
    bwd_opts = MGRITOptions(levels, cf, bwd_iters, relax, skip_downcycle)

    def fwd_cost(level: int, final: bool) -> float:
        return times.forward_record if final else times.forward

    def bwd_cost(level: int, final: bool) -> float:
        if level:  # recompute the coarse layer with a graph, then its VJP
            return times.forward_record + times.backward
        return times.backward_params if final else times.backward

    bcast = comm.broadcast(state_bytes, chunks)
    serial = forward_solver == "serial"
    forward = _solve_clock(layout, fwd_opts, fwd_cost, comm, state_bytes, serial=serial)
    forward += bcast
    backward = _solve_clock(layout, bwd_opts, bwd_cost, comm, state_bytes) + bcast
    step = forward + backward + comm.broadcast(8, chunks)
    serial_step = n_steps * times.serial_step
    if outside is not None:
        step += outside.step(layout.per_chunk(0))
        serial_step += outside.step(n_steps)
    return SimResult(forward, backward, step, serial_step)
