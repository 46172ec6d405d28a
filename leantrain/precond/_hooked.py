r"""Shared curvature pass of the hook-based makers (natural gradient, SMW-NG, SENG).

:class:`HookedMaker` runs one forward through the *unwrapped* model with the curvature
layer's :class:`~leantrain.precond.curv.CurvatureCollector` attached, takes the loss
gradient from the same graph (no extra forward), back-propagates the Fisher vectors of
``fisher_type`` from the logits and keeps what the subclass asked for: the collector's
statistics (``shapes``), its full matrix, and/or the per-pass *sites* (inputs and
output-gradients of every module) from which per-example gradients follow.

Under ``DistributedDataParallel`` the pass bypasses the wrapper and averages the
gradient itself; subclasses average (or gather) their curvature with
:meth:`HookedMaker._all_reduce_mean` / :func:`all_gather_rows`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from leantrain import evaluation
from leantrain.precond._coverage import hidden_parameters
from leantrain.precond._fisher import FisherMaker
from leantrain.precond.curv import CurvatureCollector
from leantrain.precond.curv.modules import ModuleOp
from leantrain.precond.gradient_maker import unwrap_model
from leantrain.precond.preconditioned import PreconditioningConfig

__all__ = ["HookedMaker", "all_gather_rows"]


def all_gather_rows(tensor: Tensor, group: Any) -> Tensor:
    """Concatenate ``tensor`` of every rank along dim 0 (rank order); same shapes."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=0)


class _SiteCollector(CurvatureCollector):
    """The collector, also keeping each backward pass's sites per module."""

    keep_sites = False
    accumulate_stats = True

    def reset(self) -> None:
        super().reset()
        self.sites: list[dict[str, list]] = []

    def _update(self, data: dict) -> None:
        if self.accumulate_stats:
            super()._update(data)
        if self.keep_sites:
            self.sites.append({n: s for n, s in data.items() if s})


class HookedMaker(FisherMaker):
    """Base of the makers whose curvature comes from module hooks (see module doc).

    Args:
        model: the module to train (plain or ``DistributedDataParallel``).
        config: schedule, damping, EMA decay, ignored modules.
        shapes: collector representations to accumulate (may be empty).
        keep_sites: keep the per-pass sites (for per-example gradients).
        **fisher: the Fisher options of :class:`~leantrain.precond._fisher.FisherMaker`
            (``fisher_type``, ``n_mc_samples``, ``loss_type``, ...).
    """

    def __init__(
        self,
        model: nn.Module,
        config: PreconditioningConfig | None,
        *,
        shapes: tuple[str, ...],
        keep_sites: bool,
        **fisher: Any,
    ) -> None:
        super().__init__(model, config, **fisher)
        inner = unwrap_model(model)
        # The modules left alone are hidden by their parameters, not ignored by
        # name: a name covers its subtree, which may hold selected modules (a ViT's
        # embeddings own the class token and hold the patch convolution).
        with hidden_parameters(inner, {name for name, _ in self.modules()}):
            self._collector = _SiteCollector(
                inner,
                shapes=shapes or ("diag",),
                # BatchNorm in training mode: batch statistics treated as constants.
                allow_batch_coupling=True,
                check_gradients=False,  # the check costs a per-example pass a step
            )
        self._collector.accumulate_stats = bool(shapes)
        self._collector.keep_sites = keep_sites
        self.ops: dict[str, ModuleOp] = self._collector.ops
        # Filled by each curvature pass, consumed by update_curvature.
        self._stats: dict[str, dict] = {}
        self._full: Tensor | None = None
        self._sites: list[dict[str, list]] = []

    # True for makers whose curvature couples every module (one Gram matrix or one
    # full Fisher over all of them): a process holding part of the layers cannot.
    couples_modules = False
    scales_loss = True
    records_in_loop = True

    def _accumulation_refusal(self) -> str | None:
        if self._collector.keep_sites:
            return "it keeps the per-example gradients of one batch"
        return None

    def flat_index(self) -> Tensor:
        """Positions of the selected modules' parameters in the collector's flat
        vector, module by module (the order of :meth:`read_flat`)."""
        return torch.cat([self._collector.index[name] for name in self.ops])

    def _curvature_pass(self) -> tuple[Any, Tensor]:
        inner = unwrap_model(self.model)
        fn = self._unwrapped_call()  # the gradient is averaged below
        params = [p for p in inner.parameters() if p.requires_grad]
        collector = self._collector
        partial = evaluation.partial_count()
        with torch.enable_grad(), collector:
            output = self._call_model(fn)
            if self.couples_modules and evaluation.partial_count() != partial:
                raise RuntimeError(
                    f"{type(self).__name__} couples the curvature of all layers, but "
                    "this process ran only its own layers of a distributed "
                    "LayerParallel stack (parallelize()); use a layer-wise maker "
                    "(K-FAC, EKFAC, Shampoo, SENG, NaturalGradientMaker with shape "
                    "'layer', 'unit' or 'diag') or run the stack in one process"
                )
            loss = self._loss_from_output(output)
            logits = self._logits(output)
            emp = self.fisher_type == "fisher_emp"
            grads = torch.autograd.grad(
                loss,
                params + ([logits] if emp else []),
                retain_graph=True,
                allow_unused=True,
            )
            self._add_grads(params, list(grads[: len(params)]))
            emp_vector = grads[-1] / self._loss_scale if emp else None
            collector.accumulate(logits, self._vectors(logits, emp_vector))
        if collector.accumulate_stats:
            self._stats = collector.statistics()
            full = collector.full
            if full is not None:
                index = self.flat_index()
                full = full[index.unsqueeze(-1), index.unsqueeze(-2)]
            self._full = full
        self._sites = collector.sites
        collector.reset()
        return output, loss.detach()

    # -- gradients in flat and canonical layout -----------------------------------
    def read_flat(self, name: str) -> Tensor | None:
        """Module ``name``'s gradient, flat in its parameter order (``None``: none)."""
        op = self.ops[name]
        grads = [p.grad for p in op.params]
        if all(g is None for g in grads):
            return None
        return torch.cat(
            [
                (g if g is not None else torch.zeros_like(p)).reshape(-1)
                for p, g in zip(op.params, grads, strict=True)
            ]
        )

    def write_flat(self, name: str, flat: Tensor) -> None:
        """Write a flat module gradient back into ``.grad`` (in place when present)."""
        op = self.ops[name]
        for p, piece in zip(
            op.params, flat.split([p.numel() for p in op.params]), strict=True
        ):
            piece = piece.reshape(p.shape).to(p.dtype)
            if p.grad is None:
                p.grad = piece.clone()
            else:
                p.grad.copy_(piece)
