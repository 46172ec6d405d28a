r"""Safeguards of a preconditioned step: grafting and the non-finite policy.

**Grafting** (``PreconditioningConfig(grafting="sgd")``), as Distributed Shampoo
grafts its step size from a first-order method: each layer's preconditioned
gradient :math:`P_l` is rescaled to the norm of that layer's plain gradient
:math:`G_l`,

.. math:: \tilde P_l = P_l \, \|G_l\|_F / \|P_l\|_F ,

so the preconditioner chooses the direction within a layer and the optimizer sees
gradients of the size it was tuned for. Without it an inverse of damped curvature
can lengthen a layer's gradient by up to ``1 / damping``; at the learning rates
people start with (SGD 0.05 with momentum 0.9) that diverged K-FAC and Shampoo on a
small GPT within tens of steps. A layer whose preconditioned gradient is zero keeps
it. The rescaling is one norm per layer before and after, in float32 (float64 for
float64 gradients), on the device.

**Non-finite gradients** (``PreconditioningConfig(nonfinite=...)``): a step whose
gradient holds a NaN or an infinity (a diverged run) is skipped as ``GradScaler``
skips one, with a ``RuntimeWarning`` each time, or raises ``FloatingPointError``.
Deciding needs the one host synchronisation of a steady step
(:func:`~leantrain.precond.preconditioned.all_finite`).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

__all__ = ["factored_gradient_norm", "graft", "layer_norms", "reject_nonfinite"]


def _accumulation_dtype(tensors: list[Tensor]) -> torch.dtype:
    """float64 if any tensor is, else float32 (half precision is summed in it)."""
    wide = any(t.dtype == torch.float64 for t in tensors)
    return torch.float64 if wide else torch.float32


def layer_norms(layers: list[list[Tensor]]) -> Tensor:
    """The Frobenius norm of each layer's tensors taken together, ``(L,)`` in
    float32 (float64 if a tensor is)."""
    flat = [t for layer in layers for t in layer]
    if not flat:
        return torch.zeros(len(layers))
    dtype = _accumulation_dtype(flat)
    squares = torch.stack(torch._foreach_norm(flat)).to(dtype).square()
    sums = [chunk.sum() for chunk in squares.split([len(layer) for layer in layers])]
    return torch.stack(sums).sqrt()


def graft(layers: list[list[Tensor]], target: Tensor) -> None:
    """Rescale each layer's tensors in place so that its norm is ``target[l]``
    (a layer whose norm is zero is left as it is)."""
    now = layer_norms(layers)
    ratio = torch.where(now > 0, target.to(now.device) / now, torch.ones_like(now))
    for layer, r in zip(layers, ratio.unbind(), strict=True):
        if layer:
            torch._foreach_mul_(layer, r.to(layer[0].dtype))


def factored_gradient_norm(x: Tensor, e: Tensor) -> Tensor:
    r"""``||E^T X||_F`` of a linear layer's weight gradient from its inputs ``X``
    ``(N, i)`` and output-gradients ``E`` ``(N, o)``, without forming it when the
    Gram form is cheaper: :math:`\|E^T X\|_F^2 = \sum (E E^T) \circ (X X^T)`."""
    n, i = x.shape
    o = e.shape[1]
    dtype = _accumulation_dtype([x, e])
    x, e = x.to(dtype), e.to(dtype)
    if n * (i + o) < i * o:
        return ((e @ e.T) * (x @ x.T)).sum().clamp_min(0).sqrt()
    return torch.linalg.matrix_norm(e.T @ x)


def reject_nonfinite(maker: Any, where: str) -> None:
    """The policy for a step whose gradient is not finite: raise, or count it in
    ``maker.nonfinite_steps`` and warn (every time: a run that keeps skipping has
    diverged, and the count says how far)."""
    name = type(maker).__name__
    if maker.config.nonfinite == "raise":
        raise FloatingPointError(
            f"{name}: non-finite gradient at step {maker.step} ({where}); "
            "PreconditioningConfig(nonfinite='skip') skips such steps instead"
        )
    maker.nonfinite_steps += 1
    warnings.warn(
        f"{name}: non-finite gradient at step {maker.step}: the step is skipped "
        f"({where}); {maker.nonfinite_steps} skipped so far. A run that keeps "
        "skipping has diverged: lower the learning rate, raise the damping or turn "
        "on grafting (PreconditioningConfig(grafting='sgd')).",
        RuntimeWarning,
        stacklevel=4,
    )
