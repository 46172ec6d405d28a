"""Hugging Face ``Conv1D``: a linear map whose weight is stored transposed.

``transformers.pytorch_utils.Conv1D(nf, nx)`` computes ``y = x @ W + b`` with a weight
of shape ``(nx, nf)`` = ``(in, out)``: it is ``nn.Linear`` with ``W^T`` as its weight.
This module is the one place that maps it onto the linear form ``y_t = W a_t + b``
(rows: the ``nf`` outputs, columns: the ``nx`` inputs), through the transposed
canonical index, the way ``nn.Embedding`` is. ``transformers`` is not imported:
the class is recognised by its name and its attributes, so models built on it work
whether or not the library is installed here.
"""

from __future__ import annotations

import torch
from torch import nn

from ._linear_form import DenseLinearOp

__all__ = ["Conv1dOp", "is_conv1d"]


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face ``Conv1D`` (weight ``(nx, nf)``)."""
    if type(module).__name__ != "Conv1D" or not hasattr(module, "nf"):
        return False
    weight = getattr(module, "weight", None)
    return (
        isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and tuple(weight.shape) == (getattr(module, "nx", -1), module.nf)
    )


class Conv1dOp(DenseLinearOp):
    """``Conv1D`` as ``nn.Linear`` with the weight transposed (see the module doc)."""

    transposed = True  # canonical W[r, c] is weight[c, r]

    def __init__(self, name: str, module: nn.Module) -> None:
        super().__init__(name, module)
        bias = getattr(module, "bias", None) is not None
        self._setup(module.nf, module.nx, bias)
