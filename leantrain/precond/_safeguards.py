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

**KL clipping** (``PreconditioningConfig(kl_clip=c)``), as kfac-pytorch bounds
K-FAC's step: the preconditioned gradient is scaled by
:math:`\nu = \min(1, \sqrt{c / \sum_l \eta_l^2 \langle P_l, G_l \rangle})`, so a
step of learning rate :math:`\eta` changes the model's predictive distribution by
a KL divergence of at most about ``c / 2`` (:math:`\langle P, G\rangle = G^T F^{-1}
G` for the Fisher :math:`F`). Unlike grafting it keeps the preconditioner's step
lengths while they are safe, which is where K-FAC gains over SGD; it needs the
learning rate (the wrapped optimizer's in a loop, ``maker.lr`` otherwise) and a
copy of the plain gradient for the inner products.

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

__all__ = [
    "PlainGradient",
    "shortcut_gradient_dot",
    "shortcut_gradient_norm",
    "graft",
    "kl_clip_factor",
    "layer_dots",
    "layer_norms",
    "reject_nonfinite",
]


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


def layer_dots(layers: list[list[Tensor]], others: list[list[Tensor]]) -> Tensor:
    """``<P_l, G_l>`` of each layer's tensors with the other list's, ``(L,)``."""
    flat = [t for layer in layers for t in layer]
    dtype = _accumulation_dtype(flat) if flat else torch.float32
    # torch.dot of the flattened tensors: no product tensor the size of the layer.
    dots = [
        sum(
            (
                torch.dot(a.reshape(-1).to(dtype), b.reshape(-1).to(dtype))
                for a, b in zip(la, lb, strict=True)
            ),
            torch.zeros((), dtype=dtype, device=la[0].device if la else None),
        )
        for la, lb in zip(layers, others, strict=True)
    ]
    return torch.stack(dots) if dots else torch.zeros(0)


def kl_clip_factor(dots: Tensor, lrs: list[float], kl_clip: float) -> Tensor:
    r"""kfac-pytorch's KL clipping: the factor
    :math:`\nu = \min(1, \sqrt{c / |\sum_l \eta_l^2 \langle P_l, G_l \rangle|})`
    that bounds the step's predicted KL divergence
    :math:`\frac12 \sum_l \eta_l^2 \langle P_l, F_l P_l \rangle
    = \frac12 \sum_l \eta_l^2 \langle P_l, G_l \rangle` by ``c / 2``.

    ``dots`` holds :math:`\langle P_l, G_l \rangle` per layer, ``lrs`` each layer's
    learning rate :math:`\eta_l`."""
    # The learning rates are host floats: weighing each run of equal rates (one
    # per param group, in module order) keeps them off the device, where a tensor
    # of them would be copied over, host synchronised, on every step.
    total = dots.new_zeros(())
    start = 0
    for stop in range(1, len(lrs) + 1):
        if stop == len(lrs) or lrs[stop] != lrs[start]:
            total = total + lrs[start] ** 2 * dots[start:stop].sum()
            start = stop
    total = total.abs()
    return torch.clamp(torch.sqrt(kl_clip / total.clamp_min(1e-30)), max=1.0)


def shortcut_gradient_norm(x: Tensor, e: Tensor) -> Tensor:
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


def shortcut_gradient_dot(x: Tensor, e: Tensor, weight: Tensor) -> Tensor:
    """``<W, E^T X>``, a weight-shaped ``W`` ``(o, i)`` against the never-formed
    gradient of a linear layer: ``sum((E W) * X)``."""
    dtype = _accumulation_dtype([x, e, weight])
    return ((e.to(dtype) @ weight.to(dtype)) * x.to(dtype)).sum()


class PlainGradient:
    """Each preconditioned layer's plain gradient, taken before ``precondition()``
    overwrites ``.grad``: its norm at once, and (``keep``, for the KL clip) a copy
    for the inner products. A linear layer whose gradient is never formed (K-FAC's
    factored path) enters as its inputs ``X`` and output-gradients ``E``.

    Args:
        layers: the ``.grad`` tensors of each layer (empty for a factored one).
        factored: layer index -> ``(X, E, has_bias)``.
        keep: copy the tensors for :meth:`dots`.
        norms: take the norms (grafting's; the KL clip alone needs none, and
            ``norms`` is then None).
    """

    def __init__(
        self,
        layers: list[list[Tensor]],
        factored: dict[int, tuple[Tensor, Tensor, bool]],
        *,
        keep: bool,
        norms: bool = True,
    ) -> None:
        self.norms: Tensor | None = None
        if norms:
            self.norms = layer_norms(layers)
            for i, (x, e, has_bias) in factored.items():
                squares = shortcut_gradient_norm(x, e).square()
                if has_bias:
                    squares = squares + e.sum(0).to(squares.dtype).square().sum()
                self.norms[i] = squares.sqrt()
        self._layers = (
            [[t.clone() for t in layer] for layer in layers] if keep else None
        )
        self._output_grad_shortcut = factored

    def dots(self, after: list[list[Tensor]]) -> Tensor:
        """``<P_l, G_l>`` of the preconditioned gradients ``after`` with these."""
        if self._layers is None:
            raise RuntimeError("PlainGradient(keep=False) holds no copies")
        # Factored layers had no .grad before (their dots come from X and E).
        plain = [
            [] if i in self._output_grad_shortcut else lay
            for i, lay in enumerate(self._layers)
        ]
        mine = [
            [] if i in self._output_grad_shortcut else lay
            for i, lay in enumerate(after)
        ]
        dots = layer_dots(mine, plain)
        for i, (x, e, has_bias) in self._output_grad_shortcut.items():
            dot = shortcut_gradient_dot(x, e, after[i][0])
            if has_bias:
                dot = dot + (after[i][1].to(dot.dtype) * e.sum(0).to(dot.dtype)).sum()
            dots[i] = dot
        return dots


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
