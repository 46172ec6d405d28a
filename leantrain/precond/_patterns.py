r"""Training patterns around a preconditioned maker's step: loss scaling, micro-batches
and parameters frozen or unfrozen during training.

* **Loss scaling** (``forward_and_backward(grad_scaler=...)``): the pass
  back-propagates ``grad_scaler.scale(loss)``; ``.grad`` is divided by the scale
  before the curvature and the preconditioning (makers whose Fisher vector is the
  loss gradient divide it out of that vector too) and multiplied by it again after,
  so ``grad_scaler.step(optimizer)`` unscales as usual. The scale is a power of two:
  both multiplications are exact.
* **Micro-batches** (``PreconditioningConfig(accumulation_steps=k)``): each call
  runs the plain forward and ``loss.backward()`` with the hooks of
  :class:`~leantrain.precond._loop_record.LoopRecorder` attached, the recorder that
  :class:`~leantrain.precond.PreconditionedOptimizer` uses in a user's loop; the
  ``k``-th call finishes the step with the maker's ``finish_step``, as that
  optimizer's ``step()`` does.
* **Frozen parameters**: a parameter frozen after the maker was built has no
  ``.grad`` and is skipped; one frozen when the maker was built and trainable later
  would keep its plain gradient, so the step raises.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from leantrain.precond._loop_record import LoopRecorder
from leantrain.precond.curv._recompute import refuse_reentrant_checkpoint
from leantrain.precond.gradient_maker import GradientMaker, loss_scale, unwrap_model

__all__ = [
    "check_trainable",
    "checked_scale",
    "frozen_parameters",
    "micro_batch",
    "scale_gradients",
]


def scale_gradients(model: nn.Module, factor: float) -> None:
    """Multiply every ``.grad`` of ``model`` by ``factor`` (in place)."""
    if factor == 1.0:
        return
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)


def checked_scale(maker: Any, grad_scaler: Any) -> float:
    """The scale of ``grad_scaler`` for ``maker`` (1.0 without one).

    Raises:
        TypeError: not a ``torch.amp.GradScaler``.
        ValueError: the maker's curvature cannot have the scale divided out.
    """
    scale = loss_scale(grad_scaler)
    if grad_scaler is not None and not maker.scales_loss:
        raise ValueError(
            f"{type(maker).__name__} cannot take grad_scaler: its curvature uses "
            "second derivatives or gradient differences of the loss, which the loss "
            "scale enters non-linearly; train in bfloat16 autocast or float32 (no "
            "loss scaling), or use K-FAC, EKFAC, Shampoo, NaturalGradientMaker, "
            "SENG or SMW-NG"
        )
    return scale


def frozen_parameters(model: nn.Module) -> dict[str, Tensor]:
    """``{name: parameter}`` of the parameters that do not require grad."""
    inner = unwrap_model(model)
    return {n: p for n, p in inner.named_parameters() if not p.requires_grad}


def check_trainable(maker: Any) -> None:
    """Raise if a parameter frozen at construction trains now, or one frozen since
    cannot be skipped by this maker.

    Raises:
        RuntimeError: naming the parameter and what to do.
    """
    cls = type(maker).__name__
    for name, p in maker._frozen_at_build.items():
        if p.requires_grad:
            raise RuntimeError(
                f"{cls}: parameter {name!r} was frozen (requires_grad=False) when "
                "the maker was built and is trainable now, so it would keep its "
                "plain gradient; build the maker with every parameter that will "
                "train trainable (freezing some afterwards is fine), or build a new "
                "maker after unfreezing"
            )
    if maker.skips_frozen:
        return
    for name, p in unwrap_model(maker.model).named_parameters():
        if not p.requires_grad and name not in maker._frozen_at_build:
            raise RuntimeError(
                f"{cls}: parameter {name!r} was frozen after the maker was built, "
                "which this method cannot skip (its state is fitted to the "
                "parameters it was built with); build a new maker after freezing"
            )


def micro_batch(maker: Any, grad_scaler: Any) -> tuple[Any, Tensor]:
    """One of ``config.accumulation_steps`` micro-batches of ``maker``'s step (a
    whole step when it is 1: a maker whose pass a reentrant checkpoint refuses).

    Raises:
        ValueError: the maker cannot combine micro-batches (the message says why).
        NotImplementedError: under DDP.
    """
    k = maker.config.accumulation_steps
    if not hasattr(maker, "_micro"):
        why = maker._accumulation_refusal() if k > 1 else None
        if why is not None:
            raise ValueError(
                f"{type(maker).__name__} cannot accumulate micro-batches "
                f"(accumulation_steps={k}): {why}. Run it on the whole batch "
                "(accumulation_steps=1), or use K-FAC, EKFAC, Shampoo or "
                "NaturalGradientMaker"
            )
        if maker._process_group() is not None:
            raise NotImplementedError(
                "accumulation_steps > 1 and reentrant checkpoints run on a single "
                "process; under DDP give each step its whole batch and pass "
                "use_reentrant=False"
            )
        maker._micro = 0
        maker._recorder = LoopRecorder(maker) if maker.records_in_loop else None
    recorder = maker._recorder
    if maker._micro == 0:
        maker._check_total_steps()
        if recorder is not None and maker.config.curvature_due(maker.step):
            recorder.start()
    scale = loss_scale(grad_scaler)
    maker._scaling(grad_scaler)
    try:
        with refuse_reentrant_checkpoint(type(maker).__name__):
            output, loss = GradientMaker._forward_backward(maker)
    finally:
        maker._scaling(None)
    maker._micro += 1
    if maker._micro == k:
        maker._micro = 0
        scale_gradients(maker.model, 1.0 / scale)
        try:
            with torch.no_grad():
                maker.finish_step(
                    scaled=grad_scaler is not None, recorder=recorder, loss_scale=scale
                )
        finally:
            if recorder is not None:
                recorder.stop()
        scale_gradients(maker.model, scale)
    return output, loss if scale == 1.0 else loss.detach() / scale
