"""Gradient preconditioning behind one interface: the gradient makers.

A :class:`GradientMaker` owns forward + backward; preconditioned makers add curvature
work, scheduled by a :class:`PreconditioningConfig`. :func:`curvature` computes a
Fisher / GGN / Hessian in one of five representations. See ``docs/precond.md``.
"""

from leantrain.precond.curv import (
    KINDS,
    SHAPES,
    Curvature,
    KronFactor,
    ModuleCurvature,
    curvature,
)
from leantrain.precond.diagonal_fisher import DiagonalEmpiricalFisherGradientMaker
from leantrain.precond.gradient_maker import GradientMaker, unwrap_model
from leantrain.precond.preconditioned import (
    PreconditionedGradientMaker,
    PreconditioningConfig,
    is_due,
)
from leantrain.precond.stand_in import StandIn

__all__ = [
    "KINDS",
    "SHAPES",
    "Curvature",
    "DiagonalEmpiricalFisherGradientMaker",
    "GradientMaker",
    "KronFactor",
    "ModuleCurvature",
    "PreconditionedGradientMaker",
    "PreconditioningConfig",
    "StandIn",
    "curvature",
    "is_due",
    "unwrap_model",
]
