"""Validation of layer-parallel options: each error names the value and the rule."""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from leantrain.layer_parallel.ode import BLOCK_CONTRACT, State, as_tuple

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


def check_blocks(steps: object) -> list[nn.Module]:
    """The blocks of a residual stack, each callable as ``block(x, dt)``.

    Accepts a list or tuple of blocks, an ``nn.ModuleList`` or an ``nn.Sequential``
    (as a container only: its own forward passes no ``dt`` and is never called), or
    a module holding its blocks in ``.steps`` (``ResidualStack``, i.e. ``model.stack``).
    Each block's forward must bind ``(x, dt)`` positionally, as the solver calls it.

    Raises:
        TypeError: for any other container, a block that is not an ``nn.Module``, or
            a block whose forward cannot take ``(x, dt)``; the message names the
            block's index and class and what its forward must accept.
    """
    blocks = steps
    if _is_single_module(blocks):
        blocks = getattr(blocks, "steps", None)
    if _is_single_module(blocks) or not isinstance(blocks, Iterable):
        # A module without .steps is a block or a whole model, not a stack of blocks.
        raise TypeError(
            "LayerParallel takes the blocks of a residual stack: a list, "
            "nn.ModuleList or nn.Sequential of blocks, or a module that holds them "
            "in .steps (a leantrain ResidualStack such as model.stack); got "
            f"{type(steps).__name__}, which is none of these. {BLOCK_CONTRACT}"
        )
    blocks = list(blocks)
    for n, block in enumerate(blocks):
        if not isinstance(block, nn.Module):
            raise TypeError(
                f"block {n} is a {type(block).__name__}, not an nn.Module. "
                f"{BLOCK_CONTRACT}"
            )
        _check_takes_dt(n, block)
    return blocks


def _is_single_module(obj: object) -> bool:
    return isinstance(obj, nn.Module) and not isinstance(
        obj, nn.ModuleList | nn.Sequential
    )


def _check_takes_dt(n: int, block: nn.Module) -> None:
    # The solver calls block(x, dt) with dt positional (ode.run_step), so bind exactly
    # that: a second positional parameter of any name, or *args, passes; a forward
    # with only **kwargs, or one that needs a third argument, does not.
    try:
        signature = inspect.signature(block.forward)
    except (TypeError, ValueError):  # not introspectable (a builtin): the call decides
        return
    try:
        signature.bind(None, 1.0)
    except TypeError:
        raise TypeError(
            f"block {n} ({type(block).__name__}) cannot be called as block(x, dt): "
            f"its forward{signature} must accept the state x and the step size dt as "
            f"its first two positional arguments and need no others. {BLOCK_CONTRACT}"
        ) from None


def check_stack_dt(stack: object, n_steps: int, t_final: float) -> None:
    """A stack handed over whole (``model.stack``) must keep its own step size.

    ``LayerParallel`` steps with ``t_final / N``; a ``ResidualStack`` built with another
    ``dt`` would silently become a different network.

    Raises:
        ValueError: if ``stack.dt`` differs from ``t_final / n_steps``.
    """
    dt = getattr(stack, "dt", None) if hasattr(stack, "steps") else None
    if not isinstance(dt, int | float) or isinstance(dt, bool):
        return
    if math.isclose(dt, t_final / n_steps, rel_tol=1e-9):
        return
    raise ValueError(
        f"the stack steps with dt = {dt:g} ({n_steps} steps, t_final = "
        f"{dt * n_steps:g}) but LayerParallel(t_final={t_final:g}) would step with "
        f"dt = {t_final / n_steps:g}: a different network. Pass "
        f"t_final={dt * n_steps:g} to keep the model (dt = 1, a plain ResNet, is one "
        "for which MGRIT does not converge: build the model with t_final=1.0 "
        "instead), or pass stack.steps to run its blocks with a new step size"
    )
