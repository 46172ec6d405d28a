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

import math
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from leantrain.precond._kron import default_logits
from leantrain.precond.curv import CurvatureCollector, as_loss_spec, output_vectors
from leantrain.precond.curv.kinds import reduction_factor
from leantrain.precond.curv.modules import SUPPORTED_MODULES, ModuleOp
from leantrain.precond.gradient_maker import unwrap_model
from leantrain.precond.preconditioned import (
    PreconditionedGradientMaker,
    PreconditioningConfig,
)

__all__ = ["FISHER_TYPES", "HookedMaker", "all_gather_rows", "check_choice"]

FISHER_TYPES = ("fisher_mc", "fisher_exact", "fisher_emp")


def check_choice(name: str, value: Any, allowed: tuple) -> Any:
    """``value`` if it is one of ``allowed``, else ``ValueError`` naming both."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value


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


class HookedMaker(PreconditionedGradientMaker):
    """Base of the makers whose curvature comes from module hooks (see module doc).

    Args:
        model: the module to train (plain or ``DistributedDataParallel``).
        config: schedule, damping, EMA decay, ignored modules.
        shapes: collector representations to accumulate (may be empty).
        keep_sites: keep the per-pass sites (for per-example gradients).
        fisher_type: ``"fisher_mc"``, ``"fisher_exact"`` or ``"fisher_emp"``.
        n_mc_samples: draws for ``"fisher_mc"`` (averaged).
        loss_type: ``"cross_entropy"`` or ``"mse"``, the likelihood of the Fisher.
        loss_reduction: ``"mean"`` or ``"sum"``, as the loss you compute reduces.
        logits_fn: maps the model output to the logits (batch first).
        seed: seeds the Monte-Carlo draws.
    """

    def __init__(
        self,
        model: nn.Module,
        config: PreconditioningConfig | None,
        *,
        shapes: tuple[str, ...],
        keep_sites: bool,
        fisher_type: Literal["fisher_mc", "fisher_exact", "fisher_emp"],
        n_mc_samples: int = 1,
        loss_type: Literal["cross_entropy", "mse"] = "cross_entropy",
        loss_reduction: Literal["mean", "sum"] = "mean",
        logits_fn: Callable[[Any], Tensor] | None = None,
        seed: int = 0,
    ) -> None:
        check_choice("fisher_type", fisher_type, FISHER_TYPES)
        check_choice("loss_type", loss_type, ("cross_entropy", "mse"))
        check_choice("loss_reduction", loss_reduction, ("mean", "sum"))
        if isinstance(n_mc_samples, bool) or not isinstance(n_mc_samples, int):
            raise TypeError(f"n_mc_samples must be an int, got {n_mc_samples!r}")
        if n_mc_samples < 1:
            raise ValueError(f"n_mc_samples must be >= 1, got {n_mc_samples}")
        if logits_fn is not None and not callable(logits_fn):
            raise TypeError(f"logits_fn must be callable, got {logits_fn!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r}")
        self.fisher_type = fisher_type
        self.n_mc_samples = n_mc_samples
        self.loss_type = loss_type
        self.loss_reduction = loss_reduction
        self.logits_fn = logits_fn or default_logits
        self.generator = torch.Generator().manual_seed(seed)
        super().__init__(model, config)
        inner = unwrap_model(model)
        selected = {name for name, _ in self.modules()}
        ignored = [
            name
            for name, m in inner.named_modules()
            if name not in selected
            and any(p.requires_grad for p in m.parameters(recurse=False))
        ]
        self._collector = _SiteCollector(
            inner,
            shapes=shapes or ("diag",),
            ignore_modules=ignored,
            # BatchNorm in training mode: batch statistics treated as constants.
            allow_batch_coupling=True,
            check_gradients=False,  # the check costs a per-example pass each step
        )
        self._collector.accumulate_stats = bool(shapes)
        self._collector.keep_sites = keep_sites
        self.ops: dict[str, ModuleOp] = self._collector.ops
        # Filled by each curvature pass, consumed by update_curvature.
        self._stats: dict[str, dict] = {}
        self._full: Tensor | None = None
        self._sites: list[dict[str, list]] = []

    def is_supported(self, module: nn.Module) -> bool:
        """Linear (and subclasses), Conv2d, Embedding, LayerNorm, BatchNorm1d/2d and
        MultiheadAttention owning trainable parameters."""
        return isinstance(module, SUPPORTED_MODULES) and any(
            p.requires_grad for p in module.parameters(recurse=False)
        )

    def flat_index(self) -> Tensor:
        """Positions of the selected modules' parameters in the collector's flat
        vector, module by module (the order of :meth:`read_flat`)."""
        return torch.cat([self._collector.index[name] for name in self.ops])

    def _curvature_pass(self) -> tuple[Any, Tensor]:
        inner = unwrap_model(self.model)
        fn = self.model_call[0]
        if isinstance(fn, nn.Module) and unwrap_model(fn) is inner:
            fn = inner  # bypass DDP: the gradient is averaged below
        params = [p for p in inner.parameters() if p.requires_grad]
        collector = self._collector
        with torch.enable_grad(), collector:
            output = self._call_model(fn)
            loss = self._loss_from_output(output)
            logits = self.logits_fn(output)
            if not isinstance(logits, Tensor) or not logits.requires_grad:
                raise TypeError(
                    "logits_fn must return the logits tensor of the model output "
                    "(attached to the graph)"
                )
            emp = self.fisher_type == "fisher_emp"
            grads = torch.autograd.grad(
                loss,
                params + ([logits] if emp else []),
                retain_graph=True,
                allow_unused=True,
            )
            self._add_grads(params, list(grads[: len(params)]))
            collector.accumulate(logits, self._vectors(logits, grads[-1]))
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

    def _add_grads(self, params: list[Tensor], grads: list) -> None:
        grads = [
            torch.zeros_like(p) if g is None else g
            for p, g in zip(params, grads, strict=True)
        ]
        self._all_reduce_mean(grads)
        for p, g in zip(params, grads, strict=True):
            if p.grad is None:
                p.grad = g
            else:  # in place: DDP may hold .grad as a view of its buckets
                p.grad.add_(g)

    def _vectors(self, logits: Tensor, dlogits: Tensor | None) -> list[Tensor]:
        spec = as_loss_spec(self.loss_type)
        spec = type(spec)(spec.name, self.loss_reduction)
        out = logits.detach()
        if spec.name == "cross_entropy":
            targets = torch.zeros(out.shape[:-1], dtype=torch.long, device=out.device)
        else:
            targets = torch.zeros_like(out)
        if self.fisher_type == "fisher_emp":
            if dlogits is None:
                raise ValueError("the loss does not depend on the logits")
            # The loss gradient is r * grad(l_n); the empirical Fisher wants sqrt(r).
            r = reduction_factor(spec, out, targets)
            return [dlogits / math.sqrt(r)]
        return list(
            output_vectors(
                self.fisher_type,
                spec,
                out,
                targets,
                n_mc_samples=self.n_mc_samples,
                generator=self.generator,
            )
        )

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

    def _generator_state(self) -> Tensor:
        return self.generator.get_state()
