r"""Damped Newton: :math:`(H + \lambda I)^{-1} g` with the exact Hessian.

The Hessian of the loss with respect to the selected parameters is formed densely
(one batched Hessian-vector product per parameter, the curvature layer's routine), so
this is for small models: more than ``max_params`` parameters are rejected when the
maker is built. With ``absolute=True`` the eigenvalues are replaced by their absolute
values, :math:`(|H| + \lambda I)^{-1} g` with :math:`|H| = Q |\Lambda| Q^\top`
(saddle-free Newton, Dauphin et al. 2014), which is positive definite for any
:math:`\lambda > 0`. Without it, an eigenvalue near :math:`-\lambda` makes the step
blow up: choose :math:`\lambda` above the most negative eigenvalue.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from leantrain.precond._autograd_maker import AutogradMaker
from leantrain.precond._checks import check_extra_state
from leantrain.precond.curv import robust_eigh
from leantrain.precond.curv.api import _hessian_columns
from leantrain.precond.curv.linalg import symmetrize
from leantrain.precond.preconditioned import PreconditioningConfig

__all__ = ["NewtonGradientMaker", "newton_direction"]


def newton_direction(
    hessian: Tensor, grad: Tensor, damping: float, *, absolute: bool = False
) -> Tensor:
    r"""Reference: :math:`(f(H) + \lambda I)^{-1} g`, ``f`` the identity or ``|.|``."""
    values, vectors = torch.linalg.eigh(symmetrize(hessian))
    values = values.abs() if absolute else values
    return vectors @ ((vectors.T @ grad) / (values + damping))


class NewtonGradientMaker(AutogradMaker):
    r"""Damped Newton (optionally with absolute eigenvalues) on a small model.

    Curvature steps differentiate the gradient once more (the same forward yields the
    loss gradient) and form the dense Hessian of the selected parameters, averaged
    over the DDP group; preconditioner steps eigendecompose it; every step applies
    :math:`Q (f(\Lambda) + \lambda)^{-1} Q^\top` to the flat gradient.

    Args:
        model: the module to train (plain or ``DistributedDataParallel``); any
            module owning parameters is handled.
        config: schedule, damping :math:`\lambda`, EMA decay, ignored modules.
        absolute: use :math:`|H|` (eigenvalues by absolute value).
        max_params: the largest number of selected parameters accepted.

    Raises:
        ValueError: more than ``max_params`` selected parameters.

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from leantrain.precond import PreconditioningConfig
        >>> from leantrain.precond.methods.newton import NewtonGradientMaker
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
        ...                             torch.nn.Linear(8, 3))
        >>> gm = NewtonGradientMaker(model, PreconditioningConfig(damping=1e-1),
        ...                          absolute=True)
        >>> y = gm.setup_model_call(model, torch.randn(16, 4))
        >>> gm.setup_loss_call(F.cross_entropy, y, torch.randint(0, 3, (16,)))
        >>> output, loss = gm.forward_and_backward()
        >>> gm.hessian.shape
        torch.Size([67, 67])
    """

    def __init__(
        self,
        model: nn.Module,
        config: PreconditioningConfig | None = None,
        *,
        absolute: bool = False,
        max_params: int = 8192,
    ) -> None:
        if not isinstance(absolute, bool):
            raise TypeError(f"absolute must be a bool, got {absolute!r}")
        if isinstance(max_params, bool) or not isinstance(max_params, int):
            raise TypeError(f"max_params must be an int, got {max_params!r}")
        self.absolute = absolute
        self.hessian: Tensor | None = None
        self.inverse: Tensor | None = None
        self._collected: Tensor | None = None
        super().__init__(model, config)
        size = sum(p.numel() for p in self.selected_parameters())
        if size > max_params:
            raise ValueError(
                f"NewtonGradientMaker forms a dense {size}x{size} Hessian; {size} "
                f"parameters exceed max_params={max_params}. Use "
                "HessianFreeGradientMaker (matrix-free) or raise max_params."
            )

    def _curvature_pass(self) -> tuple[Any, Tensor]:
        output, loss, flat, selected = self._graph_pass(create_graph=True)
        hessian = symmetrize(_hessian_columns(flat, selected)).detach()
        self._all_reduce_mean([hessian])
        self._collected = hessian
        return output, loss.detach()

    def update_curvature(self) -> None:
        """Fold this batch's Hessian into the (EMA) estimate."""
        self.hessian = self._ema_update("hessian", self._collected)
        self._collected = None

    def update_preconditioner(self) -> None:
        r""":math:`Q (f(\Lambda) + \lambda)^{-1} Q^\top` from ``eigh`` of ``H``."""
        values, vectors = robust_eigh(self.hessian)
        values = values.abs() if self.absolute else values
        self.inverse = (vectors / (values + self.config.damping)) @ vectors.T

    @torch.no_grad()
    def precondition(self) -> None:
        """Flat selected ``.grad`` ← (possibly stale) inverse times it."""
        if self.inverse is None:
            return
        g = self.read_flat()
        if g is not None:
            self.write_flat(self.inverse.to(g.dtype) @ g)

    def _extra_state(self) -> dict[str, Any]:
        return {"hessian": self.hessian, "inverse": self.inverse}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        check_extra_state(state, ("hessian", "inverse"))
        for key, value in state.items():
            if value is not None and not isinstance(value, Tensor):
                raise TypeError(f"state['extra'][{key!r}] must be a tensor or None")
        self.hessian = None if state["hessian"] is None else state["hessian"].clone()
        self.inverse = None if state["inverse"] is None else state["inverse"].clone()
