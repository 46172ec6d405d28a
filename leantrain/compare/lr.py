"""The learning rate of the long-run quality measurements over training: a linear
warm-up, then a cosine decay to a floor (a ``LambdaLR`` factor).

Shared by ``leantrain compare``'s memory axis and ``benchmarks/gefen_long.py``, so
the main job and the long-run benchmark train with the same learning rates.
"""

from __future__ import annotations

import math
from collections.abc import Callable


def warmup_cosine(
    warmup: int, steps: int, floor: float = 0.1
) -> Callable[[int], float]:
    """The factor of step ``step`` (0-based, as ``LambdaLR`` counts): ``(step + 1) /
    warmup`` during the warm-up, then a cosine from 1 down to ``floor`` at ``steps``.

    Raises:
        ValueError: ``warmup`` or ``steps`` is not a positive int, or ``floor`` is
            outside [0, 1].
    """
    for name, value in (("warmup", warmup), ("steps", steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not 0.0 <= floor <= 1.0:
        raise ValueError(f"floor must be in [0, 1], got {floor!r}")

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return floor + (1.0 - floor) / 2 * (
            1.0 + math.cos(math.pi * min(1.0, progress))
        )

    return factor
