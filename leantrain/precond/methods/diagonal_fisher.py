r"""Diagonal empirical Fisher preconditioning from exact per-example gradients.

The curvature of parameter :math:`\theta` is the diagonal of the empirical Fisher,
:math:`F = \frac1B \sum_i g_i \odot g_i`, where :math:`g_i` is the gradient of example
:math:`i`'s loss (the loss of a batch holding example :math:`i` alone); the
preconditioned gradient is :math:`g / (F + \lambda)` with damping :math:`\lambda`.

Per-example gradients come from ``torch.func`` (``vmap`` over ``grad``) on the model
called with each example as a batch of one. The same pass also yields the batch
gradient (their mean, or sum for ``loss_reduction="sum"``), so a curvature step costs
one vectorised forward/backward and no extra one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value, vmap

from leantrain.precond._checks import check_extra_state
from leantrain.precond.gradient_maker import unwrap_model
from leantrain.precond.preconditioned import (
    PreconditionedGradientMaker,
    PreconditioningConfig,
)
from leantrain.precond.stand_in import leaves

__all__ = ["DiagonalEmpiricalFisherGradientMaker"]


class _Slot:
    """Placeholder for the ``index``-th tensor taken out of a nested structure."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def _take(obj: Any, keep: Any, taken: list[Tensor]) -> Any:
    """Replace every tensor ``t`` with ``keep(t)`` true by a ``_Slot``; collect them."""
    if isinstance(obj, Tensor) and keep(obj):
        taken.append(obj)
        return _Slot(len(taken) - 1)
    if isinstance(obj, (list, tuple)):
        items = [_take(x, keep, taken) for x in obj]
        if isinstance(obj, list):
            return items
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    # Dataclasses first: a Hugging Face ModelOutput is both, and keeps its type so.
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {
            f.name: _take(getattr(obj, f.name), keep, taken)
            for f in dataclasses.fields(obj)
            if f.init
        }
        return dataclasses.replace(obj, **changes)
    if isinstance(obj, dict):
        return {k: _take(v, keep, taken) for k, v in obj.items()}
    return obj


def _put(obj: Any, values: list[Any]) -> Any:
    """Inverse of :func:`_take`: fill the slots with ``values``."""
    if isinstance(obj, _Slot):
        return values[obj.index]
    if isinstance(obj, (list, tuple)):
        items = [_put(x, values) for x in obj]
        if isinstance(obj, list):
            return items
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {
            f.name: _put(getattr(obj, f.name), values)
            for f in dataclasses.fields(obj)
            if f.init
        }
        return dataclasses.replace(obj, **changes)
    if isinstance(obj, dict):
        return {k: _put(v, values) for k, v in obj.items()}
    return obj


class _Bound(nn.Module):
    """Holds ``module`` so ``functional_call`` can swap its parameters; runs a thunk."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, thunk: Any) -> Any:
        return thunk()


class DiagonalEmpiricalFisherGradientMaker(PreconditionedGradientMaker):
    r"""Preconditions each parameter by its diagonal empirical Fisher.

    Curvature steps compute exact per-example gradients with ``torch.func``; every
    tensor argument of the model call and of the loss call whose leading dimension
    equals the batch size ``B`` (the leading dimension of the model call's first
    tensor argument) is split into examples, and so is a loss-call tensor whose
    leading dimension is a multiple ``k B`` (a batch flattened row-major, as
    ``targets.flatten()`` of ``(B, T)`` targets: ``k`` rows per example); other
    arguments are shared. For a sequence model an example is a sequence. The loss
    must be the mean (``loss_reduction="mean"``) or the sum of per-example losses, and
    the model must treat examples independently (no BatchNorm in training mode).
    On curvature steps, outputs the model reduces over the batch (e.g. a loss it
    returns) come back per example, with shape ``(B, ...)``. Pass the model (or its
    DDP wrapper) itself to ``setup_model_call``, or a function that calls the
    unwrapped model. A curvature step holds ``B`` per-example copies of the
    gradient; schedule it with ``curvature_interval`` on large models.

    Args:
        model: the module to train (plain or ``DistributedDataParallel``).
        config: the schedule and damping.
        loss_reduction: how the batch loss combines per-example losses.

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from leantrain.precond import DiagonalEmpiricalFisherGradientMaker
        >>> model = torch.nn.Linear(4, 3)
        >>> gm = DiagonalEmpiricalFisherGradientMaker(model)
        >>> y = gm.setup_model_call(model, torch.randn(8, 4))
        >>> gm.setup_loss_call(F.cross_entropy, y, torch.randint(0, 3, (8,)))
        >>> _ = gm.forward_and_backward()
        >>> sorted(gm.curvature)
        ['bias', 'weight']
    """

    def __init__(
        self,
        model: nn.Module,
        config: PreconditioningConfig | None = None,
        *,
        loss_reduction: Literal["mean", "sum"] = "mean",
    ) -> None:
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(
                f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}"
            )
        self.loss_reduction = loss_reduction
        # Keyed by parameter name: diag F (the estimate) and 1 / (F + damping).
        self.curvature: dict[str, Tensor] = {}
        self.preconditioner: dict[str, Tensor] = {}
        self._collected: dict[str, Tensor] = {}
        super().__init__(model, config)

    def is_supported(self, module: nn.Module) -> bool:
        """Any module owning trainable parameters (BatchNorm: in eval mode)."""
        return any(p.requires_grad for p in module.parameters(recurse=False))

    def _selected_parameters(self) -> dict[str, nn.Parameter]:
        """By the name ``model.named_parameters()`` gives: a parameter shared by
        several modules (tied weights) once, under its first name."""
        chosen = {
            id(p)
            for _, module in self.modules()
            for p in module.parameters(recurse=False)
            if p.requires_grad
        }
        inner = unwrap_model(self.model)
        return {n: p for n, p in inner.named_parameters() if id(p) in chosen}

    def _curvature_pass(self) -> tuple[Any, Tensor]:
        module = unwrap_model(self.model)
        for name, m in module.named_modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training:
                raise ValueError(
                    f"BatchNorm {name!r} is in training mode: it mixes the examples "
                    "of a batch, so per-example gradients are undefined. Put it in "
                    "eval mode or use LayerNorm/GroupNorm."
                )
        fn, model_args, model_kwargs = self.model_call
        if isinstance(fn, nn.Module) and unwrap_model(fn) is module:
            fn = module  # bypass DDP: its hooks do not run under vmap; we sync below
        batch = _batch_size((model_args, model_kwargs))
        batched: dict[int, Tensor] = {}  # id -> tensor split into examples
        for value in leaves(((model_args, model_kwargs), self.loss_call_arguments)):
            if isinstance(value, Tensor) and value.ndim > 0 and value.shape[0] == batch:
                batched[id(value)] = value
        # Loss-call tensors flattened over the batch (targets.reshape(-1) of a
        # (B, T) batch: leading dimension k * B) give each example its k rows.
        flattened = _flattened(self.loss_call_arguments, batch, batched)
        batched.update(flattened)
        ids = list(batched)
        params = {n: p for n, p in module.named_parameters() if p.requires_grad}
        # Detached: torch.func differentiates; the outer autograd must not record.
        detached = {n: p.detach() for n, p in params.items()}
        bound = _Bound(module)
        out_template: list[Any] = []

        def example_loss(p: dict[str, Tensor], example: list[Tensor]):
            # Each example becomes a batch of one, so the model sees its usual shapes.
            swap = {
                i: x if i in flattened else x.unsqueeze(0)
                for i, x in zip(ids, example, strict=True)
            }

            def leaf(v: Any) -> Any:
                return swap.get(id(v), v) if isinstance(v, Tensor) else v

            output = functional_call(
                bound,
                {f"module.{n}": v for n, v in p.items()},
                (lambda: self._call_model(fn, leaf),),
            )
            loss = self._loss_from_output(output, leaf).reshape(())
            outs: list[Tensor] = []
            out_template[:] = [_take(output, lambda t: True, outs)]
            return loss, [o.detach() for o in outs]

        per_example = vmap(
            grad_and_value(example_loss, has_aux=True),
            in_dims=(None, 0),
            randomness="different",
        )
        try:
            grads, (losses, outs) = per_example(detached, [batched[i] for i in ids])
        except Exception as err:
            if hasattr(err, "add_note"):
                err.add_note(
                    f"(in the per-example pass: the {len(ids)} tensor arguments with "
                    f"leading dimension {batch}, or a multiple k * {batch} in the "
                    "loss call (flattened over the batch: k rows per example), were "
                    "split into examples)"
                )
            raise

        reduce = torch.mean if self.loss_reduction == "mean" else torch.sum
        batch_grads = {n: reduce(g, dim=0) for n, g in grads.items()}
        self._all_reduce_mean(list(batch_grads.values()))
        for n, p in params.items():
            g = batch_grads[n].to(p.dtype)
            if p.grad is None:
                p.grad = g
            else:  # in place: DDP may hold .grad as a view of its buckets
                p.grad.add_(g)
        selected = set(self._selected_parameters())
        # In place: the per-example gradients (B copies of the parameters) are ours,
        # and a fresh (B, ...) temporary costs several times the arithmetic.
        self._collected = {
            n: g.square_().mean(dim=0) for n, g in grads.items() if n in selected
        }
        self._all_reduce_mean(list(self._collected.values()))
        # Per-example outputs have a leading batch of one; merge it into the batch.
        merged = [
            o.flatten(0, 1) if o.ndim > 1 and o.shape[1] == 1 else o for o in outs
        ]
        return _put(out_template[0], merged), reduce(losses.detach())

    def update_curvature(self) -> None:
        """Fold the collected ``mean_i g_i**2`` into the (EMA) curvature estimate."""
        for name, value in self._collected.items():
            self.curvature[name] = self._ema_update(name, value)
        self._collected = {}

    def update_preconditioner(self) -> None:
        """``1 / (curvature + damping)`` per parameter."""
        damping = self.config.damping
        self.preconditioner = {
            n: 1.0 / (c + damping) for n, c in self.curvature.items()
        }

    def precondition(self) -> None:
        """Multiply each selected ``.grad`` by its (possibly stale) preconditioner."""
        for name, p in self._selected_parameters().items():
            if p.grad is not None and name in self.preconditioner:
                p.grad.mul_(self.preconditioner[name].to(p.grad.dtype))

    def _extra_state(self) -> dict[str, Any]:
        return {
            "curvature": dict(self.curvature),
            "preconditioner": dict(self.preconditioner),
        }

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        keys = ("curvature", "preconditioner")
        check_extra_state(state, keys, tensor_maps=keys)
        self.curvature = {k: v.clone() for k, v in state["curvature"].items()}
        self.preconditioner = {k: v.clone() for k, v in state["preconditioner"].items()}


def _flattened(loss_args: Any, batch: int, batched: dict) -> dict[int, Tensor]:
    """Loss-call tensors of leading dimension ``k * batch`` (``k > 1``), viewed as
    ``(batch, k, ...)``: a ``(B, T)`` tensor flattened to ``(B T,)`` row-major gives
    example ``n`` rows ``n T .. n T + T - 1``, as the flattened logits do."""
    out: dict[int, Tensor] = {}
    for value in leaves(loss_args):
        if (
            isinstance(value, Tensor)
            and value.ndim > 0
            and id(value) not in batched
            and value.shape[0] > batch
            and value.shape[0] % batch == 0
        ):
            out[id(value)] = value.reshape(batch, -1, *value.shape[1:])
    return out


def _batch_size(model_call_args: Any) -> int:
    """Leading dimension of the first tensor among the model call's arguments."""
    for value in leaves(model_call_args):
        if isinstance(value, Tensor) and value.ndim > 0:
            return value.shape[0]
    raise ValueError(
        "per-example gradients need a batched tensor argument in the model call "
        "(its leading dimension is the batch size); none was found."
    )
