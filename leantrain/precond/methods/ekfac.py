r"""EKFAC: K-FAC in its Kronecker eigenbasis, with re-estimated scaling.

George et al. (2018). With the K-FAC factors ``A = Q_A Λ_A Q_A^T`` and
``B = Q_B Λ_B Q_B^T``, K-FAC scales coordinate ``(i, j)`` of the rotated gradient
``Q_B^T G Q_A`` by ``1 / (λ_B[i] λ_A[j])``. EKFAC keeps the eigenbasis
``Q = Q_B ⊗ Q_A`` but replaces the scaling by its exact second moment there,

.. math::  s = \mathbb{E}_n[(Q^\top g_n)^2],

re-estimated from per-example gradients ``g_n`` (the same Fisher vectors as K-FAC:
exact, Monte-Carlo or empirical), and preconditions with
``Q diag(s + λ)^{-1} Q^T g`` = ``Q_B [(Q_B^T G Q_A) / (s + λ)] Q_A^T``. For a layer
applied once per example the per-example gradient is ``e_n ã_n^T``, so
``s = sum_n (Q_B^T e_n)^2 ((Q_A^T ã_n)^2)^T``: a matmul of squared rotated
activations and output-gradients, no per-example gradient is formed. Weight-shared
layers (sequences, convolutions) form the per-example ``sum_t ê_t â_t^T`` for a chunk
of examples at a time.

Schedule: a curvature step updates the factors' EMA and re-estimates ``s`` in the
current eigenbasis; a preconditioner step (always also a curvature step) first
recomputes the eigenbasis from the updated factors, so ``s`` is estimated in the
basis it will be used with. LayerNorm / BatchNorm keep K-FAC's exact unit blocks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from leantrain.precond._kron import KronFactorMaker, read_canonical, write_canonical
from leantrain.precond.curv import cholesky_inverse, robust_eigh
from leantrain.precond.curv._tied import TiedOp
from leantrain.precond.fisher_options import FisherOptions
from leantrain.precond.preconditioned import PreconditioningConfig

__all__ = ["EkfacGradientMaker", "eigenbasis_scaling", "tied_scaling"]

_CHUNK = 1 << 22  # bound on a transient (n, R, U) block of per-example gradients


def eigenbasis_scaling(
    a: Tensor, e: Tensor, qa: Tensor, qb: Tensor, *, has_bias: bool, ids: bool
) -> Tensor:
    r"""``sum_n (Q_B^T G_n Q_A)^2`` for per-example gradients ``G_n = sum_t e_t ã_t^T``.

    Args:
        a: inputs ``(N, T, J)`` (token ids ``(N, T)`` when ``ids``).
        e: output-gradients ``(N, T, R)``.
        qa: ``(U, U)`` eigenvectors of ``A`` (``U = J + has_bias``).
        qb: ``(R, R)`` eigenvectors of ``B``.
        has_bias: append a constant 1 to the inputs.
        ids: ``a`` holds token ids (Embedding): ``ã`` is one-hot.

    Returns:
        ``(R, U)`` sums of squared rotated per-example gradients.
    """
    if ids:
        rot_a = qa[a]  # one-hot rows of Q_A
    else:
        if has_bias:
            a = torch.cat([a, a.new_ones(*a.shape[:-1], 1)], dim=-1)
        rot_a = a @ qa  # (N, T, U)
    rot_e = e @ qb  # (N, T, R)
    if rot_a.shape[1] == 1:  # no weight sharing: closed form
        return rot_e[:, 0].square().T @ rot_a[:, 0].square()
    n, r, u = rot_e.shape[0], rot_e.shape[2], rot_a.shape[2]
    step = max(1, _CHUNK // max(1, r * u))
    out = rot_e.new_zeros(r, u)
    for i in range(0, n, step):
        g = torch.einsum("ntr,ntu->nru", rot_e[i : i + step], rot_a[i : i + step])
        out += g.square().sum(0)
    return out


def tied_scaling(op: TiedOp, data: list, qa: Tensor, qb: Tensor) -> Tensor:
    r"""``sum_n (Q_B^T G_n Q_A)^2`` for a tied weight: ``G_n`` is the sum of its
    sites' per-example gradients (``_tied.py``), formed a chunk at a time."""
    out = None
    for sl in op.chunks(data):
        g = op.per_example(data, sl)
        part = (qb.T.to(g.dtype) @ g @ qa.to(g.dtype)).square().sum(0)
        out = part if out is None else out + part
    return out


class EkfacGradientMaker(KronFactorMaker):
    r"""Eigenvalue-corrected K-FAC (see the module docstring for the definition).

    Args:
        model: the module to train (plain or ``DistributedDataParallel``).
        config: schedule, damping λ (added to the scaling), EMA decay, ignored
            modules.
        fisher: the Fisher taken (:class:`~leantrain.precond.FisherOptions`:
            ``fisher_type``, ``n_mc_samples``, ``loss_type``, ``loss_reduction``,
            ``logits_fn``, ``seed``).
        **fisher_kwargs: those fields as keywords (``fisher_type="fisher_emp"``),
            overriding ``fisher``'s.

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from leantrain.precond.methods.ekfac import EkfacGradientMaker
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
        ...                             torch.nn.Linear(8, 3))
        >>> gm = EkfacGradientMaker(model, fisher_type="fisher_emp")
        >>> y = gm.setup_model_call(model, torch.randn(16, 4))
        >>> gm.setup_loss_call(F.cross_entropy, y, torch.randint(0, 3, (16,)))
        >>> _ = gm.forward_and_backward()
        >>> gm.scaling["2"][0].shape  # (outputs, inputs + bias)
        torch.Size([3, 9])
    """

    def __init__(
        self,
        model: nn.Module,
        config: PreconditioningConfig | None = None,
        *,
        fisher: FisherOptions | None = None,
        **fisher_kwargs: Any,
    ) -> None:
        # Per module: eigenvectors [(Q_A, Q_B) per site]; scaling s per site.
        self.bases: dict[str, list[tuple[Tensor, Tensor]]] = {}
        self.scaling: dict[str, list[Tensor]] = {}
        self.inverse_scaling: dict[str, list[Tensor]] = {}
        self.unit_inverses: dict[str, Tensor] = {}
        self._passes: list[dict] = []
        super().__init__(
            model,
            config,
            fisher=fisher,
            **fisher_kwargs,
        )
        self._collector.on_pass = self._passes.append

    def _discard_pass(self) -> None:
        super()._discard_pass()
        self._passes.clear()  # a non-finite pass must not reach the next scaling

    def update_curvature(self) -> None:
        """Update the factors; refresh the basis when due; re-estimate the scaling."""
        passes, self._passes[:] = list(self._passes), []
        super().update_curvature()
        if self.config.preconditioner_due(self.step) or not self.bases:
            self.bases = {
                name: [
                    (robust_eigh(a)[1], robust_eigh(b)[1])
                    for a, b in zip(f["A"], f["B"], strict=True)
                ]
                for name, f in self.factors.items()
                if "unit" not in f
            }
        for name, bases in self.bases.items():
            op = self.ops[name]
            total = None
            for data in passes:
                if name not in data:
                    continue
                if isinstance(op, TiedOp):
                    (qa, qb), sites = bases[0], data[name]
                    parts = [tied_scaling(op, sites, qa, qb)]
                else:
                    parts = [
                        eigenbasis_scaling(
                            site.a,
                            site.e,
                            qa.to(site.e.dtype),
                            qb.to(site.e.dtype),
                            has_bias=op.has_bias,
                            ids=isinstance(op.module, nn.Embedding),
                        )
                        for site, (qa, qb) in zip(data[name], bases, strict=True)
                    ]
                total = (
                    parts
                    if total is None
                    else [t + p for t, p in zip(total, parts, strict=True)]
                )
            if total is not None:
                self._all_reduce_mean(total)
                self.scaling[name] = [
                    self._ema_update(f"{name}/S{i}", s) for i, s in enumerate(total)
                ]

    def update_preconditioner(self) -> None:
        """``1 / (s + λ)`` per site; damped inverses of the unit blocks."""
        lam = self.config.damping
        self.inverse_scaling = {
            name: [1.0 / (s + lam) for s in scales]
            for name, scales in self.scaling.items()
        }
        self.unit_inverses = {
            name: cholesky_inverse(f["unit"], lam)
            for name, f in self.factors.items()
            if "unit" in f
        }

    @torch.no_grad()
    def precondition(self) -> None:
        """``.grad`` ← ``Q_B [(Q_B^T G Q_A) / (s + λ)] Q_A^T`` per site."""
        for name, inv in self.unit_inverses.items():
            op = self.ops[name]
            g = read_canonical(op)
            if g is not None:
                write_canonical(op, torch.einsum("ruv,rv->ru", inv.to(g.dtype), g))
        for name, scales in self.inverse_scaling.items():
            op = self.ops[name]
            g = read_canonical(op)
            if g is None:
                continue
            out = torch.empty_like(g)
            rows = self.factors[name]["rows"]
            for sl, (qa, qb), scale in zip(rows, self.bases[name], scales, strict=True):
                qa, qb = qa.to(g.dtype), qb.to(g.dtype)
                out[sl] = qb @ ((qb.T @ g[sl] @ qa) * scale.to(g.dtype)) @ qa.T
            write_canonical(op, out)

    # -- state ------------------------------------------------------------------
    preconditioner_key = "eigen"

    def _preconditioner_state(self) -> dict[str, Tensor]:
        tensors: dict[str, Tensor] = {}
        for name, bases in self.bases.items():
            for i, (qa, qb) in enumerate(bases):
                tensors[f"{name}/QA{i}"], tensors[f"{name}/QB{i}"] = qa, qb
        for name, scales in self.scaling.items():
            for i, s in enumerate(scales):
                tensors[f"{name}/S{i}"] = s
        return tensors

    def _load_preconditioner_state(self, tensors: dict[str, Tensor]) -> None:
        found: dict[str, dict[str, dict[int, Tensor]]] = {}
        for key, value in tensors.items():
            name, _, part = key.rpartition("/")
            kind, index = part.rstrip("0123456789"), int(part.lstrip("QABS"))
            found.setdefault(name, {}).setdefault(kind, {})[index] = value.clone()
        self.bases = {
            n: [(f["QA"][i], f["QB"][i]) for i in range(len(f["QA"]))]
            for n, f in found.items()
            if "QA" in f
        }
        self.scaling = {
            n: [f["S"][i] for i in range(len(f["S"]))]
            for n, f in found.items()
            if "S" in f
        }
        self.update_preconditioner()  # a pure function of the loaded state
