r"""SOAP: Adam in the eigenbasis of Shampoo's factors (Vyas et al., 2024).

A weight's gradient is viewed as a matrix ``G`` (``(out, in)``; a convolution's
``(out, in * kh * kw)``, as Shampoo here and SOAP's ``merge_dims``). SOAP keeps
Shampoo's factors as EMAs, ``L = EMA(G G^T)`` and ``R = EMA(G^T G)``, their
eigenbases ``Q_L`` and ``Q_R``, and runs Adam in the rotated space (arXiv
2409.11321, Algorithm 3):

.. math::
    G' = Q_L^\top G Q_R, \quad
    m \leftarrow \beta_1 m + (1 - \beta_1) G', \quad
    v \leftarrow \beta_2 v + (1 - \beta_2) G'^{\odot 2}, \quad
    \tilde G = \frac{\sqrt{1 - \beta_2^t}}{1 - \beta_1^t}\,
        Q_L \frac{m}{\sqrt{v} + \epsilon} Q_R^\top .

``m`` and ``v`` live in the rotated space, ``v`` per element. A parameter's first
bases come from ``eigh`` (fp32, fp64 retry) of its first factors; every
``preconditioner_interval`` steps after that the bases are refreshed by one power
iteration and a QR warm-started from the previous basis (SOAP's
``get_orthogonal_matrix_QR``): the columns of ``Q`` are sorted by their Rayleigh
quotients ``diag(Q^T L Q)``, largest first, and ``Q <- qr(L Q)``. On a refresh
``m`` is rotated into the new basis and ``v`` is kept, its rows (columns)
permuted as the columns were sorted, as SOAP does. A refresh takes effect after
its step's Adam update, so a gradient is never projected on a basis computed from
itself; for the same reason a parameter's first step (the one that builds its
basis) writes a zero gradient, as SOAP skips it.

A side longer than ``max_precond_dim`` is not rotated (one-sided SOAP); 1-D and
0-D parameters (biases, norm scales) and matrices with both sides too long get
plain Adam in the original basis (SOAP's ``precondition_1d=False``).

**With the optimizer.** The maker writes SOAP's whole update direction
``\tilde G`` (Adam's momentum, normalisation and bias correction included) into
``.grad``; wrap ``torch.optim.SGD(params, lr, weight_decay=wd)`` *without momentum*
to take SOAP's step ``p <- p - lr \tilde G - lr wd p`` (SOAP applies the decay
after the update: the same to first order in ``lr wd``). SOAP's ``lr`` is that
SGD's ``lr`` (3e-3 in SOAP). Momentum or AdamW on top is not SOAP: a second
momentum, or a second elementwise normalisation in the original basis, which
undoes SOAP's per-direction scaling.

SOAP's options are the config's fields where the library has one:
``precondition_frequency`` is ``preconditioner_interval`` (the factors are
updated every ``curvature_interval`` steps, 1 in SOAP), ``shampoo_beta`` is
``ema_decay`` (bias-corrected here; the bases do not depend on the scale) and
``eps`` is ``damping`` (added to ``sqrt(v)`` before dividing).

A step whose gradient is not finite leaves ``m``, ``v`` and Adam's step count as
they were (decided on the device, without a host synchronisation) and writes a
non-finite ``.grad``, for the non-finite policy or the ``GradScaler`` to skip.
Statistics come from the averaged gradient of the ordinary backward (under
``DistributedDataParallel`` the union batch's): no extra communication.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from leantrain.precond._checks import check_extra_state, check_int
from leantrain.precond.curv import robust_eigh
from leantrain.precond.preconditioned import (
    PreconditionedGradientMaker,
    PreconditioningConfig,
)

__all__ = ["SoapGradientMaker", "eigenbasis", "refresh_basis", "rotate", "unrotate"]

Bases = list[Tensor | None]  # [Q_L, Q_R]; None: that side is not rotated


def eigenbasis(stat: Tensor) -> Tensor:
    """Eigenvectors of a symmetric ``stat``, largest eigenvalue first (SOAP's order)."""
    return robust_eigh(stat)[1].flip(-1)


def refresh_basis(stat: Tensor, basis: Tensor) -> tuple[Tensor, Tensor]:
    r"""One power-iteration step and a QR, warm-started from ``basis`` (SOAP).

    The columns of ``basis`` are sorted by their Rayleigh quotients
    :math:`\operatorname{diag}(Q^\top S Q)`, largest first, and the new basis is the
    ``Q`` of ``qr(S Q_sorted)``. Near a converged basis this tracks the eigenvectors
    at two matmuls and a QR instead of an ``eigh``.

    Returns:
        ``(new_basis, order)``: ``order`` is the sorting permutation of the old
        columns (the moments in the rotated space follow it).
    """
    product = stat @ basis
    rayleigh = (basis * product).sum(0)  # diag(Q^T S Q)
    order = torch.argsort(rayleigh, descending=True)
    new, _ = torch.linalg.qr(product[:, order])
    return new, order


def rotate(g: Tensor, bases: Bases) -> Tensor:
    """``Q_L^T G Q_R`` (a side whose basis is ``None`` is left as it is)."""
    left, right = bases
    if left is not None:
        g = left.T @ g
    return g if right is None else g @ right


def unrotate(g: Tensor, bases: Bases) -> Tensor:
    """``Q_L G Q_R^T``: back from the rotated space."""
    left, right = bases
    if left is not None:
        g = left @ g
    return g if right is None else g @ right.T


def _check_betas(betas: Any) -> tuple[float, float]:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"betas must be a pair of floats, got {betas!r}")
    for i, beta in enumerate(betas):
        if isinstance(beta, bool) or not isinstance(beta, (int, float)):
            raise TypeError(f"betas[{i}] must be a float, got {beta!r}")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {beta} (in [0, 1))")
    return float(betas[0]), float(betas[1])


class SoapGradientMaker(PreconditionedGradientMaker):
    r"""SOAP: Adam in the eigenbasis of Shampoo's factors, on every trainable weight.

    The module docstring has the algorithm; the maker writes SOAP's whole direction
    into ``.grad``, for ``torch.optim.SGD`` without momentum to step.

    Args:
        model: the module to train (plain or ``DistributedDataParallel``).
        config: ``preconditioner_interval`` (SOAP's ``precondition_frequency``),
            ``ema_decay`` (``shampoo_beta``), ``damping`` (Adam's ``eps``), the
            schedule and ignored modules.
        betas: Adam's ``(beta1, beta2)`` in the rotated space, each in ``[0, 1)``.
        max_precond_dim: a side longer than this is not rotated.

    Raises:
        TypeError / ValueError: a bad ``betas`` or ``max_precond_dim``.

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from leantrain.precond import PreconditioningConfig
        >>> from leantrain.precond.methods.soap import SoapGradientMaker
        >>> model = torch.nn.Linear(4, 3)
        >>> cfg = PreconditioningConfig(
        ...     preconditioner_interval=10, ema_decay=0.95, damping=1e-8)
        >>> gm = SoapGradientMaker(model, cfg)
        >>> opt = torch.optim.SGD(model.parameters(), lr=3e-3)  # no momentum
        >>> x, t = torch.randn(16, 4), torch.randint(0, 3, (16,))
        >>> for _ in range(2):
        ...     opt.zero_grad()
        ...     gm.setup_loss_call(F.cross_entropy, gm.setup_model_call(model, x), t)
        ...     _ = gm.forward_and_backward()
        ...     opt.step()
        >>> [tuple(q.shape) for q in gm.bases["weight"]]  # Q_L, Q_R
        [(3, 3), (4, 4)]
        >>> gm.exp_avg_sq["bias"].shape  # plain Adam for the bias
        torch.Size([3])
    """

    runs_compiled_calls = True  # it reads only the gradients
    scales_loss = True  # its statistics are the (unscaled) gradient itself

    def __init__(
        self,
        model: nn.Module,
        config: PreconditioningConfig | None = None,
        *,
        betas: tuple[float, float] = (0.95, 0.95),
        max_precond_dim: int = 10000,
    ) -> None:
        self.betas = _check_betas(betas)
        self.max_precond_dim = check_int("max_precond_dim", max_precond_dim, minimum=1)
        # Per parameter name: [L, R] (None: a side not rotated); the bases [Q_L,
        # Q_R] of a started matrix parameter; Adam's moments (rotated space) and
        # step count of every started parameter.
        self.factors: dict[str, Bases] = {}
        self.bases: dict[str, Bases] = {}
        self.exp_avg: dict[str, Tensor] = {}
        self.exp_avg_sq: dict[str, Tensor] = {}
        self.adam_steps: dict[str, Tensor] = {}
        # Within a step: the refreshed bases and sort orders (applied after the Adam
        # update) and the parameters whose first statistics were just taken.
        self._refreshed: dict[str, list[tuple[Tensor, Tensor] | None]] = {}
        self._fresh: set[str] = set()
        super().__init__(model, config)
        # A parameter shared by several modules (tied weights) is preconditioned
        # once, under its first name: its statistics are of the summed gradient.
        self._params: dict[str, nn.Parameter] = {}
        seen: set[int] = set()
        for name, module in self.modules():
            for pname, p in module.named_parameters(recurse=False):
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    self._params[f"{name}.{pname}" if name else pname] = p

    def is_supported(self, module: nn.Module) -> bool:
        """Any module owning trainable parameters."""
        return any(p.requires_grad for p in module.parameters(recurse=False))

    def _accumulation_refusal(self) -> str | None:
        return None  # the statistics are the accumulated gradient

    def _discard_pass(self) -> None:
        self._refreshed, self._fresh = {}, set()

    # -- shapes -------------------------------------------------------------------
    @staticmethod
    def _matrix(grad: Tensor) -> Tensor:
        """A gradient as SOAP sees it: ``(out, rest)``, or flat for 1-D / 0-D."""
        return grad.reshape(grad.shape[0], -1) if grad.ndim >= 2 else grad.reshape(-1)

    def _sides(self, p: Tensor) -> list[bool]:
        """Which sides of ``p``'s matrix are rotated."""
        if p.ndim < 2:
            return [False, False]
        rows, cols = p.shape[0], math.prod(p.shape[1:])
        return [rows <= self.max_precond_dim, cols <= self.max_precond_dim]

    @staticmethod
    def _dtype(p: Tensor) -> torch.dtype:
        # State and arithmetic in fp32 at least (LAPACK has no half precision).
        return torch.promote_types(p.dtype, torch.float32)

    # -- the updates ----------------------------------------------------------------
    def update_curvature(self) -> None:
        """``L``, ``R`` <- EMA of ``G G^T``, ``G^T G`` for every rotated side."""
        for name, p in self._params.items():
            if p.grad is None:
                continue
            if name not in self.exp_avg:
                self._fresh.add(name)  # started by precondition() at this step
            sides = self._sides(p)
            if not any(sides):
                continue
            g = self._matrix(p.grad.detach()).to(self._dtype(p))
            left = self._ema_update(f"{name}/L", g @ g.T) if sides[0] else None
            right = self._ema_update(f"{name}/R", g.T @ g) if sides[1] else None
            self.factors[name] = [left, right]

    def update_preconditioner(self) -> None:
        """Refresh the bases of the parameters with a gradient: one power iteration
        and a QR from the previous basis. They are used from the next step on
        (:meth:`precondition` applies them after this step's Adam update)."""
        self._refreshed = {
            name: [
                None if q is None else refresh_basis(s, q)
                for s, q in zip(self.factors[name], bases, strict=True)
            ]
            for name, bases in self.bases.items()
            if self._params[name].grad is not None
        }

    @torch.no_grad()
    def precondition(self) -> None:
        """``.grad`` <- SOAP's direction; then start new parameters and switch the
        refreshed ones to their new bases."""
        grads = {n: p.grad for n, p in self._params.items() if p.grad is not None}
        if grads:
            # One device flag for the step (no host sync): a non-finite gradient
            # leaves every moment as it was and makes every direction NaN.
            sums = [g.sum(dtype=torch.float32) for g in grads.values()]
            ok = torch.stack(sums).isfinite().all()
            poison = torch.where(ok, 0.0, float("nan"))
        for name, grad in grads.items():
            if name in self.exp_avg:
                direction = self._adam(name, grad, ok)
            else:  # SOAP's skipped first step
                direction = torch.zeros_like(grad)
                if name in self._fresh:
                    self._start(name, grad)
            grad.copy_((direction + poison.to(direction.dtype)).reshape(grad.shape))
            if name in self._refreshed:
                self._switch(name, self._refreshed[name])
        self._refreshed, self._fresh = {}, set()

    def _start(self, name: str, grad: Tensor) -> None:
        """First statistics taken: bases by ``eigh``, zero moments."""
        p = self._params[name]
        factors = self.factors.get(name)
        if factors is not None:
            self.bases[name] = [None if s is None else eigenbasis(s) for s in factors]
        shape = self._matrix(grad).shape
        self.exp_avg[name] = grad.new_zeros(shape, dtype=self._dtype(p))
        self.exp_avg_sq[name] = grad.new_zeros(shape, dtype=self._dtype(p))
        self.adam_steps[name] = grad.new_zeros((), dtype=self._dtype(p))

    def _adam(self, name: str, grad: Tensor, ok: Tensor) -> Tensor:
        """Adam's bias-corrected direction in the rotated space, rotated back."""
        p = self._params[name]
        bases = self.bases.get(name, [None, None])
        m, v, t = self.exp_avg[name], self.exp_avg_sq[name], self.adam_steps[name]
        dtype = m.dtype
        rotated = rotate(self._matrix(grad).to(dtype), bases).masked_fill(~ok, 0.0)
        live = ok.to(dtype)  # 0: the moments and the count stay
        beta1, beta2 = self.betas
        m.lerp_(rotated, live * (1 - beta1))
        v.lerp_(rotated.square(), live * (1 - beta2))
        t.add_(live)
        count = t.clamp(min=1)
        scale = (1 - beta2**count).sqrt() / (1 - beta1**count)
        adam = m / (v.sqrt() + self.config.damping)
        return (unrotate(adam, bases) * scale).to(p.grad.dtype)

    def _switch(self, name: str, refreshed: list[tuple[Tensor, Tensor] | None]) -> None:
        """Move ``m`` into the refreshed bases; permute ``v`` as the columns were."""
        old = self.bases[name]
        plain = unrotate(self.exp_avg[name], old)
        v = self.exp_avg_sq[name]
        new: Bases = []
        for dim, (q, fresh) in enumerate(zip(old, refreshed, strict=True)):
            if fresh is None:
                new.append(q)
                continue
            new.append(fresh[0])
            v = v.index_select(dim, fresh[1])
        self.bases[name] = new
        self.exp_avg[name] = rotate(plain, new)
        self.exp_avg_sq[name] = v

    # -- state ------------------------------------------------------------------
    _KEYS = ("factors", "bases", "exp_avg", "exp_avg_sq", "adam_steps")

    def _extra_state(self) -> dict[str, Any]:
        def sides(d: dict[str, Bases]) -> dict[str, Tensor]:
            return {
                f"{name}/{side}": t
                for name, ts in d.items()
                for side, t in zip("LR", ts, strict=True)
                if t is not None
            }

        return {
            "factors": sides(self.factors),
            "bases": sides(self.bases),
            "exp_avg": dict(self.exp_avg),
            "exp_avg_sq": dict(self.exp_avg_sq),
            "adam_steps": dict(self.adam_steps),
        }

    def _expected_shape(self, key: str, entry: str) -> tuple[int, ...]:
        """The shape ``state['extra'][key][entry]`` must have here (ValueError
        naming the entry if this maker has no such parameter or side)."""
        name, side = (
            entry.rsplit("/", 1) if key in ("factors", "bases") else (entry, "")
        )
        p = self._params.get(name)
        where = f"state['extra'][{key!r}][{entry!r}]"
        if p is None:
            raise ValueError(f"{where}: no parameter {name!r} is preconditioned here")
        shape = tuple(self._matrix(p.detach()).shape)
        if not side:
            return () if key == "adam_steps" else shape
        if side not in ("L", "R") or not self._sides(p)["LR".index(side)]:
            raise ValueError(
                f"{where}: side {side!r} of {name!r} is not rotated here (sides L, R "
                f"up to max_precond_dim={self.max_precond_dim})"
            )
        n = shape["LR".index(side)]
        return (n, n)

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        check_extra_state(state, self._KEYS, tensor_maps=self._KEYS)
        for key in self._KEYS:
            for entry, value in state[key].items():
                want = self._expected_shape(key, entry)
                if tuple(value.shape) != want:
                    raise ValueError(
                        f"state['extra'][{key!r}][{entry!r}] has shape "
                        f"{tuple(value.shape)}, expected {want}"
                    )

        def load(entry: str, value: Tensor) -> Tensor:
            p = self._params[entry.rsplit("/", 1)[0] if "/" in entry else entry]
            return value.detach().to(p.device, copy=True)

        def sides(d: dict[str, Tensor]) -> dict[str, Bases]:
            out: dict[str, Bases] = {}
            for entry, value in d.items():
                name, side = entry.rsplit("/", 1)
                out.setdefault(name, [None, None])["LR".index(side)] = load(
                    entry, value
                )
            return out

        self.factors, self.bases = sides(state["factors"]), sides(state["bases"])
        self.exp_avg, self.exp_avg_sq, self.adam_steps = (
            {n: load(n, v) for n, v in state[key].items()}
            for key in ("exp_avg", "exp_avg_sq", "adam_steps")
        )
        self._refreshed, self._fresh = {}, set()
