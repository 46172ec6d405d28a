"""The depth projection as a figure: speedup over serial of layer-parallel MGRIT and
the best pipeline schedule against ranks, and their ratio.

Plotting lives beside the ``leantrain compare depth`` axis, not in the solver package,
so ``leantrain.layer_parallel`` never imports matplotlib (imported late, here, only
when a figure is drawn).
"""

from __future__ import annotations

from collections.abc import Sequence

from leantrain.compare.report import pyplot
from leantrain.layer_parallel.costs.projection import Cell, crossover


def plot_projection(
    cells: Sequence[Cell],
    path: str,
    comm_name: str,
    depths: Sequence[int] = (16, 64, 256, 1024),
) -> None:
    """PNG: speedup over serial of both methods against ranks (left) and their
    ratio (right, above 1 layer-parallel is faster; dotted: the first crossover)."""
    plt = pyplot()

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, n in enumerate(depths):
        row = [c for c in cells if c.depth == n]
        color = f"C{i}"
        pts = [(c.ranks, c.serial / c.mgrit) for c in row if c.mgrit]
        if pts:
            ax1.plot(*zip(*pts, strict=True), "-o", color=color, label=f"MGRIT N={n}")
        pts = [(c.ranks, c.serial / c.pipeline) for c in row if c.pipeline]
        if pts:
            ax1.plot(
                *zip(*pts, strict=True), "--", color=color, label=f"pipeline N={n}"
            )
        pts = [(c.ranks, c.pipeline / c.mgrit) for c in row if c.mgrit and c.pipeline]
        if pts:
            ax2.plot(*zip(*pts, strict=True), "-o", color=color, label=f"N={n}")
        cross = crossover(cells, n)
        if cross:
            ax2.axvline(cross, color=color, lw=0.8, ls=":")
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set(
        xlabel="ranks P",
        ylabel="speedup over serial",
        title=f"projected speedup over serial (messages: {comm_name})",
    )
    ax1.legend(fontsize=7, ncol=2)
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.set_xscale("log", base=2)
    ax2.set(
        xlabel="ranks P",
        ylabel="best pipeline step / MGRIT step",
        title="> 1: layer-parallel faster (dotted: first crossover)",
    )
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
