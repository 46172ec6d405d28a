"""Measured inputs of the schedule simulator: layer-step times and message costs.

:func:`measure_two_process` trains one stack of blocks (built by the caller's
factory: the axis imports no model) for a few steps on two gloo processes (one thread
each) with :class:`~leantrain.layer_parallel.LayerParallel` and, in the same two
processes, serially on one of them; it also samples the four kinds of
layer step the solver performs (:class:`LayerSampler`) and the cost of a message
(:func:`ping`). Everything is interleaved round by round (a parallel step on both
processes, a serial step on rank 0 while rank 1 waits, layer samples on both), so all of
it sees the same machine load; each time is the median over the rounds after one
warm-up. The result feeds :func:`~.simulate.simulate`, whose prediction of the
two-process step can then be checked against the measured one.

Used by ``leantrain compare depth`` and ``benchmarks/lp_speedup.py``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from leantrain.layer_parallel.costs.launch import run_on_gloo
from leantrain.layer_parallel.costs.simulate import CommModel, LayerTimes, OutsideTimes


class LayerSampler:
    """One sample per call of the four kinds of layer step the solver performs:
    forward without graph, VJP through a stored graph, forward with graph, VJP with
    parameter gradients (the order of :class:`~.simulate.LayerTimes`' fields).

    Each sample is the mean over a sweep of ``sweep`` steps that keeps what a real
    sweep keeps: the recorded graphs stay alive until the backward sweep, and the
    parameter gradients until its end (a final sweep's memory grows layer by layer,
    which costs fresh pages; one step whose graph is freed at once reuses them and
    reads 10-20 % faster on CPU).

    ``clock``: ``time.perf_counter`` (wall, the default) or ``time.thread_time``
    (this thread's CPU time: the work, without the waits a loaded machine adds).
    """

    def __init__(
        self,
        block: nn.Module,
        x: torch.Tensor,
        dt: float,
        clock: Callable[[], float] = time.perf_counter,
        sweep: int = 8,
    ) -> None:
        self.block, self.x, self.dt, self.clock = block, x, dt, clock
        self.sweep = sweep
        self.params = list(block.parameters())
        self.samples: list[tuple[float, float, float, float]] = []

    def __call__(self) -> None:
        block, x, dt, clock, k = self.block, self.x, self.dt, self.clock, self.sweep
        t0 = clock()
        with torch.no_grad():
            for _ in range(k):
                block(x, dt)
        t1 = clock()
        xs = [x.detach().requires_grad_() for _ in range(k)]
        ys = [block(xi, dt) for xi in xs]
        t2 = clock()
        w = torch.ones_like(x)
        for xi, y in zip(reversed(xs), reversed(ys), strict=True):
            torch.autograd.grad(y, xi, w, retain_graph=True)
        t3 = clock()
        kept = [
            torch.autograd.grad(y, [xi, *self.params], w)
            for xi, y in zip(reversed(xs), reversed(ys), strict=True)
        ]
        t4 = clock()
        del kept
        self.samples.append(
            ((t1 - t0) / k, (t3 - t2) / k, (t2 - t1) / k, (t4 - t3) / k)
        )

    def times(self) -> LayerTimes:
        """Median of every kind over the samples taken."""
        f, b, fr, bp = (statistics.median(c) for c in zip(*self.samples, strict=True))
        return LayerTimes(forward=f, backward=b, forward_record=fr, backward_params=bp)


class OutsideSampler:
    """One sample per call of a language model's training-step work outside the
    stack (the fields of :class:`~.simulate.OutsideTimes`): embedding forward +
    backward, head and loss forward, their backward, and AdamW steps over the
    stack's layers (per layer) and over the embedding and head parameters.

    ``model`` has ``embed``, ``stack`` (with ``steps``) and ``head``, as
    :class:`~leantrain.models.GPT` does; it is used only for sampling (AdamW
    changes its weights). ``batch`` is ``(idx, targets)``; ``clock`` as for
    :class:`LayerSampler`; ``loss_fn(logits, targets)`` is the loss timed with the
    head (the caller's, e.g. :func:`~leantrain.models.lm_loss`).
    """

    def __init__(
        self,
        model: nn.Module,
        batch: tuple[torch.Tensor, ...],
        lr: float,
        clock: Callable[[], float] = time.perf_counter,
        *,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> None:
        self.model, (self.idx, self.targets) = model, batch
        self.clock, self.loss_fn = clock, loss_fn
        layers = list(model.stack.parameters())
        ids = {id(p) for p in layers}
        ends = [p for p in model.parameters() if id(p) not in ids]
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        self.n_layers = len(model.stack.steps)
        self.opt_layers = torch.optim.AdamW(layers, lr=lr)
        self.opt_ends = torch.optim.AdamW(ends, lr=lr)
        self.samples: list[tuple[float, float, float, float, float]] = []

    def __call__(self) -> None:
        model, clock = self.model, self.clock
        t0 = clock()
        x = model.embed(self.idx)
        x.backward(torch.ones_like(x))
        t1 = clock()
        h = x.detach().requires_grad_()
        loss = self.loss_fn(model.head(h), self.targets)
        t2 = clock()
        loss.backward()
        t3 = clock()
        self.opt_layers.step()
        t4 = clock()
        self.opt_ends.step()
        t5 = clock()
        self.samples.append(
            (t1 - t0, t2 - t1, t3 - t2, (t4 - t3) / self.n_layers, t5 - t4)
        )

    def times(self) -> OutsideTimes:
        """Median of every kind over the samples taken."""
        return OutsideTimes(
            *(statistics.median(c) for c in zip(*self.samples, strict=True))
        )


def layer_times(block: nn.Module, x: torch.Tensor, dt: float, reps: int) -> LayerTimes:
    """Median seconds of the four kinds of layer step (after one warm-up)."""
    sampler = LayerSampler(block, x, dt)
    for _ in range(reps + 1):
        sampler()
    sampler.samples = sampler.samples[1:]
    return sampler.times()


def ping(peer: int, t: torch.Tensor, first: bool, reps: int) -> float:
    """Seconds of one message of ``t`` to ``peer``: half the median round trip
    (``first``: this rank sends first). Both ranks must call it."""
    import torch.distributed as dist

    def round_trip() -> None:
        if first:
            dist.send(t, peer)
            dist.recv(t, peer)
        else:
            dist.recv(t, peer)
            dist.send(t, peer)

    times = []
    round_trip()
    for _ in range(reps):
        t0 = time.perf_counter()
        round_trip()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / 2


def measure_comm(rank: int, big_numel: int = 1 << 20) -> CommModel:
    """The message-cost model between ranks 0 and 1 of a two-process group: the
    latency from 8-byte ping-pongs, the bandwidth from ``big_numel`` float32s (at
    least 4 MB by default: small messages are all latency). Both ranks call it."""
    latency = ping(1 - rank, torch.zeros(2), rank == 0, 20)
    big = torch.zeros(big_numel)
    big_t = ping(1 - rank, big, rank == 0, 5)
    # A loaded machine can time the small message slower than the big one.
    bandwidth = big.numel() * 4 / max(big_t - latency, big_t / 2)
    return CommModel(latency=latency, bandwidth=bandwidth)


@dataclass(frozen=True)
class StackSpec:
    """The stack and the solver of :func:`measure_two_process`.

    ``n_layers`` blocks (``d_model`` wide, ``n_head`` heads, for the caller's
    factory to build; each step is ``h = 1/N``) on a state of ``batch`` x
    ``tokens`` x ``d_model`` (fp32); MGRIT with ``levels``, ``cf``, ``fwd_iters``
    and ``bwd_iters``; ``repeats`` timed rounds after one warm-up and about
    ``layer_reps`` layer samples in all; ``seed`` for the factory and the input.
    """

    n_layers: int = 64
    d_model: int = 256
    n_head: int = 4
    batch: int = 8
    tokens: int = 64
    levels: int = 2
    cf: int = 4
    fwd_iters: int = 1
    bwd_iters: int = 1
    repeats: int = 5
    layer_reps: int = 7
    seed: int = 0

    @property
    def state_bytes(self) -> int:
        """Bytes of one state, the message between neighbouring ranks."""
        return self.batch * self.tokens * self.d_model * 4


@dataclass(frozen=True)
class TwoProcessTiming:
    """What :func:`measure_two_process` measured (seconds, bytes per second).

    ``parallel``: median layer-parallel step, the slower of the two ranks;
    ``serial``: median serial step on one process; ``layers``: per-layer step times
    measured while both processes were busy; ``comm``: the message-cost model from
    8-byte and (at least) 4 MB ping-pongs.
    """

    parallel: float
    serial: float
    layers: LayerTimes
    comm: CommModel

    @property
    def speedup(self) -> float:
        """Measured serial step / layer-parallel step."""
        return self.serial / self.parallel


def _step(stack: nn.Module, x: torch.Tensor, w: torch.Tensor) -> None:
    xi = x.detach().requires_grad_()
    (stack(xi) * w).sum().backward()
    stack.zero_grad(set_to_none=True)


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


BlockFactory = Callable[[StackSpec], list[nn.Module]]


def _two_process_worker(
    rank: int, spec: StackSpec, make_blocks: BlockFactory
) -> TwoProcessTiming | None:
    import torch.distributed as dist

    from leantrain.layer_parallel.mesh import ParallelDims, parallelize
    from leantrain.layer_parallel.module import LayerParallel

    serial = LayerParallel(make_blocks(spec), cf=spec.cf).serial()
    stack = LayerParallel(
        make_blocks(spec),
        cf=spec.cf,
        levels=spec.levels,
        fwd_iters=spec.fwd_iters,
        bwd_iters=spec.bwd_iters,
    )
    parallelize(stack, ParallelDims(lp=2).build_mesh())
    torch.manual_seed(spec.seed + 1)
    x = torch.randn(spec.batch, spec.tokens, spec.d_model)
    w = torch.randn_like(x)
    own = stack.steps[stack.owned_layers[0]]
    sampler = LayerSampler(own, x, 1 / spec.n_layers)
    par_t, ser_t = [], []
    # Interleaved, so that the serial step, the parallel step and the layer
    # times all see the same (possibly busy) machine; round 0 is a warm-up.
    for _ in range(spec.repeats + 1):
        dist.barrier()
        par_t.append(_timed(lambda: _step(stack, x, w)))
        dist.barrier()
        if rank == 0:  # the other process waits in the barrier (idle)
            ser_t.append(_timed(lambda: _step(serial, x, w)))
        dist.barrier()
        for _ in range(max(1, spec.layer_reps // spec.repeats)):
            sampler()
    par = torch.tensor([statistics.median(par_t[1:])])
    dist.all_reduce(par, op=dist.ReduceOp.MAX)
    comm = measure_comm(rank, max(x.numel(), 1 << 20))
    if rank != 0:
        return None
    sampler.samples = sampler.samples[1:]
    return TwoProcessTiming(
        parallel=par.item(),
        serial=statistics.median(ser_t[1:]),
        layers=sampler.times(),
        comm=comm,
    )


def measure_two_process(
    spec: StackSpec, make_blocks: BlockFactory, timeout: float = 600.0
) -> TwoProcessTiming:
    """Spawn two gloo processes (one thread each) and measure ``spec``'s stack.

    ``make_blocks(spec)`` builds the stack's ``spec.n_layers`` blocks, the same on
    every rank (from ``spec.seed``); it runs in the spawned processes, so it must
    be picklable (a module-level function, e.g.
    :func:`leantrain.compare.depth.gpt_blocks`).

    Raises:
        RuntimeError: if a process fails or nothing arrives within ``timeout`` s.
    """
    if spec.n_layers % (2 * spec.cf ** (spec.levels - 1)):
        raise ValueError(
            f"n_layers={spec.n_layers} must split into 2 chunks of a multiple of "
            f"cf**(levels-1) = {spec.cf ** (spec.levels - 1)} layers"
        )
    return run_on_gloo(_two_process_worker, 2, spec, make_blocks, timeout=timeout)
