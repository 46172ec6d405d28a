r"""Slow, obvious dense curvature matrices from :mod:`torch.func`.

These are the independent references the tests compare against, and they are public:
use them on small models to check a curvature or to study it exactly. Everything is
``(P, P)`` over ``model.parameters()`` that require grad, in that order.

* :func:`dense_ggn`: :math:`J^\top H J` with :math:`J` from ``jacrev`` of the model
  output w.r.t. the flat parameters and :math:`H` from ``hessian`` of the loss w.r.t.
  the output. For cross-entropy and MSE this is also the exact Fisher.
* :func:`dense_hessian`: the Hessian of the loss w.r.t. the flat parameters
  (``torch.autograd.functional.hessian``; see its docstring for why not torch.func).
* :func:`dense_empirical_fisher`: :math:`r \sum_n g_n g_n^\top` with per-example
  gradients :math:`g_n` from ``vmap(grad)`` of the per-example summed loss and ``r``
  the loss's reduction factor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.func import functional_call, grad, hessian, jacrev, vmap

from .api import user_loss
from .kinds import as_loss_spec, check_kind, loss_value, reduction_factor

__all__ = [
    "dense_curvature",
    "dense_empirical_fisher",
    "dense_ggn",
    "dense_hessian",
]


def _as_tuple(inputs: object) -> tuple:
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def _flat_model(model: nn.Module) -> tuple[torch.Tensor, Callable]:
    """The flat trainable parameter vector and ``f(theta, *inputs) -> output``."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    theta = torch.cat([p.detach().reshape(-1) for _, p in named])
    shapes = [(n, p.shape, p.numel()) for n, p in named]

    def f(flat: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        params, start = {}, 0
        for name, shp, numel in shapes:
            params[name] = flat[start : start + numel].reshape(shp)
            start += numel
        return functional_call(model, params, inputs)

    return theta, f


def dense_ggn(
    model: nn.Module, loss_fn: nn.Module | str, inputs: object, targets: torch.Tensor
) -> torch.Tensor:
    r"""Generalized Gauss-Newton :math:`J^\top (\partial^2 L / \partial z^2) J`."""
    spec = as_loss_spec(loss_fn)
    theta, f = _flat_model(model)
    args = _as_tuple(inputs)
    out = f(theta, *args).detach()
    jac = jacrev(lambda t: f(t, *args))(theta).reshape(out.numel(), -1)
    h_out = hessian(lambda z: user_loss(loss_fn, spec, z, targets))(out)
    h_out = h_out.reshape(out.numel(), out.numel())
    return jac.T @ h_out @ jac


def dense_hessian(
    model: nn.Module, loss_fn: nn.Module | str, inputs: object, targets: torch.Tensor
) -> torch.Tensor:
    """Hessian of the loss w.r.t. the flat parameter vector.

    Uses ``torch.autograd.functional.hessian`` (reverse over reverse with plain
    autograd): in torch 2.13 ``torch.func.hessian`` (and ``jacrev(jacrev)``) returns
    wrong second derivatives for the tiny Embedding + LayerNorm models of the tests
    (off by 5-50% against central finite differences of the gradient, which this
    function matches to 1e-9).
    """
    spec = as_loss_spec(loss_fn)
    theta, f = _flat_model(model)
    args = _as_tuple(inputs)

    def loss_of(t: torch.Tensor) -> torch.Tensor:
        return user_loss(loss_fn, spec, f(t, *args), targets)

    return torch.autograd.functional.hessian(loss_of, theta, vectorize=True)


def dense_empirical_fisher(
    model: nn.Module, loss_fn: nn.Module | str, inputs: object, targets: torch.Tensor
) -> torch.Tensor:
    r"""Empirical Fisher :math:`r \sum_n g_n g_n^\top` from ``vmap(grad)``.

    :math:`g_n` is the gradient of example ``n``'s loss summed over its positions /
    coordinates; ``r`` is the reduction factor of ``loss_fn`` on the whole batch
    (1 for "sum", one over the number of averaged terms for "mean").
    """
    spec = as_loss_spec(loss_fn)
    summed = type(spec)(spec.name, "sum", spec.ignore_index)
    theta, f = _flat_model(model)
    args = _as_tuple(inputs)
    r = reduction_factor(spec, f(theta, *args).detach(), targets)

    def example_loss(t: torch.Tensor, target: torch.Tensor, *xs: torch.Tensor):
        out = f(t, *(x.unsqueeze(0) for x in xs))
        return loss_value(summed, out, target.unsqueeze(0))

    per_example = vmap(grad(example_loss), in_dims=(None, 0) + (0,) * len(args))(
        theta, targets, *args
    )
    return r * per_example.T @ per_example


def dense_curvature(
    model: nn.Module,
    loss_fn: nn.Module | str,
    inputs: object,
    targets: torch.Tensor,
    kind: str,
) -> torch.Tensor:
    """Dense reference for a deterministic kind ("fisher_mc" has none: it is random).

    "fisher_exact" equals "ggn" for cross-entropy and MSE.
    """
    check_kind(kind)
    if kind in ("ggn", "fisher_exact"):
        return dense_ggn(model, loss_fn, inputs, targets)
    if kind == "hessian":
        return dense_hessian(model, loss_fn, inputs, targets)
    if kind == "fisher_emp":
        return dense_empirical_fisher(model, loss_fn, inputs, targets)
    raise ValueError(
        "kind 'fisher_mc' is random and has no dense reference; its expectation is "
        "'fisher_exact'"
    )
