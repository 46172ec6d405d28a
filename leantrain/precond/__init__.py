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
from leantrain.precond.fisher_options import FisherOptions
from leantrain.precond.gradient_maker import GradientMaker, unwrap_model
from leantrain.precond.in_loop import (
    IN_LOOP_METHODS,
    PreconditionedOptimizer,
    precondition_in_loop,
)
from leantrain.precond.methods.diagonal_fisher import (
    DiagonalEmpiricalFisherGradientMaker,
)
from leantrain.precond.methods.ekfac import EkfacGradientMaker
from leantrain.precond.methods.hessian_free import HessianFreeGradientMaker
from leantrain.precond.methods.kbfgs import KbfgsGradientMaker
from leantrain.precond.methods.kfac import KfacGradientMaker
from leantrain.precond.methods.natural_gradient import NaturalGradientMaker
from leantrain.precond.methods.newton import NewtonGradientMaker
from leantrain.precond.methods.psgd import PsgdGradientMaker
from leantrain.precond.methods.seng import SengGradientMaker
from leantrain.precond.methods.shampoo import ShampooGradientMaker
from leantrain.precond.methods.smw_ng import SmwNgGradientMaker
from leantrain.precond.methods.soap import SoapGradientMaker
from leantrain.precond.preconditioned import (
    PreconditionedGradientMaker,
    PreconditioningConfig,
    is_due,
)
from leantrain.precond.registry import PRECOND_METHODS, make_gradient_maker
from leantrain.precond.stand_in import StandIn

__all__ = [
    "IN_LOOP_METHODS",
    "KINDS",
    "PRECOND_METHODS",
    "SHAPES",
    "Curvature",
    "DiagonalEmpiricalFisherGradientMaker",
    "EkfacGradientMaker",
    "FisherOptions",
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
