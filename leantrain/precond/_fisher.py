r"""What every Fisher-based maker shares: its options and its backward vectors.

K-FAC / EKFAC (:mod:`~leantrain.precond._kron`) and the hook-based natural-gradient
family (:mod:`~leantrain.precond._hooked`) run the same curvature pass: one forward
through the *unwrapped* model, the loss gradient from that graph, then the Fisher
vectors of ``fisher_type`` back-propagated from the logits. :class:`FisherMaker`
holds the options of that pass (validated once, here), the Monte-Carlo generator
and the pieces of the pass both families call; how the curvature is collected
stays with the subclass.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from leantrain.precond._random import DeviceGenerators
from leantrain.precond.curv import as_loss_spec, output_vectors
from leantrain.precond.curv.kinds import reduction_factor
from leantrain.precond.curv.modules import is_supported_module
from leantrain.precond.fisher_options import FISHER_TYPES, FisherOptions
from leantrain.precond.gradient_maker import unwrap_model
from leantrain.precond.preconditioned import (
    PreconditionedGradientMaker,
    PreconditioningConfig,
)

__all__ = ["FISHER_TYPES", "FisherMaker", "default_logits"]


def default_logits(output: Any) -> Tensor:
    """The logits in a model output: the tensor itself, ``output[0]`` of a tuple or
    list, ``output["logits"]`` of a dict, or ``output.logits``."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
        return output[0]
    if isinstance(output, dict) and isinstance(output.get("logits"), Tensor):
        return output["logits"]
    if isinstance(getattr(output, "logits", None), Tensor):
        return output.logits
    raise TypeError(
        f"cannot find the logits in a model output of type {type(output).__name__}; "
        "pass logits_fn=lambda output: ... to the maker"
    )


def add_grads(
    all_reduce_mean: Callable[[list[Tensor]], None],
    params: list[Tensor],
    grads: list,
) -> None:
    """Averages ``grads`` (None: zeros) with ``all_reduce_mean`` and adds them to
    the parameters' ``.grad``, in place where one exists: DDP may hold ``.grad``
    as a view of its buckets."""
    grads = [
        torch.zeros_like(p) if g is None else g
        for p, g in zip(params, grads, strict=True)
    ]
    all_reduce_mean(grads)
    for p, g in zip(params, grads, strict=True):
        if p.grad is None:
            p.grad = g
        else:
            p.grad.add_(g)


class FisherMaker(PreconditionedGradientMaker):
    """Base of the makers whose curvature is a Fisher of the model's logits.

    Args:
        model: the module to train (plain or ``DistributedDataParallel``).
        config: schedule, damping, EMA decay, ignored modules.
        fisher: the Fisher taken (:class:`~leantrain.precond.FisherOptions`).
        **fisher_kwargs: its fields as keywords, overriding ``fisher``'s (the
            constructors' keyword form, folded in by ``FisherOptions.resolve``).
    """

    # FisherOptions fields the method fixes (SMW-NG and SENG: the empirical Fisher).
    fixed_fisher: dict[str, Any] = {}

    def __init__(
        self,
        model: nn.Module,
        config: PreconditioningConfig | None,
        *,
        fisher: FisherOptions | None = None,
        **fisher_kwargs: Any,
    ) -> None:
        self.fisher_options = FisherOptions.resolve(
            fisher, fisher_kwargs, maker=type(self).__name__, fixed=self.fixed_fisher
        )
        # Made on the device of the logits they are drawn for (see _random).
        self.generators = DeviceGenerators(self.fisher_options.seed)
        super().__init__(model, config)

    # The options, read where the pass needs them.
    @property
    def fisher_type(self) -> str:
        return self.fisher_options.fisher_type

    @property
    def n_mc_samples(self) -> int:
        return self.fisher_options.n_mc_samples

    @property
    def loss_type(self) -> str:
        return self.fisher_options.loss_type

    @property
    def loss_reduction(self) -> str:
        return self.fisher_options.loss_reduction

    @property
    def logits_fn(self) -> Callable[[Any], Tensor]:
        return self.fisher_options.logits_fn or default_logits

    def is_supported(self, module: nn.Module) -> bool:
        """Linear (and subclasses), Conv2d, Embedding, LayerNorm, BatchNorm1d/2d,
        MultiheadAttention (its packed ``in_proj``), RMSNorm and Hugging Face
        ``Conv1D``, owning trainable parameters."""
        return is_supported_module(module) and any(
            p.requires_grad for p in module.parameters(recurse=False)
        )

    # -- pieces of the curvature pass ---------------------------------------------
    def _unwrapped_call(self) -> Any:
        """The model call's function, with DDP bypassed: the curvature pass averages
        the gradient (and the curvature) over the group itself."""
        fn = self.model_call[0]
        if isinstance(fn, nn.Module) and unwrap_model(fn) is unwrap_model(self.model):
            return unwrap_model(self.model)
        return fn

    def _logits(self, output: Any) -> Tensor:
        logits = self.logits_fn(output)
        if not isinstance(logits, Tensor) or not logits.requires_grad:
            raise TypeError(
                "logits_fn must return the logits tensor of the model output "
                "(attached to the graph)"
            )
        return logits

    def _add_grads(self, params: list[Tensor], grads: list) -> None:
        """Average ``grads`` over the DDP group and add them to ``.grad``."""
        add_grads(self._all_reduce_mean, params, grads)

    def _vectors(self, logits: Tensor, dlogits: Tensor | None) -> list[Tensor]:
        """The vectors to back-propagate from ``logits`` for ``fisher_type``;
        ``dlogits`` (the loss gradient w.r.t. the logits) serves ``"fisher_emp"``."""
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
                generator=self.generators.on(out.device),
            )
        )

    def _generator_state(self) -> dict[str, Tensor]:
        return self.generators.get_state()
