r"""SENG: sketched empirical natural gradient (Yang, Xu, Wen, Chen, Xu, 2022).

Per module ``m`` (layer-wise, block-diagonal), with the per-example gradients of the
batch as the columns of ``U_m`` (scaled so ``F_m = U_m U_m^T`` is the empirical Fisher
of the loss as reduced), SENG solves :math:`(F_m + \lambda I)^{-1} g_m` by
Sherman–Morrison–Woodbury on a *sketch* of ``U_m``:

* **sketching over examples** (``sketching_size`` ``s``): when the batch has more than
  ``s`` examples, ``s`` of them are drawn without replacement (the same ones for
  every module) and scaled by ``sqrt(N / s)``, an unbiased estimate of ``F_m``;
* **truncated rank** (``truncated_rank`` ``k``): of the Gram matrix
  ``K_m = U_m^T U_m = V Σ V^T`` only the top ``k`` eigenpairs are kept, which is the
  best rank-``k`` part of ``F_m``: ``W = U_m V_k`` has ``W W^T`` = the top-``k``
  eigen-part of ``F_m``, and

.. math::  (W W^\top + \lambda I)^{-1} g
           = \frac{1}{\lambda}\bigl(g - U_m V_k (\lambda I + \Sigma_k)^{-1}
             V_k^\top U_m^\top g\bigr).

With ``s >= N`` and ``k >= N`` (or ``None``) this is the exact layer-wise empirical
natural gradient. Linear layers never form ``U_m`` (``K = (E E^T) ⊙ (A A^T)``);
LayerNorm / BatchNorm gradients are per-example gradients of the loss as reduced (ASDL
leaves them multiplied by the batch size).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from leantrain.precond._checks import check_extra_state
from leantrain.precond._kron import read_canonical, write_canonical
from leantrain.precond._smw import WoodburyMaker
from leantrain.precond.curv import robust_eigh
from leantrain.precond.fisher_options import FisherOptions
from leantrain.precond.preconditioned import PreconditioningConfig

__all__ = ["SengGradientMaker"]


class SengGradientMaker(WoodburyMaker):
    r"""Layer-wise empirical natural gradient, sketched over examples, rank-truncated.

    Curvature steps keep the per-example gradients (of a random subset of
    ``sketching_size`` examples of the union batch when it is larger);
    preconditioner steps eigendecompose each module's ``N x N`` Gram matrix and keep
    the top ``truncated_rank`` eigenpairs; every step applies the formula of the
    module docstring to each module's ``.grad``.

    Args:
        model: the module to train (plain or ``DistributedDataParallel``).
        config: schedule and damping :math:`\lambda`; ``ema_decay`` must be ``None``.
        sketching_size: examples kept per curvature update (>= 1).
        truncated_rank: eigenpairs kept per module (>= 1), ``None`` for all.
        fisher: the loss, its reduction, ``logits_fn`` and ``seed``
            (:class:`~leantrain.precond.FisherOptions`); the Fisher is the
            empirical one (``fisher_type="fisher_emp"``, fixed).
        **fisher_kwargs: those fields as keywords, overriding ``fisher``'s.

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from leantrain.precond import PreconditioningConfig
        >>> from leantrain.precond.methods.seng import SengGradientMaker
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
        ...                             torch.nn.Linear(8, 3))
        >>> gm = SengGradientMaker(model, PreconditioningConfig(damping=1e-2),
        ...                        sketching_size=8, truncated_rank=4)
        >>> y = gm.setup_model_call(model, torch.randn(16, 4))
        >>> gm.setup_loss_call(F.cross_entropy, y, torch.randint(0, 3, (16,)))
        >>> output, loss = gm.forward_and_backward()
        >>> gm.eigen["0"][1].shape  # (sketched examples, kept rank)
        torch.Size([8, 4])
    """

    def __init__(
        self,
        model: nn.Module,
        config: PreconditioningConfig | None = None,
        *,
        fisher: FisherOptions | None = None,
        sketching_size: int = 256,
        truncated_rank: int | None = 16,
        **fisher_kwargs: Any,
    ) -> None:
        for name, value in (
            ("sketching_size", sketching_size),
            ("truncated_rank", truncated_rank),
        ):
            if value is None and name == "truncated_rank":
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.sketching_size = sketching_size
        self.truncated_rank = truncated_rank
        # Per module: (1 / (lambda + sigma_k), V_k) of its sketched Gram matrix.
        self.eigen: dict[str, tuple[Tensor, Tensor]] = {}
        super().__init__(
            model,
            config,
            fisher=fisher,
            **fisher_kwargs,
        )

    def update_curvature(self) -> None:
        """Per-example gradients of the (union) batch, sketched over examples."""
        super().update_curvature()
        if not self.factors:
            return
        first = next(iter(self.factors.values()))
        n = first.n
        if self.sketching_size >= n:
            return
        device = next(iter(first.tensors().values())).device
        keep = torch.randperm(n, generator=self.generators.on(device), device=device)[
            : self.sketching_size
        ]
        scale = math.sqrt(n / self.sketching_size)  # unbiased: E[F_sketch] = F
        self.factors = {
            name: f.map(lambda t: t[keep]).scaled(scale)
            for name, f in self.factors.items()
        }

    def update_preconditioner(self) -> None:
        """Top ``truncated_rank`` eigenpairs of each module's Gram matrix."""
        lam = self.config.damping
        eigen = {}
        for name, f in self.factors.items():
            values, vectors = robust_eigh(f.gram())  # ascending
            k = values.shape[0] if self.truncated_rank is None else self.truncated_rank
            values, vectors = values[-k:], vectors[:, -k:]
            eigen[name] = (1.0 / (lam + values.clamp_min(0.0)), vectors)
        self.eigen = eigen

    @torch.no_grad()
    def precondition(self) -> None:
        """``.grad`` of each module ← its (possibly stale) SENG direction."""
        lam = self.config.damping
        for name, (inv_values, vectors) in self.eigen.items():
            op = self.ops[name]
            g = read_canonical(op)
            if g is None:
                continue
            f = self.factors[name]
            coeff = vectors @ (inv_values * (vectors.T @ f.ut(g)))
            write_canonical(op, (g - f.u(coeff).to(g.dtype)) / lam)

    def _extra_state(self) -> dict[str, Any]:
        eigen = {}
        for name, (inv_values, vectors) in self.eigen.items():
            eigen[f"{name}/inv_values"], eigen[f"{name}/vectors"] = inv_values, vectors
        return {
            "factors": self._factor_state(),
            "eigen": eigen,
            "generator": self._generator_state(),
        }

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        check_extra_state(state, ("factors", "eigen", "generator"))
        eigen: dict[str, dict[str, Tensor]] = {}
        for key, value in state["eigen"].items():
            name, _, part = key.rpartition("/")
            if name not in self.ops or part not in ("inv_values", "vectors"):
                raise ValueError(f"eigen entry {key!r} names no preconditioned module")
            if not isinstance(value, Tensor):
                raise TypeError(f"state['extra']['eigen'][{key!r}] must be a tensor")
            eigen.setdefault(name, {})[part] = value.clone()
        self._load_factor_state(state["factors"])
        self.eigen = {n: (p["inv_values"], p["vectors"]) for n, p in eigen.items()}
        self.generators.set_state(state["generator"])
