r"""Kronecker-factored PSGD (Li, 2018, "Preconditioner on matrix Lie group for SGD").

Each layer's canonical gradient matrix ``G`` (``(out, in [+1])``: weight rows with
the bias as last column) is preconditioned by ``P = P_l ⊗ P_r`` with
``P_l = Q_l^T Q_l`` and ``P_r = Q_r^T Q_r``, ``Q_l, Q_r`` upper triangular:
``G ← Q_l^T Q_l G Q_r^T Q_r``.

**Fitting rule.** ``P`` is fitted online to pairs ``(dX, dG)`` of a parameter
perturbation and the matching gradient perturbation, minimising
``E[dG^T P dG + dX^T P^{-1} dX]``, whose minimiser satisfies
``P E[dG dG^T] P = E[dX dX^T]``. With ``A = Q_l dG Q_r^T`` and
``B = Q_l^{-T} dX Q_r^{-1}`` each preconditioner step moves along the Lie group of
upper-triangular matrices with a normalised step:

.. math::
    Q_l \leftarrow Q_l - \frac{\mu}{\max|\nabla_l|} \nabla_l Q_l,\quad
    \nabla_l = \mathrm{triu}(A A^\top - B B^\top),

and the same for ``Q_r`` with ``\nabla_r = \mathrm{triu}(A^\top A - B^\top B)``;
``μ`` is ``precond_lr`` (the fraction of the way to the local fit taken per step;
0.01–0.1). Before each step the two factors are rebalanced to equal largest
diagonal entries (the Kronecker product is unchanged).

**Pairs** (``mode``):

* ``"hvp"`` (Li 2018's Newton-type PSGD, the default): ``dX = v ~ N(0, I)``,
  ``dG = H v``, a Hessian-vector product of the loss (double backward on the
  curvature steps), so ``P → H^{-1}`` (for a Kronecker-factored Hessian exactly;
  otherwise its Kronecker fit).
* ``"whitening"``: ``dX = v ~ N(0, I)``, ``dG = g`` the minibatch gradient, so
  ``P → E[g g^T]^{-1/2}`` (gradient whitening; no extra backward).

``config.damping`` is not used (PSGD needs none) and ``config.ema_decay`` must be
``None``: the fit is its own running average.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.linalg import solve_triangular

from leantrain.precond._autograd_maker import twice_differentiable
from leantrain.precond._checks import check_extra_state
from leantrain.precond._coverage import check_one_site
from leantrain.precond._kron import read_canonical, write_canonical
from leantrain.precond._random import DeviceGenerators
from leantrain.precond.curv.modules import is_conv1d, make_op
from leantrain.precond.gradient_maker import unwrap_model
from leantrain.precond.preconditioned import (
    PreconditionedGradientMaker,
    PreconditioningConfig,
)

__all__ = ["PsgdGradientMaker", "psgd_kron_precondition", "psgd_kron_update"]

_TINY = 1.2e-38  # keeps the normalised step finite when a gradient is exactly zero


def psgd_kron_update(
    ql: Tensor, qr: Tensor, dx: Tensor, dg: Tensor, lr: float
) -> tuple[Tensor, Tensor]:
    r"""One fitting step of the Kronecker PSGD preconditioner (pure; new tensors).

    Args:
        ql: ``(m, m)`` upper-triangular left factor.
        qr: ``(n, n)`` upper-triangular right factor.
        dx: ``(m, n)`` parameter perturbation.
        dg: ``(m, n)`` gradient perturbation.
        lr: ``precond_lr`` μ.

    Returns:
        The updated ``(ql, qr)``.
    """
    rho = torch.sqrt(ql.diagonal().max() / qr.diagonal().max())
    ql, qr = ql / rho, qr * rho  # same Kronecker product, balanced factors
    a = ql @ dg @ qr.T
    # B = Q_l^{-T} dX Q_r^{-1}: two triangular solves (Q_l^T is lower triangular).
    b = solve_triangular(ql.T, dx, upper=False)
    b = solve_triangular(qr, b, upper=True, left=False)
    grad_l = torch.triu(a @ a.T - b @ b.T)
    grad_r = torch.triu(a.T @ a - b.T @ b)
    step_l = lr / (grad_l.abs().max() + _TINY)
    step_r = lr / (grad_r.abs().max() + _TINY)
    return ql - step_l * (grad_l @ ql), qr - step_r * (grad_r @ qr)


def psgd_kron_precondition(ql: Tensor, qr: Tensor, grad: Tensor) -> Tensor:
    """``Q_l^T Q_l G Q_r^T Q_r`` (the reference; the maker caches both products)."""
    return ql.T @ ql @ grad @ qr.T @ qr


class PsgdGradientMaker(PreconditionedGradientMaker):
    r"""Kronecker-factored PSGD for Linear and Conv2d layers (module docstring).

    Args:
        model: the module to train (plain or ``DistributedDataParallel``).
        config: schedule and ignored modules; ``ema_decay`` must be ``None``.
        mode: ``"hvp"`` (Hessian-vector products) or ``"whitening"``.
        precond_lr: the normalised fitting step μ in (0, 1].
        init_scale: the preconditioner before the first fit is ``init_scale * I``
            (``Q_l = Q_r = init_scale^{1/4} I``).
        seed: seeds the probe vectors ``v`` (identical on every rank).

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from leantrain.precond.methods.psgd import PsgdGradientMaker
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
        ...                             torch.nn.Linear(8, 3))
        >>> gm = PsgdGradientMaker(model, precond_lr=0.1)
        >>> y = gm.setup_model_call(model, torch.randn(16, 4))
        >>> gm.setup_loss_call(F.cross_entropy, y, torch.randint(0, 3, (16,)))
        >>> _ = gm.forward_and_backward()
        >>> [tuple(q.shape) for q in gm.factors["0"]]
        [(8, 8), (5, 5)]
    """

    skips_frozen = False  # its state is fitted to the parameters it was built with

    def __init__(
        self,
        model: nn.Module,
        config: PreconditioningConfig | None = None,
        *,
        mode: Literal["hvp", "whitening"] = "hvp",
        precond_lr: float = 0.01,
        init_scale: float = 1.0,
        seed: int = 0,
    ) -> None:
        if mode not in ("hvp", "whitening"):
            raise ValueError(f"mode must be 'hvp' or 'whitening', got {mode!r}")
        for key, value in (("precond_lr", precond_lr), ("init_scale", init_scale)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{key} must be a float, got {value!r}")
        if not 0.0 < precond_lr <= 1.0:
            raise ValueError(f"precond_lr must be in (0, 1], got {precond_lr}")
        if not init_scale > 0.0:
            raise ValueError(f"init_scale must be > 0, got {init_scale}")
        if config is not None and getattr(config, "ema_decay", None) is not None:
            raise ValueError(
                f"PsgdGradientMaker fits its own running preconditioner; "
                f"config.ema_decay must be None, got {config.ema_decay}"
            )
        self.mode, self.precond_lr, self.init_scale = (
            mode,
            float(precond_lr),
            init_scale,
        )
        self.generators = DeviceGenerators(seed)
        self.factors: dict[str, list[Tensor]] = {}  # name -> [Q_l, Q_r]
        self.products: dict[str, list[Tensor]] = {}  # name -> [P_l, P_r]
        self._pairs: dict[str, tuple[Tensor, Tensor]] = {}
        super().__init__(model, config)
        self.ops = {name: make_op(name, m) for name, m in self.modules()}
        # Fitted on Hessian-vector products of the whole parameter, a tied weight
        # needs no rule here; two of its modules would precondition it twice.
        check_one_site(
            "PsgdGradientMaker", unwrap_model(model), set(self.ops), warn=None
        )
        for name, op in self.ops.items():
            rows, cols = op.canon_index.shape
            scale = init_scale**0.25
            like = op.params[0].detach()
            # Half-precision layers keep float32 factors: LAPACK's triangular solve
            # has no bf16/fp16, and the fit's small steps would round away there.
            dtype = like.dtype if like.element_size() >= 4 else torch.float32
            self.factors[name] = [
                scale * torch.eye(rows, dtype=dtype, device=like.device),
                scale * torch.eye(cols, dtype=dtype, device=like.device),
            ]
        self._refresh_products()

    def is_supported(self, module: nn.Module) -> bool:
        """Linear (and subclasses), Conv2d and Hugging Face ``Conv1D`` layers with
        trainable parameters."""
        layer = isinstance(module, (nn.Linear, nn.Conv2d)) or is_conv1d(module)
        return layer and any(p.requires_grad for p in module.parameters(recurse=False))

    def _probes(self) -> dict[str, Tensor]:
        return {
            name: torch.randn(
                op.canon_index.shape,
                generator=self.generators.on(op.params[0].device),
                dtype=op.params[0].dtype,
                device=op.params[0].device,
            )
            for name, op in self.ops.items()
        }

    def _curvature_pass(self) -> tuple[Any, Tensor]:
        if self.mode == "whitening":
            output, loss = self._forward_backward()
            probes = self._probes()
            for name, op in self.ops.items():
                g = read_canonical(op)
                if g is not None:
                    self._pairs[name] = (probes[name], g.detach().clone())
            return output, loss
        inner = unwrap_model(self.model)
        fn = self.model_call[0]
        if isinstance(fn, nn.Module) and unwrap_model(fn) is inner:
            fn = inner  # bypass DDP: double backward; we average ourselves
        params = [p for p in inner.parameters() if p.requires_grad]
        with torch.enable_grad(), twice_differentiable():
            output = self._call_model(fn)
            loss = self._loss_from_output(output)
            grads = torch.autograd.grad(
                loss, params, create_graph=True, allow_unused=True
            )
            by_id = {id(p): g for p, g in zip(params, grads, strict=True)}
            probes = self._probes()
            sel_params, sel_grads, tangents = [], [], []
            for name, op in self.ops.items():
                pieces = op.from_canonical(probes[name])
                for p, piece in zip(op.params, pieces, strict=True):
                    if by_id[id(p)] is not None:
                        sel_params.append(p)
                        sel_grads.append(by_id[id(p)])
                        tangents.append(piece.to(p.dtype))
            hvps = torch.autograd.grad(
                sel_grads, sel_params, tangents, allow_unused=True
            )
        grads = [
            torch.zeros_like(p) if g is None else g.detach()
            for p, g in zip(params, grads, strict=True)
        ]
        hv_by_id = {
            id(p): (torch.zeros_like(p) if h is None else h)
            for p, h in zip(sel_params, hvps, strict=True)
        }
        hvs = list(hv_by_id.values())
        self._all_reduce_mean(grads + hvs)
        for p, g in zip(params, grads, strict=True):
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)
        for name, op in self.ops.items():
            if not all(id(p) in hv_by_id for p in op.params):
                continue
            w = op.to_canonical([hv_by_id[id(p)] for p in op.params])
            self._pairs[name] = (probes[name], w)
        return output, loss.detach()

    def update_curvature(self) -> None:
        """Nothing to accumulate: the pair ``(dX, dG)`` of this pass is kept."""

    def update_preconditioner(self) -> None:
        """One fitting step of ``Q_l, Q_r`` per layer on this step's pair."""
        for name, (dx, dg) in self._pairs.items():
            # The factors follow the layer when the model moves after construction.
            ql, qr = (q.to(dg.device) for q in self.factors[name])
            self.factors[name] = list(
                psgd_kron_update(
                    ql, qr, dx.to(ql.dtype), dg.to(ql.dtype), self.precond_lr
                )
            )
        self._pairs = {}
        self._refresh_products()

    def _refresh_products(self) -> None:
        self.products = {
            n: [ql.T @ ql, qr.T @ qr] for n, (ql, qr) in self.factors.items()
        }

    @torch.no_grad()
    def precondition(self) -> None:
        """``.grad`` ← ``P_l G P_r`` per layer (two matmuls)."""
        for name, op in self.ops.items():
            g = read_canonical(op)
            if g is not None:
                pl, pr = self.products[name]
                pl, pr = (p.to(device=g.device, dtype=g.dtype) for p in (pl, pr))
                write_canonical(op, pl @ g @ pr)

    def _extra_state(self) -> dict[str, Any]:
        return {
            "factors": {
                f"{n}/{side}": q
                for n, qs in self.factors.items()
                for side, q in zip("LR", qs, strict=True)
            },
            "generator": self.generators.get_state(),
        }

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        check_extra_state(state, ("factors", "generator"))
        expected = {f"{n}/{s}" for n in self.ops for s in "LR"}
        if set(state["factors"]) != expected:
            raise ValueError(
                f"state['extra']['factors'] must have the keys {sorted(expected)}, "
                f"got {sorted(state['factors'])}"
            )
        self.factors = {
            n: [state["factors"][f"{n}/L"].clone(), state["factors"][f"{n}/R"].clone()]
            for n in self.ops
        }
        self.generators.set_state(state["generator"])
        self._refresh_products()
