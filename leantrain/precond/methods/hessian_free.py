r"""Hessian-free optimization: conjugate gradient on curvature-vector products.

Each step solves :math:`(C + \lambda I) x = g` for the selected parameters with
conjugate gradient (CG), where ``C`` is the generalized Gauss-Newton matrix
(``curvature="ggn"``, :math:`J^\top H_z J` with ``z`` the logits) or the Hessian of
the loss (``curvature="hessian"``) on the current batch, applied matrix-free:

* GGN: :math:`Jv` by the double-backward trick (differentiate :math:`J^\top u` with
  respect to a dummy ``u``), :math:`H_z (Jv)` by a Hessian-vector product of the loss
  in the logits, :math:`J^\top w` by one more backward, all on the graph of the
  step's single forward;
* Hessian: :math:`Hv` by differentiating the gradient (built with ``create_graph``).

CG stops after ``max_iters`` iterations or when :math:`\|r\| \le tol \|g\|`. The
Hessian may be indefinite: on a direction of non-positive curvature CG stops and
returns its current iterate (the gradient itself if that happens at the first
iteration), as truncated Newton methods do. The curvature is the operator of the
current batch, so there is nothing to reuse between steps: the config's intervals
must be 1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor, nn

from leantrain.precond._autograd_maker import AutogradMaker
from leantrain.precond._checks import check_choice
from leantrain.precond._fisher import default_logits
from leantrain.precond.preconditioned import PreconditioningConfig

__all__ = ["HessianFreeGradientMaker", "conjugate_gradient"]


def conjugate_gradient(
    matvec: Callable[[Tensor], Tensor],
    b: Tensor,
    *,
    max_iters: int,
    tol: float,
) -> tuple[Tensor, int]:
    r"""Solve :math:`A x = b` for symmetric ``A`` given as ``matvec``, from ``x = 0``.

    Stops when :math:`\|r\| \le tol \|b\|`, after ``max_iters`` iterations, or at a
    direction ``p`` with :math:`p^\top A p \le 0` (then the current iterate is
    returned, or ``b`` if none was taken yet).

    Returns:
        ``(x, iterations)``.
    """
    x = torch.zeros_like(b)
    r = b.clone()
    p = r.clone()
    rr = r.dot(r)
    threshold = (tol * b.norm()) ** 2
    for k in range(max_iters):
        if rr <= threshold:
            return x, k
        ap = matvec(p)
        curvature = p.dot(ap)
        if curvature <= 0:
            return (b.clone() if k == 0 else x), k
        alpha = rr / curvature
        x = x + alpha * p
        r = r - alpha * ap
        rr_new = r.dot(r)
        p = r + (rr_new / rr) * p
        rr = rr_new
    return x, max_iters


class HessianFreeGradientMaker(AutogradMaker):
    r"""Hessian-free (truncated Newton) gradients: CG on GGN or Hessian products.

    Args:
        model: the module to train (plain or ``DistributedDataParallel``; the
            curvature products are averaged over the group at every CG iteration, so
            every rank solves the union-batch system).
        config: damping :math:`\lambda` and ignored modules; both intervals must be 1
            and ``warmup_steps`` / ``ema_decay`` are irrelevant.
        curvature: ``"ggn"`` or ``"hessian"``.
        max_iters: CG iterations per step (>= 1).
        tol: relative residual at which CG stops (>= 0).
        logits_fn: maps the model output to the logits ``z`` for ``"ggn"`` (the loss
            must depend on the parameters through ``z`` only).

    Attributes:
        last_iterations: CG iterations of the last step.

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from leantrain.precond import PreconditioningConfig
        >>> from leantrain.precond.methods.hessian_free import HessianFreeGradientMaker
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
        ...                             torch.nn.Linear(8, 3))
        >>> gm = HessianFreeGradientMaker(model, PreconditioningConfig(damping=1e-2),
        ...                               max_iters=5)
        >>> y = gm.setup_model_call(model, torch.randn(16, 4))
        >>> gm.setup_loss_call(F.cross_entropy, y, torch.randint(0, 3, (16,)))
        >>> output, loss = gm.forward_and_backward()
        >>> gm.last_iterations <= 5
        True
    """

    def __init__(
        self,
        model: nn.Module,
        config: PreconditioningConfig | None = None,
        *,
        curvature: Literal["ggn", "hessian"] = "ggn",
        max_iters: int = 20,
        tol: float = 1e-6,
        logits_fn: Callable[[Any], Tensor] | None = None,
    ) -> None:
        self.curvature = check_choice("curvature", curvature, ("ggn", "hessian"))
        if isinstance(max_iters, bool) or not isinstance(max_iters, int):
            raise TypeError(f"max_iters must be an int, got {max_iters!r}")
        if max_iters < 1:
            raise ValueError(f"max_iters must be >= 1, got {max_iters}")
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or tol < 0:
            raise ValueError(f"tol must be a float >= 0, got {tol!r}")
        if logits_fn is not None and not callable(logits_fn):
            raise TypeError(f"logits_fn must be callable, got {logits_fn!r}")
        if config is not None and (
            config.curvature_interval != 1 or config.preconditioner_interval != 1
        ):
            raise ValueError(
                "HessianFreeGradientMaker uses the curvature of the current batch at "
                "every step (there is no stored preconditioner to reuse): "
                "curvature_interval and preconditioner_interval must be 1, got "
                f"{config.curvature_interval} and {config.preconditioner_interval}"
            )
        self.max_iters = max_iters
        self.tol = float(tol)
        self.logits_fn = logits_fn or default_logits
        self.last_iterations = 0
        self._matvec: Callable[[Tensor], Tensor] | None = None
        super().__init__(model, config)

    def _curvature_pass(self) -> tuple[Any, Tensor]:
        hessian = self.curvature == "hessian"
        output, loss, flat, selected = self._graph_pass(create_graph=hessian)
        if hessian:
            local = self._hessian_product(flat, selected)
        else:
            local = self._ggn_product(output, loss, selected)

        def matvec(v: Tensor) -> Tensor:
            out = local(v)
            self._all_reduce_mean([out])  # the union batch's curvature product
            return out

        self._matvec = matvec
        return output, loss.detach()

    def _hessian_product(self, flat: Tensor, selected: list) -> Callable:
        def product(v: Tensor) -> Tensor:
            hv = torch.autograd.grad(
                flat, selected, grad_outputs=v, retain_graph=True, allow_unused=True
            )
            return _flatten(hv, selected)

        return product

    def _ggn_product(self, output: Any, loss: Tensor, selected: list) -> Callable:
        logits = self.logits_fn(output)
        if not isinstance(logits, Tensor) or not logits.requires_grad:
            raise TypeError(
                "logits_fn must return the logits tensor of the model output "
                "(attached to the graph)"
            )
        with torch.enable_grad():
            (dz,) = torch.autograd.grad(loss, logits, create_graph=True)
            dummy = torch.zeros_like(logits, requires_grad=True)
            jt_dummy = torch.autograd.grad(
                logits,
                selected,
                grad_outputs=dummy,
                create_graph=True,
                allow_unused=True,
            )
        live = [
            (g, p) for g, p in zip(jt_dummy, selected, strict=True) if g is not None
        ]
        sizes = [p.numel() for p in selected]

        def product(v: Tensor) -> Tensor:
            pieces = dict(zip(map(id, selected), v.split(sizes), strict=True))
            (jv,) = torch.autograd.grad(
                [g for g, _ in live],
                dummy,
                grad_outputs=[pieces[id(p)].reshape(p.shape) for _, p in live],
                retain_graph=True,
            )
            (hjv,) = torch.autograd.grad(dz, logits, grad_outputs=jv, retain_graph=True)
            jthjv = torch.autograd.grad(
                logits, selected, grad_outputs=hjv, retain_graph=True, allow_unused=True
            )
            return _flatten(jthjv, selected)

        return product

    def update_curvature(self) -> None:
        """Nothing to store: the curvature is applied matrix-free in CG."""

    def update_preconditioner(self) -> None:
        """Nothing to build: CG runs in :meth:`precondition`."""

    def precondition(self) -> None:
        r"""``.grad`` ← CG solution of :math:`(C + \lambda I) x = g`; graph freed."""
        matvec, self._matvec = self._matvec, None
        g = self.read_flat()
        if matvec is None or g is None:
            return
        lam = self.config.damping
        b = g.detach()
        x, self.last_iterations = conjugate_gradient(
            lambda v: matvec(v) + lam * v, b, max_iters=self.max_iters, tol=self.tol
        )
        self.write_flat(x.detach())


def _flatten(grads: tuple, params: list) -> Tensor:
    return torch.cat(
        [
            (g if g is not None else torch.zeros_like(p)).detach().reshape(-1)
            for g, p in zip(grads, params, strict=True)
        ]
    )
