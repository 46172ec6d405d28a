"""Layer-parallel MGRIT against the best pipeline schedule, projected over ranks and
depth from measured layer times.

For every depth ``N`` and rank count ``P`` the projection takes the fastest valid
MGRIT setting (:func:`~.simulate.simulate`) and the fastest pipeline (GPipe or 1F1B,
over the micro-batch counts whose layer times were measured,
:func:`~.simulate_pipeline.simulate_pipeline`), with the same communication model
and the same per-layer times. A pipeline needs ``P <= N`` and ``P | N``; MGRIT
needs ``N/P`` to be a multiple of ``cf**(levels-1)``; cells where either cannot run
are left out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from leantrain.layer_parallel.simulate import CommModel, LayerTimes, simulate
from leantrain.layer_parallel.simulate_pipeline import simulate_pipeline


@dataclass(frozen=True)
class MGRITSetting:
    """One MGRIT configuration; ``fwd_iters=0`` means an exact serial forward
    (``forward_solver="serial"``), whose time is the rank-to-rank pipeline of ``N``
    recorded forward steps."""

    levels: int = 2
    cf: int = 4
    fwd_iters: int = 1
    bwd_iters: int = 1

    @property
    def label(self) -> str:
        fwd = "serial" if self.fwd_iters == 0 else f"{self.fwd_iters}"
        return f"L{self.levels} cf{self.cf} fwd {fwd} bwd {self.bwd_iters}"

    def valid(self, n_layers: int, ranks: int) -> bool:
        """Whether ``N/P`` is a whole multiple of ``cf**(levels-1)``."""
        return (
            n_layers % ranks == 0
            and (n_layers // ranks) % (self.cf ** (self.levels - 1)) == 0
        )

    def step(
        self,
        n_layers: int,
        ranks: int,
        times: LayerTimes,
        comm: CommModel,
        state_bytes: float,
    ) -> float:
        """Simulated seconds of one training step on ``ranks``."""
        fwd = max(self.fwd_iters, 1)
        r = simulate(
            n_layers,
            ranks,
            times,
            levels=self.levels,
            cf=self.cf,
            fwd_iters=fwd,
            bwd_iters=self.bwd_iters,
            comm=comm,
            state_bytes=state_bytes,
        )
        if self.fwd_iters:
            return r.step
        # exact forward: N recorded steps, one message per rank boundary
        serial_fwd = n_layers * times.forward_record + (ranks - 1) * comm.message(
            state_bytes
        )
        return r.step - r.forward + serial_fwd + comm.broadcast(state_bytes, ranks)


@dataclass(frozen=True)
class Cell:
    """The projected step of one (depth, ranks) pair, seconds."""

    depth: int
    ranks: int
    serial: float
    pipeline: float | None
    pipeline_label: str
    mgrit: float | None
    mgrit_label: str

    @property
    def lp_wins(self) -> bool:
        return (
            self.mgrit is not None
            and self.pipeline is not None
            and self.mgrit < self.pipeline
        )


def best_pipeline(
    n_layers: int,
    ranks: int,
    times_by_mb: Mapping[int, LayerTimes],
    full: LayerTimes,
    comm: CommModel,
    state_bytes: float,
) -> tuple[float, str] | None:
    """Fastest GPipe / 1F1B step over the measured micro-batch counts, or None.

    Args:
        times_by_mb: layer times of one micro-batch, keyed by the micro-batch count.
        full: layer times of the whole batch (the serial reference).
        state_bytes: bytes of the whole batch's state (a micro-batch sends 1/M).
    """
    if n_layers % ranks:
        return None
    best: tuple[float, str] | None = None
    for m, times in sorted(times_by_mb.items()):
        for schedule in ("gpipe", "1f1b"):
            if schedule == "1f1b" and m < ranks:
                continue
            r = simulate_pipeline(
                n_layers,
                ranks,
                m,
                times,
                schedule=schedule,
                comm=comm,
                state_bytes=state_bytes / m,
                serial_times=full,
            )
            if best is None or r.step < best[0]:
                best = (r.step, f"{schedule} M={m}")
    return best


def project(
    depths: Sequence[int],
    ranks: Sequence[int],
    times_by_mb: Mapping[int, LayerTimes],
    settings: Sequence[MGRITSetting],
    comm: CommModel,
    state_bytes: float,
) -> list[Cell]:
    """Every (depth, ranks) cell, best pipeline and best MGRIT setting.

    ``times_by_mb[1]`` (one micro-batch: the whole batch) are MGRIT's layer times
    and the serial reference.
    """
    if 1 not in times_by_mb:
        raise ValueError("times_by_mb needs the whole batch's layer times at key 1")
    full = times_by_mb[1]
    cells = []
    for n in depths:
        for p in ranks:
            pipe = best_pipeline(n, p, times_by_mb, full, comm, state_bytes)
            mgrit: tuple[float, str] | None = None
            for s in settings:
                if s.valid(n, p):
                    t = s.step(n, p, full, comm, state_bytes)
                    if mgrit is None or t < mgrit[0]:
                        mgrit = (t, s.label)
            cells.append(
                Cell(
                    depth=n,
                    ranks=p,
                    serial=n * full.serial_step,
                    pipeline=pipe[0] if pipe else None,
                    pipeline_label=pipe[1] if pipe else "",
                    mgrit=mgrit[0] if mgrit else None,
                    mgrit_label=mgrit[1] if mgrit else "",
                )
            )
    return cells


def crossover(cells: Sequence[Cell], depth: int) -> int | None:
    """The fewest ranks at which MGRIT beats the best pipeline at ``depth``."""
    wins = [c.ranks for c in cells if c.depth == depth and c.lp_wins]
    return min(wins) if wins else None
