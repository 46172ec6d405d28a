"""Validation of layer-parallel options: each error names the value and the rule."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from leantrain.layer_parallel.ode import State, as_tuple

ON_DIVERGENCE = ("warn", "raise", "ignore")


def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` as an int >= minimum, else TypeError/ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        kind = type(value).__name__
        raise TypeError(f"{name} must be an int, got {value!r} ({kind})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_float(name: str, value: object, *, positive: bool) -> float:
    """``value`` as a finite float, > 0 (``positive``) or >= 0."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {value!r}")
    value = float(value)
    bad = value <= 0 if positive else value < 0
    if bad or not math.isfinite(value):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be finite and {bound}, got {value}")
    return value


def check_relax(relax: int | Sequence[int], levels: int) -> tuple[int, ...]:
    """Relaxation sweeps per non-coarsest level (an int applies to all of them)."""
    if isinstance(relax, int) and not isinstance(relax, bool):
        return (check_int("relax", relax, 0),) * (levels - 1)
    if not isinstance(relax, Sequence) or isinstance(relax, str):
        raise TypeError(f"relax must be an int or a sequence of ints, got {relax!r}")
    if len(relax) != levels - 1:
        raise ValueError(
            f"relax needs one entry per non-coarsest level ({levels - 1} for "
            f"levels={levels}), got {len(relax)}: {list(relax)!r}"
        )
    return tuple(check_int(f"relax[{i}]", r, 0) for i, r in enumerate(relax))


def check_layout(n_steps: int, chunks: int, cf: int, levels: int) -> None:
    """N must split into equal chunks whose size is a multiple of cf**(levels-1).

    Aligning chunk boundaries with the coarsest C-points keeps every F-interval inside
    one chunk, so relaxation needs only one boundary state from the left neighbour.
    """
    check_int("number of steps", n_steps, 1)
    check_int("chunks", chunks, 1)
    check_int("cf", cf, 2)
    check_int("levels", levels, 2)
    if n_steps % chunks:
        raise ValueError(
            f"the number of steps N={n_steps} must be divisible by chunks={chunks}"
        )
    per_chunk = n_steps // chunks
    coarse = cf ** (levels - 1)
    if per_chunk % coarse:
        raise ValueError(
            f"each chunk's N/chunks={per_chunk} steps must be divisible by "
            f"cf**(levels-1)={cf}**{levels - 1}={coarse} (N={n_steps}, "
            f"chunks={chunks}); use fewer levels, a smaller cf or more steps"
        )


def check_on_divergence(value: object) -> str:
    """One of ``warn``, ``raise``, ``ignore``."""
    if value not in ON_DIVERGENCE:
        raise ValueError(f"on_divergence must be one of {ON_DIVERGENCE}, got {value!r}")
    return value  # type: ignore[return-value]


def check_state(state: object) -> State:
    """A floating Tensor or a non-empty tuple/list of floating Tensors."""
    if isinstance(state, list):
        state = tuple(state)
    if not isinstance(state, torch.Tensor | tuple) or (
        isinstance(state, tuple) and not state
    ):
        raise TypeError(
            f"state must be a Tensor or a tuple of Tensors, got {type(state).__name__}"
        )
    for i, t in enumerate(as_tuple(state)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            kind = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(
                f"state component {i} must be a floating Tensor, got {kind}"
            )
    return state
