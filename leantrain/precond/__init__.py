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
from leantrain.precond.ekfac import EkfacGradientMaker
from leantrain.precond.gradient_maker import GradientMaker, unwrap_model
from leantrain.precond.kbfgs import KbfgsGradientMaker
from leantrain.precond.kfac import KfacGradientMaker
from leantrain.precond.preconditioned import (
    PreconditionedGradientMaker,
    PreconditioningConfig,
    is_due,
)
from leantrain.precond.psgd import PsgdGradientMaker
from leantrain.precond.shampoo import ShampooGradientMaker
from leantrain.precond.stand_in import StandIn

__all__ = [
    "KINDS",
    "SHAPES",
    "Curvature",
    "DiagonalEmpiricalFisherGradientMaker",
    "EkfacGradientMaker",
    "GradientMaker",
    "KbfgsGradientMaker",
    "KfacGradientMaker",
    "KronFactor",
    "ModuleCurvature",
    "PreconditionedGradientMaker",
    "PreconditioningConfig",
    "PsgdGradientMaker",
    "ShampooGradientMaker",
    "StandIn",
    "curvature",
    "is_due",
    "unwrap_model",
]
