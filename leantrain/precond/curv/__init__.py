"""Curvature layer: Fisher / GGN / Hessian in five representations.

Public entry point: :func:`curvature`. Reusable hook machinery for training steps:
:class:`CurvatureCollector`. Dense references: :mod:`.reference`.
"""

from .api import curvature
from .extension import SHAPES, CurvatureCollector
from .kinds import KINDS, LossSpec, as_loss_spec, output_vectors
from .linalg import (
    cholesky_ex,
    cholesky_inverse,
    damped_cholesky,
    damped_inverse,
    pi_damping,
    pi_split,
    robust_eigh,
)
from .modules import SUPPORTED_MODULES
from .reference import (
    dense_curvature,
    dense_empirical_fisher,
    dense_ggn,
    dense_hessian,
)
from .representations import Curvature, KronFactor, ModuleCurvature

__all__ = [
    "KINDS",
    "SHAPES",
    "SUPPORTED_MODULES",
    "Curvature",
    "CurvatureCollector",
    "KronFactor",
    "LossSpec",
    "ModuleCurvature",
    "as_loss_spec",
    "cholesky_ex",
    "cholesky_inverse",
    "damped_cholesky",
    "damped_inverse",
    "curvature",
    "dense_curvature",
    "dense_empirical_fisher",
    "dense_ggn",
    "dense_hessian",
    "output_vectors",
    "pi_damping",
    "pi_split",
    "robust_eigh",
]
