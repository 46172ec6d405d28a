r"""Curvature kinds and the losses they are defined for.

Every kind except ``"hessian"`` is a sum of outer products of back-propagated
output-space vectors,

.. math::  C = \sum_n \sum_k (J_n^\top s_{n,k}) (J_n^\top s_{n,k})^\top,

where :math:`J_n = \partial z_n / \partial \theta` is the Jacobian of example ``n``'s
model output and the vectors :math:`s_{n,k}` depend on the kind. With the loss as the
user reduces it, :math:`L = r \sum_n \ell_n` (``r = 1`` for ``reduction="sum"``,
``r = 1 / (\text{number of averaged terms})`` for ``"mean"``):

* ``"ggn"`` / ``"fisher_exact"``: :math:`\sum_k s_{n,k} s_{n,k}^\top =
  \partial^2 L / \partial z_n^2` exactly (for cross-entropy and MSE the two coincide).
* ``"fisher_mc"``: :math:`s_{n,m} = \sqrt{r / M}\, \nabla_z \ell_n(\hat y_m)` with
  :math:`\hat y_m` drawn from the model's predictive distribution, ``M`` draws,
  *averaged* (its expectation is ``"fisher_exact"``).
* ``"fisher_emp"``: :math:`s_n = \sqrt{r}\, \nabla_z \ell_n(y_n)`, so the result is
  :math:`r \sum_n g_n g_n^\top` with per-example gradients :math:`g_n`.

This module is pure math: it returns the vectors ``V_k`` (shaped like the model output,
one row per example) whose back-propagation gives the :math:`J_n^\top s_{n,k}`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "KINDS",
    "LossSpec",
    "as_loss_spec",
    "check_kind",
    "loss_value",
    "output_vectors",
    "reduction_factor",
]

KINDS = ("fisher_exact", "fisher_mc", "fisher_emp", "ggn", "hessian")
_LOSS_NAMES = {"cross_entropy": "cross_entropy", "ce": "cross_entropy", "mse": "mse"}


@dataclass(frozen=True)
class LossSpec:
    """What the curvature needs to know about the loss.

    Attributes:
        name: ``"cross_entropy"`` or ``"mse"``.
        reduction: ``"mean"`` or ``"sum"``.
        ignore_index: target value skipped by cross-entropy (as in torch).

    Example:
        >>> as_loss_spec(nn.MSELoss(reduction="sum"))
        LossSpec(name='mse', reduction='sum', ignore_index=-100)
    """

    name: str
    reduction: str = "mean"
    ignore_index: int = -100


def check_kind(kind: str) -> str:
    """Validate a curvature kind name."""
    if kind not in KINDS:
        raise ValueError(
            f"Invalid curvature kind {kind!r}; allowed: {', '.join(KINDS)}"
        )
    return kind


def as_loss_spec(loss_fn: object) -> LossSpec:
    """Turn ``nn.CrossEntropyLoss``, ``nn.MSELoss`` or a name into a :class:`LossSpec`.

    Names: ``"cross_entropy"`` (alias ``"ce"``) and ``"mse"``, both with
    ``reduction="mean"`` as torch's defaults; pass a module for ``"sum"``.

    Raises:
        TypeError: any other loss object (its curvature is not defined here).
        ValueError: an unknown name, ``reduction="none"``, class weights or label
            smoothing.
    """
    if isinstance(loss_fn, str):
        if loss_fn not in _LOSS_NAMES:
            raise ValueError(
                f"Unknown loss name {loss_fn!r}; allowed: {', '.join(_LOSS_NAMES)}"
            )
        return LossSpec(_LOSS_NAMES[loss_fn])
    # Exact types only: a subclass may override forward and change the loss.
    if type(loss_fn) is nn.CrossEntropyLoss:
        if loss_fn.weight is not None:
            raise ValueError("CrossEntropyLoss with class weights is not supported")
        if loss_fn.label_smoothing != 0.0:
            raise ValueError(
                "CrossEntropyLoss with label_smoothing="
                f"{loss_fn.label_smoothing} is not supported; allowed: 0.0"
            )
        spec = LossSpec("cross_entropy", loss_fn.reduction, loss_fn.ignore_index)
    elif type(loss_fn) is nn.MSELoss:
        spec = LossSpec("mse", loss_fn.reduction)
    else:
        raise TypeError(
            "loss_fn must be nn.CrossEntropyLoss, nn.MSELoss, 'cross_entropy' or "
            f"'mse'; got {type(loss_fn).__name__}"
        )
    if spec.reduction not in ("mean", "sum"):
        raise ValueError(
            f"Invalid loss reduction {spec.reduction!r}; allowed: 'mean', 'sum'"
        )
    return spec


def _check_targets(spec: LossSpec, output: torch.Tensor, targets: torch.Tensor) -> None:
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"targets must be a torch.Tensor, got {type(targets).__name__}")
    if output.dim() < 1 or not output.is_floating_point():
        raise ValueError(
            "model output must be a floating tensor with a batch dimension, got "
            f"shape {tuple(output.shape)} dtype {output.dtype}"
        )
    if spec.name == "cross_entropy":
        if output.dim() < 2:
            raise ValueError(
                "cross-entropy needs model output (N, ..., C), got shape "
                f"{tuple(output.shape)}"
            )
        if targets.dtype != torch.long or tuple(targets.shape) != tuple(
            output.shape[:-1]
        ):
            raise ValueError(
                "cross-entropy targets must be class indices (int64) shaped like the "
                f"output without its last (class) dimension {tuple(output.shape[:-1])};"
                f" got dtype {targets.dtype} shape {tuple(targets.shape)}"
            )
    elif tuple(targets.shape) != tuple(output.shape):
        raise ValueError(
            f"MSE targets must have the output's shape {tuple(output.shape)}, got "
            f"{tuple(targets.shape)}"
        )


def loss_value(
    spec: LossSpec, output: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """The loss as the user computes it; cross-entropy flattens ``(N, ..., C)``."""
    _check_targets(spec, output, targets)
    if spec.name == "cross_entropy":
        classes = output.shape[-1]
        return F.cross_entropy(
            output.reshape(-1, classes),
            targets.reshape(-1),
            reduction=spec.reduction,
            ignore_index=spec.ignore_index,
        )
    return F.mse_loss(output, targets, reduction=spec.reduction)


def reduction_factor(
    spec: LossSpec, output: torch.Tensor, targets: torch.Tensor
) -> float:
    """``r`` in ``L = r * sum(per-term losses)`` for this batch."""
    _check_targets(spec, output, targets)
    if spec.reduction == "sum":
        return 1.0
    if spec.name == "cross_entropy":
        count = int((targets != spec.ignore_index).sum())
        if count == 0:
            raise ValueError(
                f"every target equals ignore_index={spec.ignore_index}; the mean loss "
                "is undefined"
            )
        return 1.0 / count
    return 1.0 / output.numel()


def _position_mask(spec: LossSpec, targets: torch.Tensor) -> torch.Tensor:
    return targets != spec.ignore_index


def output_vectors(
    kind: str,
    spec: LossSpec,
    output: torch.Tensor,
    targets: torch.Tensor,
    *,
    n_mc_samples: int = 1,
    generator: torch.Generator | None = None,
) -> Iterator[torch.Tensor]:
    r"""Yield the vectors ``V_k`` (shaped like ``output``) for one curvature kind.

    Back-propagating each ``V_k`` from the output and summing the outer products of
    the per-example parameter gradients gives the curvature (see the module docstring).
    Examples are independent, so one vector covers the whole batch; positions
    (``(N, T, C)`` outputs) and output coordinates need a vector each for the exact
    kinds: cross-entropy yields ``T * C`` vectors, MSE ``output[0].numel()``.

    Raises:
        ValueError: bad kind, ``n_mc_samples < 1`` or mismatched targets.
    """
    check_kind(kind)
    if kind == "hessian":
        raise ValueError("the 'hessian' kind is not a sum of outer products")
    out = output.detach()
    r = reduction_factor(spec, out, targets)
    if kind in ("ggn", "fisher_exact"):
        yield from _exact_vectors(spec, out, targets, r)
    elif kind == "fisher_mc":
        if not isinstance(n_mc_samples, int) or n_mc_samples < 1:
            raise ValueError(f"n_mc_samples must be an int >= 1, got {n_mc_samples!r}")
        probs = _probabilities(out) if spec.name == "cross_entropy" else None
        for _ in range(n_mc_samples):
            yield _mc_vector(spec, out, targets, probs, r / n_mc_samples, generator)
    else:  # fisher_emp: gradient of the loss as reduced, rescaled by 1/sqrt(r)
        z = out.clone().requires_grad_(True)
        with torch.enable_grad():
            (grad,) = torch.autograd.grad(loss_value(spec, z, targets), z)
        yield grad / math.sqrt(r)


def _exact_vectors(
    spec: LossSpec, out: torch.Tensor, targets: torch.Tensor, r: float
) -> Iterator[torch.Tensor]:
    n = out.shape[0]
    if spec.name == "mse":
        # d2L/dz2 = 2 r I: one unit vector per output coordinate of an example.
        scale = math.sqrt(2.0 * r)
        per_example = out[0].numel()
        for d in range(per_example):
            vec = torch.zeros(n, per_example, dtype=out.dtype, device=out.device)
            vec[:, d] = scale
            yield vec.reshape(out.shape)
        return
    # Cross-entropy per position: r (diag(p) - p p^T) = sum_c (sqrt(r p_c)(e_c - p))^2.
    classes = out.shape[-1]
    probs = _probabilities(out).reshape(n, -1, classes)  # (N, T, C)
    mask = _position_mask(spec, targets).reshape(n, -1, 1).to(out.dtype)
    eye = torch.eye(classes, dtype=out.dtype, device=out.device)
    for t in range(probs.shape[1]):
        p = probs[:, t]  # (N, C)
        for c in range(classes):
            vec = torch.zeros_like(probs)
            vec[:, t] = (eye[c] - p) * (r * p[:, c : c + 1]).sqrt() * mask[:, t]
            yield vec.reshape(out.shape)


def _probabilities(out: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim as ``exp(z - logsumexp z)``.

    Same numbers as ``torch.softmax``; written out because the fused kernel costs
    ~10x more on tiny CPU tensors, and Monte-Carlo loops call this often.
    """
    return (out - out.logsumexp(dim=-1, keepdim=True)).exp()


def _mc_vector(
    spec: LossSpec,
    out: torch.Tensor,
    targets: torch.Tensor,
    probs: torch.Tensor | None,
    weight: float,
    generator: torch.Generator | None,
) -> torch.Tensor:
    n = out.shape[0]
    if spec.name == "mse":
        # Likelihood exp(-(y - z)^2): y_hat = z + eps / sqrt(2), grad = -sqrt(2) eps.
        eps = torch.randn(
            out.shape, dtype=out.dtype, device=out.device, generator=generator
        )
        return eps * math.sqrt(2.0 * weight)
    classes = out.shape[-1]
    probs = probs.reshape(-1, classes)
    # Inverse-CDF draw: the first class whose cumulative probability passes a
    # uniform (the last where rounding leaves the total short of it); a third of
    # torch.multinomial's cost on a (128, 10) batch, same distribution.
    u = torch.rand(
        probs.shape[0], 1, dtype=probs.dtype, device=probs.device, generator=generator
    )
    sampled = (probs.cumsum(-1) < u).sum(-1).clamp_max_(classes - 1)
    grad = probs - F.one_hot(sampled, classes).to(out.dtype)
    mask = _position_mask(spec, targets).reshape(-1, 1).to(out.dtype)
    return (grad * mask * math.sqrt(weight)).reshape(n, *out.shape[1:])
