r"""Pipeline-parallel cost model: GPipe and 1F1B step time, memory and messages.

The counterpart of :func:`~.simulate.simulate` for pipeline parallelism, fed with the
same inputs (:class:`~.simulate.LayerTimes`, :class:`~.simulate.CommModel`, the state
size). Rank ``p`` of ``P`` owns ``N/P`` layers; the batch is cut into ``M``
micro-batches. One forward of a micro-batch through a stage costs
``F = N/P * forward_record`` (the graph is kept for the backward), one backward
``B = N/P * backward_params``, where the layer times are those of **one micro-batch**.

Each rank executes its actions in the fixed order of ``torch.distributed.pipelining``
(:func:`stage_order`):

* GPipe: ``F0 .. F(M-1)``, then ``B0 .. B(M-1)``;
* 1F1B: ``min(M, P - p)`` warm-up forwards, then alternately one backward and one
  forward, then the remaining backwards (needs ``M >= P``).

An action starts when its rank is free and its input has arrived: ``F(p, m)`` needs
``F(p-1, m)`` plus one message of the micro-batch's state, ``B(p, m)`` needs
``B(p+1, m)`` plus one message of its gradient. :func:`simulate_pipeline` computes the
resulting critical path exactly (longest path through the schedule's dependency
graph). With equal stages and free messages both schedules take

.. math::  T = (M + P - 1)(F + B),

so the idle fraction of each rank, the *bubble*, is ``(P - 1) / (M + P - 1)``
(:func:`bubble_fraction`); with a message cost ``c`` GPipe adds ``2 (P - 1) c``
(:func:`gpipe_time`). The work outside the stack (:class:`~.simulate.OutsideTimes`,
per micro-batch) goes where the pipeline runs it: the embedding into the first
stage's forwards, the head and loss into the last stage's forwards and backwards,
and after the schedule each rank's optimizer step over its own layers (the first and
last ranks also over the embedding and head parameters). The schedules differ in
memory: a GPipe rank holds the activations of all ``M`` micro-batches at its peak,
a 1F1B rank ``min(M, P - p)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from leantrain.layer_parallel._checks import check_float, check_int
from leantrain.layer_parallel.costs.simulate import CommModel, LayerTimes, OutsideTimes

SCHEDULES = ("gpipe", "1f1b")

Action = tuple[str, int]  # ("F" or "B", micro-batch)


def _check(stages: int, micro_batches: int, schedule: str) -> None:
    check_int("stages", stages, 1)
    check_int("micro_batches", micro_batches, 1)
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if schedule == "1f1b" and micro_batches < stages:
        raise ValueError(
            f"schedule '1f1b' needs micro_batches >= stages, got micro_batches="
            f"{micro_batches} for {stages} stages"
        )


def stage_order(schedule: str, stages: int, micro_batches: int) -> list[list[Action]]:
    """The order in which each rank runs its forwards and backwards.

    Example:
        >>> stage_order("1f1b", 2, 3)[0]
        [('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('B', 2)]
    """
    _check(stages, micro_batches, schedule)
    m = micro_batches
    if schedule == "gpipe":
        return [[("F", i) for i in range(m)] + [("B", i) for i in range(m)]] * stages
    orders = []
    for p in range(stages):
        warm = min(m, stages - p)
        order: list[Action] = [("F", i) for i in range(warm)]
        for i in range(m - warm):  # steady state: one backward, one forward
            order += [("B", i), ("F", warm + i)]
        order += [("B", i) for i in range(m - warm, m)]
        orders.append(order)
    return orders


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """Idle fraction ``(P - 1) / (M + P - 1)`` of a rank in GPipe or 1F1B."""
    check_int("stages", stages, 1)
    check_int("micro_batches", micro_batches, 1)
    return (stages - 1) / (micro_batches + stages - 1)


def gpipe_time(
    stages: int, micro_batches: int, fwd: float, bwd: float, msg: float = 0.0
) -> float:
    """Closed-form GPipe step with equal stages: ``(M+P-1)(F+B) + 2(P-1) c``."""
    return (micro_batches + stages - 1) * (fwd + bwd) + 2 * (stages - 1) * msg


def critical_path(
    orders: list[list[Action]],
    fwd: list[float],
    bwd: list[float],
    msg: float,
) -> tuple[float, list[dict[Action, float]]]:
    """Finish time of a fixed-order schedule and every action's finish time.

    Args:
        orders: per rank, its actions in execution order (:func:`stage_order`).
        fwd, bwd: per rank, the time of one forward / backward of a micro-batch.
        msg: time of one activation or gradient message between neighbours.

    Returns:
        ``(makespan, finish)`` with ``finish[p][action]`` in seconds.
    """
    stages = len(orders)
    finish: list[dict[Action, float]] = [{} for _ in range(stages)]
    free = [0.0] * stages
    nxt = [0] * stages
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for p in range(stages):
            while nxt[p] < len(orders[p]):
                kind, m = orders[p][nxt[p]]
                dep = (p - 1) if kind == "F" else (p + 1)
                ready = 0.0
                if 0 <= dep < stages:
                    if (kind, m) not in finish[dep]:
                        break  # its input is not computed yet: try another rank
                    ready = finish[dep][(kind, m)] + msg
                start = max(free[p], ready)
                free[p] = start + (fwd[p] if kind == "F" else bwd[p])
                finish[p][(kind, m)] = free[p]
                nxt[p] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("the schedule deadlocks: no rank can proceed")
    return max(free), finish


def peak_in_flight(order: list[Action]) -> int:
    """Most micro-batches whose forward ran and whose backward has not."""
    held = peak = 0
    for kind, _ in order:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


@dataclass(frozen=True)
class PipelineResult:
    """One simulated pipeline training step.

    Attributes:
        step: critical-path time of the step (seconds).
        serial: the one-process step ``N * serial_times.serial_step``.
        bubble: idle fraction of the busiest rank, ``1 - busy / step``.
        in_flight: per rank, peak micro-batches of activations held.
        activation_bytes: per rank, ``in_flight * N/P * layer_activation_bytes``.
        message_bytes: per rank, bytes sent per step (activations and gradients).
    """

    step: float
    serial: float
    bubble: float
    in_flight: tuple[int, ...]
    activation_bytes: tuple[float, ...]
    message_bytes: tuple[float, ...]

    @property
    def speedup(self) -> float:
        return self.serial / self.step if self.step > 0 else math.inf


def simulate_pipeline(
    n_layers: int,
    stages: int,
    micro_batches: int,
    times: LayerTimes,
    *,
    schedule: str = "1f1b",
    comm: CommModel | None = None,
    state_bytes: float = 0.0,
    layer_activation_bytes: float = 0.0,
    serial_times: LayerTimes | None = None,
    outside: OutsideTimes | None = None,
    serial_outside: OutsideTimes | None = None,
) -> PipelineResult:
    """Step time, memory and traffic of a pipeline-parallel training step.

    Args:
        n_layers: layers ``N`` (``stages`` must divide it).
        stages: ranks ``P``, one stage each.
        micro_batches: ``M``.
        times: layer times of **one micro-batch** (forward with graph and backward
            with parameter gradients are used).
        schedule: ``"gpipe"`` or ``"1f1b"``.
        comm: the communication model (default: free).
        state_bytes: bytes of one micro-batch's state (one message).
        layer_activation_bytes: bytes one layer keeps for its backward, per
            micro-batch.
        serial_times: layer times of the whole batch for the serial reference
            (default: ``M`` times ``times``, i.e. time linear in the batch).
        outside: the work outside the stack, embedding and head times of **one
            micro-batch** (default: none).
        serial_outside: the same for the whole batch, for the serial reference
            (default: ``outside`` with ``M`` times its embedding and head times).

    Raises:
        ValueError: for an invalid layout or schedule.

    Example:
        >>> r = simulate_pipeline(8, 2, 4, LayerTimes(1.0, 2.0), schedule="gpipe")
        >>> r.step, round(r.bubble, 2)
        (60.0, 0.2)
    """
    check_int("n_layers", n_layers, 1)
    _check(stages, micro_batches, schedule)
    if n_layers % stages:
        raise ValueError(
            f"n_layers={n_layers} is not divisible by the {stages} pipeline stages"
        )
    check_float("state_bytes", state_bytes, positive=False)
    check_float("layer_activation_bytes", layer_activation_bytes, positive=False)
    comm = comm if comm is not None else CommModel()
    per = n_layers // stages
    fwd, bwd = per * times.forward_record, per * times.backward_params
    msg = comm.message(state_bytes) if stages > 1 else 0.0
    orders = stage_order(schedule, stages, micro_batches)
    fwds, bwds, optimizer = [fwd] * stages, [bwd] * stages, [0.0] * stages
    if outside is not None:
        fwds[0] += outside.embed
        fwds[-1] += outside.head_forward
        bwds[-1] += outside.head_backward
        for p in range(stages):
            ends = outside.optimizer_ends if p in (0, stages - 1) else 0.0
            optimizer[p] = per * outside.optimizer_layer + ends
    step, finish = critical_path(orders, fwds, bwds, msg)
    # each rank steps its optimizer once its own last action is done
    step = max(step, *(max(finish[p].values()) + optimizer[p] for p in range(stages)))
    busy = micro_batches * (fwd + bwd)
    in_flight = tuple(peak_in_flight(o) for o in orders)
    sent = [
        micro_batches * state_bytes * ((p < stages - 1) + (p > 0))
        for p in range(stages)
    ]
    if serial_times is None:
        serial = n_layers * micro_batches * times.serial_step
    else:
        serial = n_layers * serial_times.serial_step
    if serial_outside is None and outside is not None:
        m = micro_batches
        serial_outside = OutsideTimes(
            m * outside.embed,
            m * outside.head_forward,
            m * outside.head_backward,
            outside.optimizer_layer,
            outside.optimizer_ends,
        )
    if serial_outside is not None:
        serial += serial_outside.step(n_layers)
    return PipelineResult(
        step=step,
        serial=serial,
        bubble=1 - busy / step if step > 0 else 0.0,
        in_flight=in_flight,
        activation_bytes=tuple(k * per * layer_activation_bytes for k in in_flight),
        message_bytes=tuple(sent),
    )
