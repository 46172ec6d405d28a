"""Where a layer-parallel training step's time goes, phase by phase.

:class:`PhaseTimer` keeps *exclusive* wall-clock and thread-CPU seconds per named
phase: entering a phase pauses the one it is nested in, so the phases add up to the
time measured around the outermost one. Wall time minus thread-CPU time is time the
thread did not run: a blocking wait for a message, or the machine's other work.

:func:`profile_phases` attributes a :class:`~leantrain.layer_parallel.LayerParallel`
stack's work to phases while it is active:

* every layer step the solvers take, by kind: the forward's relaxation
  (``fwd relax``, level 0), coarse steps (``fwd coarse``, levels >= 1), recorded
  final sweep (``fwd final``); the adjoint's VJPs through stored graphs
  (``adj relax``), coarse steps (``adj coarse``: the layer recomputed with a graph,
  then its VJP) and final sweep with parameter gradients (``adj final``);
* every exchange between ranks (``msg shift``, ``msg relay``, ``msg allreduce``,
  ``msg broadcast``), their waits included;
* the solver's own work between those (``fwd solver``, ``adj solver``: residual
  norms, corrections, bookkeeping, Python);
* and, when the caller times the whole step inside ``timer.phase("outside")``,
  everything else in the step: embedding, head, loss, optimizer (``outside``).

``calls`` counts the layer steps of each kind, which are exactly the steps the
schedule simulator (:func:`~.simulate.simulate`) charges one
:class:`~.simulate.LayerTimes` field for, so measured and charged time can be
compared kind by kind (:func:`charged`).

Example:
    >>> import torch
    >>> from leantrain.layer_parallel import LayerParallel
    >>> from leantrain.models.blocks import TransformerBlock
    >>> stack = LayerParallel([TransformerBlock(8, 2) for _ in range(8)], cf=2)
    >>> x = torch.randn(2, 4, 8, requires_grad=True)
    >>> with profile_phases(stack) as timer, timer.phase("outside"):
    ...     stack(x).sum().backward()
    >>> timer.calls["fwd final"], timer.calls["adj final"]
    (8, 8)
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping

from leantrain.layer_parallel.adjoint import AdjointPropagator
from leantrain.layer_parallel.costs.simulate import LayerTimes
from leantrain.layer_parallel.ode import StepPropagator

#: The layer-step phases and the LayerTimes field the simulator charges for each.
STEP_PHASES = {
    "fwd relax": "forward",
    "fwd coarse": "forward",
    "fwd final": "forward_record",
    "adj relax": "backward",
    "adj coarse": ("forward_record", "backward"),
    "adj final": "backward_params",
}


class PhaseTimer:
    """Exclusive wall and thread-CPU seconds, and entry counts, per phase."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[str] = []
        self._mark = (0.0, 0.0)

    def _charge(self) -> None:
        now = (time.perf_counter(), time.thread_time())
        if self._stack:
            top = self._stack[-1]
            self.wall[top] += now[0] - self._mark[0]
            self.cpu[top] += now[1] - self._mark[1]
        self._mark = now

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time spent inside (and not in a nested phase) goes to ``name``."""
        self._charge()
        self._stack.append(name)
        self.calls[name] += 1
        try:
            yield
        finally:
            self._charge()
            self._stack.pop()

    def wrap(self, name: str, fn: Callable) -> Callable:
        """``fn`` whose calls are timed as phase ``name``."""

        def timed(*args, **kwargs):
            with self.phase(name):
                return fn(*args, **kwargs)

        return timed

    def reset(self) -> None:
        """Forget everything measured (between a warm-up and the timed steps)."""
        self.wall.clear()
        self.cpu.clear()
        self.calls.clear()

    @property
    def total_wall(self) -> float:
        return sum(self.wall.values())

    def table(
        self,
        steps: int = 1,
        charged: Mapping[str, float] | None = None,
        charged_cpu: Mapping[str, float] | None = None,
    ) -> str:
        """Markdown table of ms per step: wall and thread CPU, and what the
        simulator charges (``charged``, from wall-clock layer times, and
        ``charged_cpu``, from thread-CPU ones) for the phases it charges."""
        lines = [
            "| phase | calls | wall ms | CPU ms | simulator ms | simulator CPU ms |",
            "|---|---|---|---|---|---|",
        ]

        def ms(table, name):
            value = (table or {}).get(name)
            return "" if value is None else f"{value / steps * 1e3:.1f}"

        for name in sorted(self.wall, key=lambda k: -self.wall[k]):
            lines.append(
                f"| {name} | {self.calls[name] / steps:g} | "
                f"{self.wall[name] / steps * 1e3:.1f} | "
                f"{self.cpu[name] / steps * 1e3:.1f} | "
                f"{ms(charged, name)} | {ms(charged_cpu, name)} |"
            )
        total = {"total": sum((charged or {}).values())}
        total_cpu = {"total": sum((charged_cpu or {}).values())}
        lines.append(
            f"| total | | {self.total_wall / steps * 1e3:.1f} | "
            f"{sum(self.cpu.values()) / steps * 1e3:.1f} | "
            f"{ms(charged and total, 'total')} | "
            f"{ms(charged_cpu and total_cpu, 'total')} |"
        )
        return "\n".join(lines)


def charged(calls: Mapping[str, int], times: LayerTimes) -> dict[str, float]:
    """Seconds the simulator charges for ``calls`` layer steps of each kind."""
    out = {}
    for name, fields in STEP_PHASES.items():
        fields = (fields,) if isinstance(fields, str) else fields
        out[name] = calls.get(name, 0) * sum(getattr(times, f) for f in fields)
    return out


def _step_phase(direction: str, level: int, final: bool) -> str:
    kind = "final" if final and level == 0 else "coarse" if level else "relax"
    return f"{direction} {kind}"


class _TimedExchange:
    """An exchange whose calls are timed; the coarse relay's own work is not."""

    def __init__(self, inner, timer: PhaseTimer) -> None:
        self._inner, self._timer = inner, timer

    def __getattr__(self, name: str):
        attr = getattr(self._inner, name)
        if name in ("shift", "allreduce_sum"):
            return self._timer.wrap(f"msg {name.removesuffix('_sum')}", attr)
        if name in ("broadcast", "broadcast_int"):
            return self._timer.wrap("msg broadcast", attr)
        if name == "relay":

            def relay(fn, first):
                # the chunk's coarse solve inside is charged to its own phases
                outer = self._timer._stack[-1] if self._timer._stack else "outside"
                with self._timer.phase("msg relay"):
                    attr(self._timer.wrap(outer, fn), first)

            return relay
        return attr


@contextlib.contextmanager
def profile_phases(stack, timer: PhaseTimer | None = None) -> Iterator[PhaseTimer]:
    """Attribute ``stack``'s (a :class:`~leantrain.layer_parallel.LayerParallel`)
    time to phases.

    While active, every :class:`~leantrain.layer_parallel.ode.StepPropagator` and
    :class:`~leantrain.layer_parallel.adjoint.AdjointPropagator` call in this process is
    timed (the classes are patched and restored on exit), and ``stack``'s solves and
    exchanges are wrapped. Time the whole training step in ``timer.phase("outside")`` to
    get the work outside the stack.
    """
    timer = timer if timer is not None else PhaseTimer()
    fwd_call, adj_call = StepPropagator.__call__, AdjointPropagator.__call__

    def fwd(self, level, j, u, *, final=False):
        with timer.phase(_step_phase("fwd", level, final and self.record)):
            return fwd_call(self, level, j, u, final=final)

    def adj(self, level, m, w, *, final=False):
        with timer.phase(_step_phase("adj", level, final)):
            return adj_call(self, level, m, w, final=final)

    saved = stack._exchanges
    StepPropagator.__call__, AdjointPropagator.__call__ = fwd, adj
    wrapped = {"_solve_forward": "fwd solver", "_solve_adjoint": "adj solver"}
    if saved is not None:  # distributed: the output is broadcast from the last rank
        wrapped["_output"] = "msg broadcast"
        stack._exchanges = tuple(_TimedExchange(ex, timer) for ex in saved)
    for name, phase in wrapped.items():
        setattr(stack, name, timer.wrap(phase, getattr(stack, name)))
    try:
        yield timer
    finally:
        StepPropagator.__call__, AdjointPropagator.__call__ = fwd_call, adj_call
        for name in wrapped:
            del stack.__dict__[name]
        stack._exchanges = saved
