r"""What a step that refreshes nothing must cost: the preconditioner's multiply-adds.

Applying a Kronecker-factored preconditioner to an ``m x n`` weight gradient is two
matrix products, ``m n (m + n)`` multiply-adds (``B^{-1} G A^{-1}``: K-FAC, Shampoo,
PSGD with its cached ``Q^T Q``). EKFAC and SOAP rotate into an eigenbasis and back,
four products, twice that. The forward and backward of ``N`` tokens through a
Linear of the same shape cost ``3 N m n``. So a step that only applies the
preconditioner costs at least

.. math::
    1 + \frac{c \sum_\ell m_\ell n_\ell (m_\ell + n_\ell)}{3 N \cdot
    \text{(multiply-adds per token of the forward)}}

times the base optimizer's step, about ``1 + c (m + n) / (3 N)`` for a model of
equal-shaped layers: the floor falls as the batch grows, which is why
preconditioner overheads are quoted at large batch. ``benchmarks/precond_step.py``
prints this floor beside the measured step.

A run on a schedule (curvature every ``C`` steps, the preconditioner every ``I``)
mixes three kinds of step; :func:`schedule_mean_step` averages them over a period.
"""

from __future__ import annotations

from torch import nn

__all__ = [
    "APPLICATION_PRODUCTS",
    "application_macs",
    "forward_backward_macs",
    "schedule_mean_step",
]

# Maker class -> matrix products per preconditioned matrix on a plain step, in
# pairs (1 = B^{-1} G A^{-1}). Makers not listed count as 1.
APPLICATION_PRODUCTS: dict[str, int] = {
    "KfacGradientMaker": 1,
    "ShampooGradientMaker": 1,
    "PsgdGradientMaker": 1,  # Q_l^T Q_l and Q_r Q_r^T are cached products
    "EkfacGradientMaker": 2,  # Q_B [(Q_B^T G Q_A) / s] Q_A^T
    "SoapGradientMaker": 2,  # rotate in, Adam, rotate out
}


def _matrix_shape(module: nn.Module) -> tuple[int, int] | None:
    """The ``(rows, columns)`` a Kronecker maker sees for ``module``: the weight as
    ``(out, in)`` with the bias as one more column, or None for vectors (norms)."""
    weight = getattr(module, "weight", None)
    if weight is None or weight.dim() < 2:
        return None
    rows = weight.shape[0]
    cols = weight[0].numel() + (getattr(module, "bias", None) is not None)
    return rows, cols


def application_macs(maker) -> int:
    """Multiply-adds of one application of ``maker``'s preconditioner: ``c m n (m +
    n)`` summed over its preconditioned modules (``c`` from
    :data:`APPLICATION_PRODUCTS`). Vector parameters (norms) are elementwise and
    not counted."""
    products = APPLICATION_PRODUCTS.get(type(maker).__name__, 1)
    total = 0
    for _, module in maker.modules():
        shape = _matrix_shape(module)
        if shape is not None:
            rows, cols = shape
            total += products * rows * cols * (rows + cols)
    return total


def forward_backward_macs(model: nn.Module, context: int) -> int:
    """Multiply-adds per token of ``model``'s forward and backward: three times the
    forward's (the backward computes input and weight gradients), the forward being
    every ``nn.Linear``'s weight plus, per attention module (one with ``q_proj``
    and ``n_heads``), ``2 * context * d`` for its scores and weighted values.

    Raises:
        ValueError: ``context`` is not a positive int.
    """
    if not isinstance(context, int) or isinstance(context, bool) or context <= 0:
        raise ValueError(f"context must be a positive int, got {context!r}")
    forward = 0
    for module in model.modules():
        if isinstance(module, nn.Linear):
            forward += module.weight.numel()
        q_proj = getattr(module, "q_proj", None)
        if isinstance(q_proj, nn.Linear) and hasattr(module, "n_heads"):
            forward += 2 * context * q_proj.out_features
    return 3 * forward


def schedule_mean_step(
    plain: float,
    curvature: float,
    refresh: float,
    curvature_interval: int,
    preconditioner_interval: int,
) -> float:
    """The mean step of a run on a periodic schedule after warm-up, from the cost
    of each kind of step: ``plain`` (applies the preconditioner only),
    ``curvature`` (also updates the curvature) and ``refresh`` (also rebuilds the
    preconditioner). Per period of ``preconditioner_interval`` steps, ``I / C`` of
    them update the curvature, one of those the preconditioner too::

        ((I - I/C) * plain + (I/C - 1) * curvature + refresh) / I

    Raises:
        ValueError: an interval is not a positive int, or ``I`` is not a multiple
            of ``C`` (as ``PreconditioningConfig`` requires).
    """
    for name, value in (
        ("curvature_interval", curvature_interval),
        ("preconditioner_interval", preconditioner_interval),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if preconditioner_interval % curvature_interval:
        raise ValueError(
            f"preconditioner_interval={preconditioner_interval} is not a multiple "
            f"of curvature_interval={curvature_interval}"
        )
    updates = preconditioner_interval // curvature_interval
    return (
        (preconditioner_interval - updates) * plain
        + (updates - 1) * curvature
        + refresh
    ) / preconditioner_interval
