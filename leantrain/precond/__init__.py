"""Gradient preconditioning behind one interface: the gradient makers.

A :class:`GradientMaker` owns forward + backward; preconditioned makers add curvature
work, scheduled by a :class:`PreconditioningConfig`. Where a trainer owns forward
and backward, :class:`PreconditionedOptimizer` (:func:`precondition_in_loop`) applies a
maker from inside ``optimizer.step()``. :func:`curvature` computes a Fisher / GGN /
Hessian in one of five representations. See ``docs/precond.md``.
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
from leantrain.precond.hessian_free import HessianFreeGradientMaker
from leantrain.precond.in_loop import (
    IN_LOOP_METHODS,
    PreconditionedOptimizer,
    precondition_in_loop,
)
from leantrain.precond.kbfgs import KbfgsGradientMaker
from leantrain.precond.kfac import KfacGradientMaker
from leantrain.precond.natural_gradient import NaturalGradientMaker
from leantrain.precond.newton import NewtonGradientMaker
from leantrain.precond.preconditioned import (
    PreconditionedGradientMaker,
    PreconditioningConfig,
    is_due,
)
from leantrain.precond.psgd import PsgdGradientMaker
from leantrain.precond.registry import PRECOND_METHODS, make_gradient_maker
from leantrain.precond.seng import SengGradientMaker
from leantrain.precond.shampoo import ShampooGradientMaker
from leantrain.precond.smw_ng import SmwNgGradientMaker
from leantrain.precond.soap import SoapGradientMaker
from leantrain.precond.stand_in import StandIn

__all__ = [
    "IN_LOOP_METHODS",
    "KINDS",
    "PRECOND_METHODS",
    "SHAPES",
    "Curvature",
    "DiagonalEmpiricalFisherGradientMaker",
    "EkfacGradientMaker",
    "GradientMaker",
    "HessianFreeGradientMaker",
    "KbfgsGradientMaker",
    "KfacGradientMaker",
    "KronFactor",
    "ModuleCurvature",
    "NaturalGradientMaker",
    "NewtonGradientMaker",
    "PreconditionedGradientMaker",
    "PreconditionedOptimizer",
    "PreconditioningConfig",
    "PsgdGradientMaker",
    "SengGradientMaker",
    "ShampooGradientMaker",
    "SmwNgGradientMaker",
    "SoapGradientMaker",
    "StandIn",
    "curvature",
    "is_due",
    "make_gradient_maker",
    "precondition_in_loop",
    "unwrap_model",
]
