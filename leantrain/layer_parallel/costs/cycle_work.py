r"""The ideal cost of an MGRIT solve on a chunk layout, in layer steps.

Cost model (DESIGN.md, no communication, unit = one layer step), one V-cycle on the
critical path of one chunk, ``nu_l`` = CF-sweeps on level ``l``:

.. math::
    W = n_0(\nu_0 + 1 + 1/cf) + \sum_{l=1}^{L-2} n_l(\nu_l + 2) + N/cf^{L-1},
    \qquad T(k) = k W + N/P,

which is DESIGN.md's ``3 n_l`` for FCF (``nu_l = 1``) on the intermediate levels.
Term by term, as the solver counts it: ``nu_0`` F+C sweeps cost ``n_0`` each, the
F-relaxation before restriction ``n_0 (1 - 1/cf)``, the C-point residual ``n_0/cf``,
the tau correction ``n_1 = n_0/cf`` coarse steps; an intermediate level adds its
interpolating F-relaxation ``n_l (1 - 1/cf)``; the coarsest level is one serial
relay over all chunks, ``N/cf^{L-1}``. The final F-C sweep costs ``N/P``. A skipped
first down-cycle costs only the coarsest solve and the interpolations.
"""

from __future__ import annotations

from collections.abc import Sequence

from leantrain.layer_parallel.layout import ChunkLayout


def vcycle_work(layout: ChunkLayout, relax: Sequence[int]) -> float:
    """Ideal layer steps of one V-cycle on one chunk's critical path (``W``).

    Example:
        >>> layout = ChunkLayout(n_steps=16, chunks=2, cf=2, levels=2)
        >>> vcycle_work(layout, (1,)), solve_time(layout, (1,), iterations=2)
        (28.0, 64.0)
    """
    cf, n = layout.cf, layout.per_chunk
    work = n(0) * (relax[0] + 1 + 1 / cf)
    for level in range(1, layout.levels - 1):
        work += n(level) * (relax[level] + 2)
    return work + layout.n_points(layout.levels - 1)


def skipped_cycle_work(layout: ChunkLayout) -> float:
    """Critical-path steps of a skipped first down-cycle: coarsest solve + interps."""
    cf = layout.cf
    levels = range(1, layout.levels - 1)
    interp = sum(layout.per_chunk(lv) * (1 - 1 / cf) for lv in levels)
    return layout.n_points(layout.levels - 1) + interp


def solve_time(
    layout: ChunkLayout, relax: Sequence[int], iterations: int, *, skip: bool = False
) -> float:
    """``T(k) = k W + N/P`` (first cycle replaced by the skipped one when ``skip``)."""
    w = vcycle_work(layout, relax)
    if skip:
        cycles = (iterations - 1) * w + skipped_cycle_work(layout)
    else:
        cycles = iterations * w
    return cycles + layout.per_chunk(0)
