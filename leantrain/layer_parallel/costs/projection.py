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

from leantrain.layer_parallel.costs.simulate import (
    CommModel,
    LayerTimes,
    OutsideTimes,
    simulate,
)
from leantrain.layer_parallel.costs.simulate_pipeline import simulate_pipeline


@dataclass(frozen=True)
class MGRITSetting:
    """One MGRIT configuration; ``fwd_iters=0`` means an exact serial forward
    (``forward_solver="serial"``), whose time is the rank-to-rank relay of ``N``
    recorded forward steps."""

    levels: int = 2
    cf: int = 4
    fwd_iters: int = 1
    bwd_iters: int = 1

    @classmethod
    def parse(cls, spec: str) -> MGRITSetting:
        """A setting from ``"levels,cf,fwd_iters,bwd_iters"`` (a benchmark's ``--lp``);
        ``fwd_iters`` may be ``serial``.

        Raises:
            ValueError: naming the spec when it is malformed.

        Example:
            >>> MGRITSetting.parse("2,4,serial,1").label
            'L2 cf4 fwd serial bwd 1'
        """
        parts = spec.split(",")
        if len(parts) != 4:
            raise ValueError(
                f"--lp {spec!r}: expected levels,cf,fwd_iters,bwd_iters (e.g. 2,4,1,1)"
            )
        if parts[2] == "serial":
            parts[2] = "0"
        try:
            levels, cf, fwd, bwd = (int(v) for v in parts)
        except ValueError:
            raise ValueError(f"--lp {spec!r}: every field must be an integer") from None
        if levels < 2 or cf < 2 or fwd < 0 or bwd < 1:
            raise ValueError(
                f"--lp {spec!r}: needs levels >= 2, cf >= 2, fwd_iters >= 1 (or "
                "serial), bwd_iters >= 1"
            )
        return cls(levels, cf, fwd, bwd)

    def options(self) -> dict:
        """The :class:`~leantrain.layer_parallel.LayerParallel` keywords of this
        setting (``forward_solver="serial"`` for ``fwd_iters=0``)."""
        kw = dict(levels=self.levels, cf=self.cf, bwd_iters=self.bwd_iters)
        if self.fwd_iters == 0:
            kw["forward_solver"] = "serial"
        else:
            kw["fwd_iters"] = self.fwd_iters
        return kw

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
        outside: OutsideTimes | None = None,
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
            forward_solver="mgrit" if self.fwd_iters else "serial",
            outside=outside,
        )
        return r.step


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
    outside_by_mb: Mapping[int, OutsideTimes] | None = None,
) -> tuple[float, str] | None:
    """Fastest GPipe / 1F1B step over the measured micro-batch counts, or None.

    Args:
        times_by_mb: layer times of one micro-batch, keyed by the micro-batch count.
        full: layer times of the whole batch (the serial reference).
        state_bytes: bytes of the whole batch's state (a micro-batch sends 1/M).
        outside_by_mb: the work outside the stack, keyed like ``times_by_mb``
            (default: none).
    """
    outside_by_mb = outside_by_mb or {}
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
                outside=outside_by_mb.get(m),
                serial_outside=outside_by_mb.get(1),
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
    outside_by_mb: Mapping[int, OutsideTimes] | None = None,
) -> list[Cell]:
    """Every (depth, ranks) cell, best pipeline and best MGRIT setting.

    ``times_by_mb[1]`` (one micro-batch: the whole batch) are MGRIT's layer times
    and the serial reference; ``outside_by_mb`` (keyed the same way, optional) the
    work outside the stack, charged to all three.
    """
    if 1 not in times_by_mb:
        raise ValueError("times_by_mb needs the whole batch's layer times at key 1")
    if outside_by_mb is not None and set(outside_by_mb) != set(times_by_mb):
        raise ValueError("outside_by_mb must have the keys of times_by_mb")
    full = times_by_mb[1]
    outside = outside_by_mb[1] if outside_by_mb is not None else None
    cells = []
    for n in depths:
        for p in ranks:
            pipe = best_pipeline(
                n, p, times_by_mb, full, comm, state_bytes, outside_by_mb
            )
            mgrit: tuple[float, str] | None = None
            for s in settings:
                if s.valid(n, p):
                    t = s.step(n, p, full, comm, state_bytes, outside)
                    if mgrit is None or t < mgrit[0]:
                        mgrit = (t, s.label)
            cells.append(
                Cell(
                    depth=n,
                    ranks=p,
                    serial=n * full.serial_step
                    + (outside.step(n) if outside is not None else 0.0),
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


def projection_table(cells: Sequence[Cell]) -> str:
    """Markdown table of ``pipeline / MGRIT`` step ratios, depth by ranks.

    Bold: layer-parallel faster; ``-``: a layout that cannot run. The last column
    lists every rank count where MGRIT wins (the region need not be one-sided:
    MGRIT's best setting changes where a deeper hierarchy stops fitting).
    """
    depths = sorted({c.depth for c in cells})
    ranks = sorted({c.ranks for c in cells})
    by_key = {(c.depth, c.ranks): c for c in cells}
    lines = [
        "| N | " + " | ".join(f"P={p}" for p in ranks) + " | MGRIT faster at |",
        "|---|" + "---|" * (len(ranks) + 1),
    ]
    for n in depths:
        row = []
        for p in ranks:
            c = by_key.get((n, p))
            if c is None or c.pipeline is None or c.mgrit is None:
                row.append("-")
                continue
            r = c.pipeline / c.mgrit
            row.append(f"**{r:.2f}**" if c.lp_wins else f"{r:.2f}")
        wins = [p for p in ranks if (n, p) in by_key and by_key[(n, p)].lp_wins]
        where = ", ".join(f"P={p}" for p in wins) if wins else "nowhere"
        lines.append(f"| {n} | " + " | ".join(row) + f" | {where} |")
    return "\n".join(lines)
