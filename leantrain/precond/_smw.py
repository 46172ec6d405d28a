r"""Per-example gradients of one module, kept implicitly, for Sherman–Morrison–Woodbury.

With per-example gradients as the columns of ``U`` (``P x N``), an empirical Fisher
``F = U U^T`` is inverted through the ``N x N`` Gram matrix ``K = U^T U``:

.. math::  (U U^\top + \lambda I)^{-1} g = \frac{1}{\lambda}
           \bigl(g - U (\lambda I + U^\top U)^{-1} U^\top g\bigr).

Only three products with ``U`` are needed: the Gram ``U^T U``, ``U^T g`` and ``U c``.
:class:`ExampleGrads` provides them for one module in the curvature layer's canonical
layout (``(R, U)`` per example). For a linear map without weight sharing (``Linear``
on ``(N, in)``, one site) the per-example gradient is the outer product ``e_n a_n^T``
and nothing ``N x P`` is formed: ``K = (E E^T) ⊙ (A A^T)``, ``U^T g = rowsum((E G) ⊙
A)``, ``U c = E^T diag(c) A``. Other modules (convolutions, sequences, norms,
attention) keep their per-example gradients ``(N, R, U)`` explicitly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from leantrain.precond._hooked import HookedMaker, all_gather_rows
from leantrain.precond.curv._conv1d import Conv1dOp
from leantrain.precond.curv.modules import LinearFormOp, ModuleOp
from leantrain.precond.preconditioned import PreconditioningConfig

__all__ = ["ExampleGrads", "WoodburyMaker", "example_grads", "merge_passes"]


@dataclass
class ExampleGrads:
    """Per-example canonical gradients of one module, as ``e a^T`` or explicitly.

    Attributes:
        e: ``(N, R)`` output-gradients (outer form) or ``None``.
        a: ``(N, U)`` inputs with a trailing 1 for the bias (outer form) or ``None``.
        dense: ``(N, R, U)`` per-example gradients (explicit form) or ``None``.
    """

    e: Tensor | None = None
    a: Tensor | None = None
    dense: Tensor | None = None

    @property
    def n(self) -> int:
        return (self.e if self.dense is None else self.dense).shape[0]

    def tensors(self) -> dict[str, Tensor]:
        return {
            k: v
            for k, v in (("e", self.e), ("a", self.a), ("dense", self.dense))
            if v is not None
        }

    def map(self, fn) -> ExampleGrads:
        """Apply ``fn`` to every tensor (a row subset, a scale, a gather)."""
        return ExampleGrads(**{k: fn(v) for k, v in self.tensors().items()})

    def scaled(self, factor: float) -> ExampleGrads:
        """``U * factor`` (the outer form scales ``e`` only)."""
        if self.dense is not None:
            return ExampleGrads(dense=self.dense * factor)
        return ExampleGrads(e=self.e * factor, a=self.a)

    def gathered(self, group) -> ExampleGrads:
        """The examples of every rank of ``group``, in rank order."""
        return self.map(lambda t: all_gather_rows(t, group))

    def gram(self) -> Tensor:
        """``K = U^T U`` (``N x N``)."""
        if self.dense is not None:
            flat = self.dense.reshape(self.n, -1)
            return flat @ flat.T
        return (self.e @ self.e.T) * (self.a @ self.a.T)

    def ut(self, g: Tensor) -> Tensor:
        """``U^T g`` (``N``) for a canonical ``(R, U)`` gradient ``g``."""
        if self.dense is not None:
            return self.dense.reshape(self.n, -1) @ g.reshape(-1).to(self.dense.dtype)
        return ((self.e @ g.to(self.e.dtype)) * self.a).sum(1)

    def u(self, c: Tensor) -> Tensor:
        """``U c`` as a canonical ``(R, U)`` matrix for coefficients ``c`` (``N``)."""
        if self.dense is not None:
            return torch.einsum("n,nru->ru", c, self.dense)
        return (self.e * c.unsqueeze(1)).T @ self.a


def example_grads(op: ModuleOp, sites: list) -> ExampleGrads:
    """Per-example gradients of one backward pass from the collector's sites.

    ``sites`` are what the collector combined for ``op`` in that pass; the scaling is
    that of the back-propagated vector (``sqrt(r) * grad l_n`` for the empirical
    Fisher, so ``U U^T`` is the Fisher of the loss as reduced).
    """
    single = len(sites) == 1 and sites[0].a.shape[1] == 1
    # Float inputs (not an embedding's ids): a Conv1D is transposed only in storage.
    floats = isinstance(op, LinearFormOp) and (
        not op.transposed or isinstance(op, Conv1dOp)
    )
    if single and floats:
        site = sites[0]
        a = site.a[:, 0]
        if op.has_bias:
            a = torch.cat([a, a.new_ones(a.shape[0], 1)], dim=1)
        return ExampleGrads(e=site.e[:, 0], a=a)
    n = op.n_examples(sites)
    return ExampleGrads(dense=op.per_example(sites, slice(0, n)))


def merge_passes(per_pass: list[ExampleGrads]) -> ExampleGrads:
    """Several backward vectors (e.g. Monte-Carlo draws) are extra columns of ``U``."""
    if len(per_pass) == 1:
        return per_pass[0]
    keys = per_pass[0].tensors().keys()
    return ExampleGrads(
        **{k: torch.cat([p.tensors()[k] for p in per_pass], dim=0) for k in keys}
    )


class WoodburyMaker(HookedMaker):
    """Base of SMW-NG and SENG: empirical-Fisher per-example gradients per module.

    Curvature steps keep, per module, the per-example gradients of the last batch
    (:class:`ExampleGrads`, scaled so that ``U U^T`` is the empirical Fisher of the
    loss as reduced); under ``DistributedDataParallel`` they are gathered from every
    rank (and scaled by ``1/sqrt(world size)``), so every rank holds the union batch.
    A low-rank ``U U^T`` has no meaningful running average, so ``ema_decay`` must be
    ``None``.
    """

    fixed_fisher = {"fisher_type": "fisher_emp", "n_mc_samples": 1}

    def __init__(
        self,
        model: nn.Module,
        config: PreconditioningConfig | None = None,
        **fisher: Any,
    ) -> None:
        if config is not None and getattr(config, "ema_decay", None) is not None:
            raise ValueError(
                f"{type(self).__name__} keeps the per-example gradients of one batch "
                f"(a low-rank Fisher U U^T): ema_decay={config.ema_decay} cannot be "
                "applied; use ema_decay=None"
            )
        # Per module name: the per-example gradients of the last curvature batch.
        self.factors: dict[str, ExampleGrads] = {}
        super().__init__(
            model,
            config,
            shapes=(),
            keep_sites=True,
            **fisher,
        )

    def update_curvature(self) -> None:
        """Per-example gradients of this batch (of the union batch under DDP)."""
        group = self._process_group()
        factors = {}
        for name, op in self.ops.items():
            passes = [example_grads(op, s[name]) for s in self._sites if name in s]
            if not passes:
                continue  # the module saw no gradient
            f = merge_passes(passes)
            if group is not None:
                world = dist.get_world_size(group)
                f = f.gathered(group).scaled(1.0 / math.sqrt(world))
            factors[name] = f
        self.factors = factors
        self._sites = []

    def _factor_state(self) -> dict[str, Tensor]:
        return {
            f"{name}/{key}": t
            for name, f in self.factors.items()
            for key, t in f.tensors().items()
        }

    def _load_factor_state(self, state: Any) -> None:
        if not isinstance(state, dict) or not all(
            isinstance(v, Tensor) for v in state.values()
        ):
            raise TypeError("state['extra']['factors'] must map names to tensors")
        parts: dict[str, dict[str, Tensor]] = {}
        for key, value in state.items():
            name, _, part = key.rpartition("/")
            if name not in self.ops or part not in ("e", "a", "dense"):
                raise ValueError(f"factor {key!r} names no preconditioned module")
            parts.setdefault(name, {})[part] = value.clone()
        self.factors = {name: ExampleGrads(**p) for name, p in parts.items()}
