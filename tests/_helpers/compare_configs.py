"""Tiny settings of the ``leantrain compare`` axes, shared by the tests that run them.

:data:`TINY_DEPTH` is the depth axis at a size that runs in seconds on a CPU: 8 blocks
of d 16, two MGRIT cycles of coarsening factor 2 (approximate, not exact, so the
accuracy columns have something to show), projected to 256 layers.
"""

from __future__ import annotations

import dataclasses

from leantrain.compare import depth as compare_depth

TINY_DEPTH = dataclasses.replace(
    compare_depth.DEFAULT,
    n_layer=8,
    d_model=16,
    n_head=2,
    tokens=8,
    batch=2,
    cf=2,
    repeats=2,
    layer_reps=2,
    projected_layers=256,
)
