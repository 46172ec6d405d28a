r"""Empirical-Fisher natural gradient through Sherman–Morrison–Woodbury (SMW-NG).

With the per-example gradients of a batch of ``N`` as the columns of ``U`` (scaled
so that ``F = U U^T`` is the empirical Fisher of the loss as reduced: ``U U^T / N``
for a mean loss), the natural gradient over *all* preconditioned parameters at once is

.. math::  (U U^\top + \lambda I)^{-1} g
           = \frac{1}{\lambda}\bigl(g - U (\lambda I_N + U^\top U)^{-1} U^\top g\bigr),

an ``N x N`` solve instead of a ``P x P`` one. ``U`` is never formed for linear layers
(see :mod:`leantrain.precond._smw`).

Stability: on the batch that defined ``U`` the gradient lies in the span of ``U``, so
each direction of singular value ``s`` is scaled by ``s / (s^2 + λ) <= 1 / (2 sqrt
λ)``; a gradient of *another* batch (curvature interval > 1) has components outside
that span, which are scaled by ``1/λ``. Use ``curvature_interval=1`` and a damping
around ``1e-2`` to ``1e-1`` with a learning rate around ``0.1``-``0.5`` of SGD's (the
benchmark's setting is in ``docs/precond_methods_ng.md``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from leantrain.precond._checks import check_extra_state
from leantrain.precond._kron import read_canonical, write_canonical
from leantrain.precond._smw import WoodburyMaker
from leantrain.precond.curv import cholesky_ex
from leantrain.precond.fisher_options import FisherOptions
from leantrain.precond.preconditioned import PreconditioningConfig

__all__ = ["SmwNgGradientMaker", "smw_natural_gradient"]


def smw_natural_gradient(u: Tensor, grad: Tensor, damping: float) -> Tensor:
    r"""Reference: :math:`(U U^\top + \lambda I)^{-1} g` by SMW for an explicit ``U``.

    Args:
        u: ``(P, N)`` per-example gradients (columns).
        grad: ``(P,)``.
        damping: :math:`\lambda > 0`.
    """
    n = u.shape[1]
    inner = damping * torch.eye(n, dtype=u.dtype, device=u.device) + u.T @ u
    coeff = torch.linalg.solve(inner, u.T @ grad)
    return (grad - u @ coeff) / damping


class SmwNgGradientMaker(WoodburyMaker):
    r"""Natural gradient with the empirical Fisher of the batch, solved by SMW.

    Curvature steps keep the per-example gradients of the batch (implicitly as
    ``e a^T`` for linear layers); preconditioner steps factor
    :math:`\lambda I_N + U^\top U` (Cholesky, ``N x N`` summed over modules); every
    step applies the formula of the module docstring to ``.grad`` (with the last
    ``U``: see the stability note there). Under ``DistributedDataParallel`` ``U`` is
    gathered from every rank, so the result is that of the union batch.

    Args:
        model: the module to train (plain or ``DistributedDataParallel``).
        config: schedule and damping :math:`\lambda`; ``ema_decay`` must be ``None``.
        fisher: the loss, its reduction, ``logits_fn`` and ``seed``
            (:class:`~leantrain.precond.FisherOptions`); the Fisher is the
            empirical one (``fisher_type="fisher_emp"``, fixed).
        **fisher_kwargs: those fields as keywords, overriding ``fisher``'s.

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from leantrain.precond import PreconditioningConfig
        >>> from leantrain.precond.methods.smw_ng import SmwNgGradientMaker
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
        ...                             torch.nn.Linear(8, 3))
        >>> gm = SmwNgGradientMaker(model, PreconditioningConfig(damping=1e-2))
        >>> y = gm.setup_model_call(model, torch.randn(16, 4))
        >>> gm.setup_loss_call(F.cross_entropy, y, torch.randint(0, 3, (16,)))
        >>> output, loss = gm.forward_and_backward()
        >>> gm.cholesky.shape
        torch.Size([16, 16])
    """

    couples_modules = True  # one N x N system summed over every module

    def __init__(
        self,
        model: nn.Module,
        config: PreconditioningConfig | None = None,
        *,
        fisher: FisherOptions | None = None,
        **fisher_kwargs: Any,
    ) -> None:
        # Cholesky factor of lambda I_N + U^T U (summed over modules).
        self.cholesky: Tensor | None = None
        super().__init__(
            model,
            config,
            fisher=fisher,
            **fisher_kwargs,
        )

    def update_preconditioner(self) -> None:
        r"""Factor :math:`\lambda I_N + \sum_m U_m^\top U_m`."""
        if not self.factors:
            self.cholesky = None
            return
        gram = sum(f.gram() for f in self.factors.values())
        gram.diagonal().add_(self.config.damping)
        factor, info = cholesky_ex(gram)
        if int(info) != 0:  # rounding made it indefinite: retry in float64
            factor = torch.linalg.cholesky(gram.double()).to(gram.dtype)
        self.cholesky = factor

    @torch.no_grad()
    def precondition(self) -> None:
        """``.grad`` of every module ← the SMW natural gradient (an ``N x N`` solve)."""
        if self.cholesky is None:
            return
        grads = {}
        for name in self.factors:
            g = read_canonical(self.ops[name])
            if g is not None:
                grads[name] = g
        if not grads:
            return
        z = sum(self.factors[n].ut(g) for n, g in grads.items())
        c = torch.cholesky_solve(z.unsqueeze(1), self.cholesky).squeeze(1)
        lam = self.config.damping
        for name, g in grads.items():
            update = (g - self.factors[name].u(c).to(g.dtype)) / lam
            write_canonical(self.ops[name], update)

    def _extra_state(self) -> dict[str, Any]:
        return {"factors": self._factor_state(), "cholesky": self.cholesky}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        check_extra_state(state, ("factors", "cholesky"))
        chol = state["cholesky"]
        if chol is not None and not isinstance(chol, Tensor):
            raise TypeError(
                f"state['extra']['cholesky'] must be a tensor, got {chol!r}"
            )
        self._load_factor_state(state["factors"])
        self.cholesky = None if chol is None else chol.clone()
