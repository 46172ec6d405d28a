r"""MGRIT with FAS for ``u_j = \Phi_j(u_{j-1}) + f_j``: the driver (the pure phase
functions are in :mod:`leantrain.layer_parallel.relaxation`).

Level ``l`` has the grid ``0 .. N/cf^l``; its step into point ``j`` is
``propagator(l, j, u_{j-1})`` (on coarse levels the fine layer at the start of the
coarse interval with ``dt = cf^l h``; the propagator decides). Points that are multiples
of ``cf`` are C-points, the others F-points. One iteration (a V-cycle) is, top down:

* relaxation: ``nu_l`` sweeps of F then C, then one more F (``nu_l = 1``: FCF);
* residual at C-points ``r_j = f_j - u_j + \Phi(u_{j-1})`` and injection ``v = u|_C``;
* FAS/tau right-hand side ``f^c_J = r_{J cf} + v_J - \Phi^c(v_{J-1})``;
* on the coarsest level a serial solve (relayed chunk to chunk);
* bottom up: correction ``u_{J cf} += u^c_J - v_J`` at C-points, then (intermediate
  levels only) an F-relaxation that interpolates it to the F-points. Level 0's F-points
  are fixed by the next iteration's relaxation or by the final F-C sweep.

``skip_downcycle`` (cold start only): the first cycle does no relaxation and no
residual; the coarse levels start from the injected guess with ``f = 0``, so it is a
coarse serial solve from ``u_0`` plus interpolation - a cheap first guess.

Residual history: ``r_k`` is the C-point residual of the iterate entering cycle ``k``,
taken after one F-relaxation (so it costs nothing: the first C-relaxation computes
it); the final F-C sweep gives the residual of the returned iterate in the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from leantrain.layer_parallel._checks import check_float, check_int, check_relax
from leantrain.layer_parallel.layout import ChunkLayout, Exchange, LocalExchange
from leantrain.layer_parallel.ode import State, as_tuple, sq_norm, zeros_like
from leantrain.layer_parallel.relaxation import (
    Rhs,
    c_relax,
    correct,
    f_relax,
    restrict,
    serial_sweep,
)

# ``converged`` needs the returned iterate's residual at most this fraction of the state
# norm ||u_C||. Measured on 16-layer GPTs (float32), two forward cycles: at h = 1/N
# 1e-4 to 5e-2 (the README's GPT: 4.5e-2, output 5 % off); at h = 1 0.7 to 0.85,
# output 70-90 % off, though the residuals fall. One adjoint cycle leaves ~0.2 even at
# h = 1/N: LayerParallel reports that level but warns only when an adjoint diverges.
CONVERGENCE_RTOL = 0.1


class Propagator(Protocol):
    """``(level, j, u) -> state`` at level point ``j``; ``final``: last fine sweep."""

    def __call__(
        self, level: int, j: int, u: State, *, final: bool = False
    ) -> State: ...


@dataclass(frozen=True)
class MGRITOptions:
    """Solver options (validated).

    Args:
        levels: grid levels ``L`` >= 2.
        cf: coarsening factor >= 2.
        iterations: maximum V-cycles >= 1.
        relax: CF-sweeps before the final F on each non-coarsest level (1 = FCF);
            an int applies to every level.
        skip_downcycle: skip the first down-cycle on a cold start.
        tol: stop when the residual is <= tol (absolute; 0 disables).

    Example:
        >>> from leantrain.layer_parallel import ChunkLayout, LayerRNG, StepPropagator
        >>> steps = [lambda u, dt: u + dt * torch.tanh(u)] * 8
        >>> prop = StepPropagator(steps, 1 / 8, 2, LayerRNG(0, enabled=False))
        >>> opts = MGRITOptions(levels=2, cf=2, iterations=3)
        >>> layout = ChunkLayout(8, 2, 2, 2)
        >>> traj, stats = mgrit_solve(prop, torch.ones(2), layout, opts)
        >>> exact = serial_solve(prop, torch.ones(2), 8)
        >>> bool(torch.allclose(traj[-1], exact[-1], atol=1e-6)), stats.iterations
        (True, 3)
    """

    levels: int = 2
    cf: int = 4
    iterations: int = 2
    relax: int | tuple[int, ...] = 1
    skip_downcycle: bool = True
    tol: float = 0.0

    def __post_init__(self) -> None:
        check_int("levels", self.levels, 2)
        check_int("cf", self.cf, 2)
        check_int("iterations", self.iterations, 1)
        object.__setattr__(self, "relax", check_relax(self.relax, self.levels))
        check_float("tol", self.tol, positive=False)


@dataclass
class MGRITStats:
    """What one solve did.

    Attributes:
        residuals: residual norm of the iterate entering each (non-skipped) cycle.
        final_residual: residual norm of the returned iterate (final F-C sweep).
        iterations: V-cycles run.
        converged: True when the last residual reached ``tol`` or the floor, or when
            every residual fell and the last is at most :data:`CONVERGENCE_RTOL` of
            the state norm; False when one grew (above the floor) or is not finite,
            or when the last is above that fraction (the trajectory is not the serial
            one yet: at ``h = 1`` residuals can fall while the output stays 30-100 %
            off); None when a single residual
            below that fraction cannot tell whether the cycle contracts, or when
            ``u_0`` itself is not finite (nothing can converge; a GradScaler skips
            such a step).
        floor: ``100 eps ||u_C||``; residuals below it are rounding noise.
        state_norm: ``||u_C||``, the norm of the returned iterate at the C-points
            (set by the solve; the scale of :attr:`relative_residual`).
        work: per cycle, per level, layer steps summed over all chunks.
        critical_path: per cycle, the steps of the slowest chunk plus the whole
            coarsest relay (the cost-model ``W``).
        final_work: layer steps of the final F-C sweep over all chunks (``N``).
    """

    residuals: list[float] = field(default_factory=list)
    final_residual: float = math.nan
    iterations: int = 0
    converged: bool | None = None
    floor: float = 0.0
    work: list[list[int]] = field(default_factory=list)
    critical_path: list[int] = field(default_factory=list)
    final_work: int = 0
    state_norm: float = field(default=0.0, init=False)

    @property
    def diverged(self) -> bool:
        """A residual is not finite, or one grew above :attr:`floor`."""
        h = self.history
        return not all(math.isfinite(r) for r in h) or any(
            b >= a and b > self.floor for a, b in zip(h, h[1:], strict=False)
        )

    @property
    def relative_residual(self) -> float:
        """``final_residual / state_norm``; ``converged`` needs <= CONVERGENCE_RTOL."""
        if self.final_residual == 0:
            return 0.0
        return self.final_residual / self.state_norm if self.state_norm else math.inf

    @property
    def history(self) -> list[float]:
        """``residuals`` followed by ``final_residual``."""
        return [*self.residuals, self.final_residual]

    @property
    def factors(self) -> list[float]:
        """Convergence factors ``||r_{k+1}|| / ||r_k||`` along :attr:`history`."""
        h = self.history
        return [b / a if a > 0 else math.nan for a, b in zip(h, h[1:], strict=False)]

    @property
    def total_work(self) -> int:
        """All layer steps of the solve, every chunk and level, final sweep included."""
        return sum(map(sum, self.work)) + self.final_work


def serial_solve(propagator: Propagator, u0: State, n_steps: int) -> list[State]:
    """The serial reference: ``u_j = Phi_j(u_{j-1})`` on level 0, all points."""
    return serial_sweep(lambda j, u: propagator(0, j, u), u0, None, 0, n_steps)


def sequential_solve(
    propagator: Propagator,
    u0: State,
    layout: ChunkLayout,
    exchange: Exchange | None = None,
) -> list[State]:
    """Exact serial stepping, chunk after chunk (the distributed "serial" mode).

    Each chunk waits for its left neighbour's last point, steps through its own
    layers with ``final=True`` (so a recording propagator keeps every graph) and
    passes its last point on. Returns ``[u_0, local points...]`` like
    :func:`mgrit_solve`.
    """
    ex = exchange if exchange is not None else LocalExchange(layout.chunks)
    points: dict[int, list[State]] = {}

    def run(p: int, ghost: State) -> State:
        def step(j: int, u: State) -> State:
            return propagator(0, j, u, final=True)

        n0 = layout.per_chunk(0)
        points[p] = serial_sweep(step, ghost, None, layout.offset(p, 0), n0)
        return points[p][-1]

    ex.relay(run, u0)
    return [u0, *(x for p in ex.local_chunks for x in points[p][1:])]


# ---------------------------------------------------------------------- bookkeeping
class _Chunk:
    """One chunk's states on every level, and its layer-step counters."""

    def __init__(self, index, layout: ChunkLayout, propagator, u0, init) -> None:
        self.index, self.layout, self.propagator = index, layout, propagator
        n0, off = layout.per_chunk(0), layout.offset(index, 0)
        if init is None:
            owned = [zeros_like(u0)] * n0  # shared zeros: states are never mutated
        else:
            owned = list(init[off + 1 : off + n0 + 1])
        levels = layout.levels
        self.u: list[list[State]] = [[u0, *owned]] + [[] for _ in range(levels - 1)]
        self.v: list[list[State]] = [[] for _ in range(levels)]
        self.f: list[Rhs] = [None] * levels
        self.parallel = [0] * levels  # steps done alongside the other chunks
        self.relayed = [0] * levels  # steps on the coarsest serial relay

    def stepper(self, level: int, *, relayed: bool = False, final: bool = False):
        counter = self.relayed if relayed else self.parallel

        def step(j: int, u: State) -> State:
            counter[level] += 1
            return self.propagator(level, j, u, final=final)

        return step

    def offset(self, level: int) -> int:
        return self.layout.offset(self.index, level)

    def f_relax(self, level: int, *, final: bool = False) -> None:
        step, off = self.stepper(level, final=final), self.offset(level)
        self.u[level] = f_relax(step, self.u[level], self.f[level], off, self.layout.cf)

    def c_relax(self, level: int, *, final: bool = False) -> Tensor | float:
        step, off = self.stepper(level, final=final), self.offset(level)
        self.u[level], r2 = c_relax(
            step, self.u[level], self.f[level], off, self.layout.cf
        )
        return r2

    def restrict(self, level: int) -> Tensor | float:
        v, fc, r2 = restrict(
            self.stepper(level),
            self.stepper(level + 1),
            self.u[level],
            self.f[level],
            self.offset(level),
            self.layout.cf,
        )
        self.v[level + 1], self.f[level + 1], self.u[level + 1] = v, fc, list(v)
        return r2

    def inject(self, level: int) -> None:
        v = list(self.u[level][:: self.layout.cf])
        self.v[level + 1], self.f[level + 1], self.u[level + 1] = v, None, list(v)

    def coarse_solve(self, level: int, ghost: State) -> State:
        step = self.stepper(level, relayed=True)
        n = self.layout.per_chunk(level)
        self.u[level] = serial_sweep(step, ghost, self.f[level], self.offset(level), n)
        return self.u[level][-1]

    def correct(self, level: int) -> None:
        cf = self.layout.cf
        self.u[level] = correct(self.u[level], self.u[level + 1], self.v[level + 1], cf)

    def c_sq_norm(self) -> Tensor | float:
        return sum(sq_norm(x) for x in self.u[0][self.layout.cf :: self.layout.cf])

    def take_work(self) -> tuple[list[int], list[int]]:
        out = (self.parallel, self.relayed)
        levels = self.layout.levels
        self.parallel, self.relayed = [0] * levels, [0] * levels
        return out


# --------------------------------------------------------------------------- driver
def mgrit_solve(
    propagator: Propagator,
    u0: State,
    layout: ChunkLayout,
    options: MGRITOptions,
    *,
    exchange: Exchange | None = None,
    init: Sequence[State] | None = None,
) -> tuple[list[State], MGRITStats]:
    """Solve ``u_j = Phi_j(u_{j-1})``, ``u_0`` given, with FAS-MGRIT V-cycles.

    Args:
        propagator: the level steps (see :class:`Propagator`).
        u0: the initial condition (point 0).
        layout: steps, chunks, cf and levels (``layout.cf``/``levels`` must match
            ``options``).
        options: iterations, relaxation, skip, tolerance.
        exchange: boundary communication; default all chunks in this process.
        init: a guess for all ``N + 1`` points (warm start); None starts from zeros.

    Returns:
        The trajectory ``[u_0, ..., u_N]`` after the final F-C sweep (the local chunks'
        points, in order) and the :class:`MGRITStats`.

    Raises:
        ValueError: if layout and options disagree or ``init`` has the wrong length.
    """
    if (layout.cf, layout.levels) != (options.cf, options.levels):
        raise ValueError(
            f"layout (cf={layout.cf}, levels={layout.levels}) does not match options "
            f"(cf={options.cf}, levels={options.levels})"
        )
    if init is not None and len(init) != layout.n_steps + 1:
        raise ValueError(
            f"init must hold N+1={layout.n_steps + 1} states, got {len(init)}"
        )
    ex = exchange if exchange is not None else LocalExchange(layout.chunks)
    chunks = [_Chunk(p, layout, propagator, u0, init) for p in ex.local_chunks]
    by_index = {c.index: c for c in chunks}
    levels, relax, stats = options.levels, options.relax, MGRITStats()

    def f_relax(level: int, final: bool = False) -> None:
        # The only state a relaxation needs from outside: the left neighbour's last.
        ghosts = ex.shift([c.u[level][-1] for c in chunks], u0)
        for c, g in zip(chunks, ghosts, strict=True):
            c.u[level][0] = g
            c.f_relax(level, final=final)

    def norm(local_sq: Tensor | float) -> float:
        # The one read on the host per residual norm: the squares of every C-point
        # and chunk were summed on the device. Taken only where the solve uses the
        # value (the stopping test, the final residual, the state norm).
        return math.sqrt(ex.allreduce_sum(float(local_sq)))

    def record_work() -> None:
        taken = [c.take_work() for c in chunks]
        per_level = [sum(p[lv] + s[lv] for p, s in taken) for lv in range(levels)]
        stats.work.append(per_level)
        stats.critical_path.append(
            max(sum(p) for p, _ in taken) + sum(sum(s) for _, s in taken)
        )

    def done(r: float) -> bool:
        # The level-0 residual after one F-relaxation: record it, stop on tol or NaN.
        stats.residuals.append(r)
        return not math.isfinite(r) or r <= options.tol

    def down(level: int) -> bool:
        """Relax, restrict; True when the level-0 residual says stop."""
        for sweep in range(relax[level]):
            f_relax(level)
            r2 = sum(c.c_relax(level) for c in chunks)
            if level == 0 and sweep == 0 and done(norm(r2)):
                return True
        f_relax(level)
        r2 = sum(c.restrict(level) for c in chunks)
        return level == 0 and relax[0] == 0 and done(norm(r2))

    for k in range(options.iterations):
        skip = options.skip_downcycle and init is None and k == 0
        stop = False
        for level in range(levels - 1):
            if skip:
                for c in chunks:
                    c.inject(level)
            elif down(level):
                stop = True
                break
        if stop:
            record_work()
            stats.iterations = k + 1
            break
        ex.relay(lambda p, ghost: by_index[p].coarse_solve(levels - 1, ghost), u0)
        for level in range(levels - 2, -1, -1):
            for c in chunks:
                c.correct(level)
            if level > 0:
                f_relax(level)
        record_work()
        stats.iterations = k + 1

    f_relax(0, final=True)
    stats.final_residual = norm(sum(c.c_relax(0, final=True) for c in chunks))
    stats.final_work = sum(sum(p) for p, _ in (c.take_work() for c in chunks))
    eps = torch.finfo(torch.as_tensor(_first(u0)).dtype).eps
    stats.state_norm = norm(sum(c.c_sq_norm() for c in chunks))
    stats.floor = 100 * eps * stats.state_norm
    stats.converged = _judge(stats, options.tol)
    if stats.converged is False and not _finite(u0):
        # A non-finite start (the output gradient of a GradScaler step that
        # overflowed) makes every residual non-finite: no verdict on convergence.
        stats.converged = None
    return [u0, *(x for c in chunks for x in c.u[0][1:])], stats


def _finite(u: State) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in as_tuple(u))


def _first(u: State) -> torch.Tensor:
    return u if isinstance(u, torch.Tensor) else u[0]


def _judge(stats: MGRITStats, tol: float) -> bool | None:
    history = stats.history
    if not all(math.isfinite(r) for r in history):
        return False
    if (tol > 0 and min(history) <= tol) or history[-1] <= stats.floor:
        return True
    # Any growth above the floor means the cycle is not contracting (h = 1 often grows
    # by 1.03-1.67 per cycle), even if a later cycle happens to fall again. Falling
    # residuals are not enough either: at h = 1 they can fall while the output stays
    # 30-100 % off the serial network's, so the level counts too.
    if stats.diverged or history[-1] > CONVERGENCE_RTOL * stats.state_norm:
        return False
    return None if len(history) < 2 else True
