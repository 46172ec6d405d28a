"""Activation checkpointing's re-run, as the curvature hooks see it.

``torch.utils.checkpoint.checkpoint`` re-runs a forward inside the backward to
rebuild the tensors it did not keep (:func:`leantrain.evaluation.recomputation`).
Without reentrancy the first evaluation's graph carries the gradient and the re-run
is ignored. With it, the first evaluation ran without gradients and the re-run lives
only inside the backward: a recorder of the user's own backward claims it (the
collector's ``reentrant_calls``), a curvature pass that asks ``torch.autograd.grad``
cannot reach it and is refused, saying what to do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from leantrain import evaluation

__all__ = [
    "REENTRANT_CHECKPOINT",
    "ReentrantCheckpointError",
    "records_evaluation",
    "refuse_reentrant_checkpoint",
]


class ReentrantCheckpointError(RuntimeError):
    """``torch.autograd.grad`` met a reentrant checkpoint (``use_reentrant=True``)."""


def records_evaluation(module_name: str) -> bool:
    """Whether a forward hook on ``module_name`` records the current evaluation.

    Not under ``torch.no_grad()``, in an :func:`~leantrain.evaluation.auxiliary`
    evaluation, or in activation checkpointing's non-reentrant re-run inside the
    backward (the first evaluation was recorded and its graph carries the gradient).

    Raises:
        RuntimeError: in a reentrant checkpoint's re-run (``use_reentrant=True``):
            the first evaluation ran without gradients and the re-run's graph lives
            only inside the backward, where no curvature pass can reach it.
    """
    if not torch.is_grad_enabled() or evaluation.is_auxiliary():
        return False
    kind = evaluation.recomputation()
    if kind == "reentrant":
        raise RuntimeError(REENTRANT_CHECKPOINT.format(module_name))
    return kind is None


REENTRANT_CHECKPOINT = (
    "module {!r} runs inside torch.utils.checkpoint.checkpoint(..., "
    "use_reentrant=True): its forward is evaluated without gradients and re-run "
    "inside the backward, where the curvature statistics cannot be taken; pass "
    "use_reentrant=False (the statistics are then those of the model without "
    "checkpointing)"
)


@contextlib.contextmanager
def refuse_reentrant_checkpoint(who: str) -> Iterator[None]:
    """Turn torch's refusal of ``torch.autograd.grad`` through a reentrant checkpoint
    into one that says what to do (a curvature pass asks autograd for gradients)."""
    try:
        yield
    except RuntimeError as err:
        text = str(err)
        if "use_reentrant=True" not in text or "checkpoint" not in text:
            raise
        raise ReentrantCheckpointError(
            f"{who} takes gradients with torch.autograd.grad, which "
            "torch.utils.checkpoint.checkpoint(..., use_reentrant=True) does not "
            "support; pass use_reentrant=False (the statistics are then those of the "
            "model without checkpointing); K-FAC, EKFAC, the natural gradients, "
            "SENG and SMW-NG with fisher_type='fisher_emp' record from a plain "
            "backward and work with it"
        ) from err
