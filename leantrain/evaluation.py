r"""Which evaluations of a module define the gradient: the signal between the axes.

A solver that evaluates its layers many times per step (``LayerParallel``'s MGRIT:
relaxation sweeps, residuals, coarse-grid steps, adjoint re-evaluations) tells code
that watches those layers through hooks (the curvature makers of
:mod:`leantrain.precond`) which evaluations count:

* :func:`auxiliary`: evaluations that do *not* define the gradient. A hook that
  collects statistics ignores them (:func:`is_auxiliary`).
* :func:`detached`: the evaluations that define the gradient but whose autograd
  graph is separate from the caller's (the solver links it to the caller's graph
  through its own backward). ``torch.autograd.grad`` from the loss to a tensor of
  such a graph answers ``None``; a gradient reaches it only while the solver's
  backward runs, which fires its tensor hooks, so a hook-based collector must take
  the output-gradients from its hooks (:func:`in_detached`, :func:`detached_count`).
* :func:`recomputation`: activation checkpointing
  (``torch.utils.checkpoint.checkpoint``) re-runs a forward inside the backward to
  rebuild the tensors it did not save. Without reentrancy (``use_reentrant=False``)
  the gradient flows through the graph of the first evaluation, so the re-run is
  auxiliary: a forward hook that collects statistics ignores it. With reentrancy the
  first evaluation ran without gradients and the re-run, inside the backward, is
  the one that defines the gradient.
* :func:`note_partial`: this process evaluated only part of the model's layers (a
  stack spread over processes); code whose statistics couple all layers (one Gram
  matrix over every layer's per-example gradients) must not treat its part as the
  whole (:func:`partial_count`).

This module belongs to none of the three axes, so that both can import it (they never
import each other). The flags are process-wide counters, not thread-local: autograd
may run tensor hooks on its device threads.

Example:
    >>> is_auxiliary()
    False
    >>> with auxiliary():
    ...     is_auxiliary()
    True
    >>> before = detached_count()
    >>> with detached():
    ...     in_detached()
    True
    >>> detached_count() - before
    1
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = [
    "auxiliary",
    "detached",
    "detached_count",
    "in_detached",
    "is_auxiliary",
    "note_partial",
    "partial_count",
    "recomputation",
]

_state = {"auxiliary": 0, "detached": 0, "detached_total": 0, "partial_total": 0}


@contextlib.contextmanager
def auxiliary() -> Iterator[None]:
    """Evaluations inside do not define the gradient (hooks must ignore them)."""
    _state["auxiliary"] += 1
    try:
        yield
    finally:
        _state["auxiliary"] -= 1


def is_auxiliary() -> bool:
    """True inside :func:`auxiliary`."""
    return _state["auxiliary"] > 0


@contextlib.contextmanager
def detached() -> Iterator[None]:
    """A defining evaluation whose graph is separate from the caller's (see module)."""
    _state["detached"] += 1
    _state["detached_total"] += 1
    try:
        yield
    finally:
        _state["detached"] -= 1


def in_detached() -> bool:
    """True inside :func:`detached` (and not inside :func:`auxiliary`)."""
    return _state["detached"] > 0 and not is_auxiliary()


def detached_count() -> int:
    """How many :func:`detached` evaluations this process has entered so far."""
    return _state["detached_total"]


def recomputation() -> str | None:
    """Whether a module's forward runs as activation checkpointing's re-evaluation.

    Call it from forward hooks (a tensor hook always runs inside a backward). A
    forward with gradients enabled inside a backward is checkpointing's re-run:

    Returns:
        ``"reentrant"`` (``use_reentrant=True``: the re-run defines the gradient),
        ``"non_reentrant"`` (the re-run only rebuilds saved tensors; the first
        evaluation defines the gradient) or ``None`` (an ordinary forward).
    """
    if not torch.is_grad_enabled() or torch._C._current_graph_task_id() == -1:
        return None
    node = torch._C._current_autograd_node()
    if type(node).__name__ == "CheckpointFunctionBackward":
        return "reentrant"
    return "non_reentrant"


def note_partial() -> None:
    """Record that this process just evaluated only its own part of the layers."""
    _state["partial_total"] += 1


def partial_count() -> int:
    """How many :func:`note_partial` calls this process has made so far."""
    return _state["partial_total"]
