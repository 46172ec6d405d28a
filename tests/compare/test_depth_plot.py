"""The depth projection's figure (leantrain/compare/depth_plot.py)."""

from __future__ import annotations

from leantrain.compare.depth_plot import plot_projection
from leantrain.layer_parallel.costs import CommModel, LayerTimes, MGRITSetting, project


def test_plot_writes_a_png(tmp_path):
    flat = {m: LayerTimes(1.0, 1.5, 1.2, 2.4) for m in (1, 2, 4, 8)}
    cells = project(
        [16, 64], [2, 4, 32], flat, [MGRITSetting(2, 4, 1, 1)], CommModel(), 0.0
    )
    path = tmp_path / "p.png"
    plot_projection(cells, str(path), "free", depths=(16, 64))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
