r"""K-FAC: Kronecker-factored approximate curvature (Martens & Grosse, 2015).

For a layer ``y_t = W a_t + b`` the Fisher block of ``[W, b]`` is approximated by
``B ⊗ A`` with ``A = sum_{n,t} ã ã^T / N`` (inputs with a trailing 1 for the bias)
and ``B = sum_{n,t} e e^T`` (output-gradients of the back-propagated Fisher vectors,
see ``docs/curvature.md``). The preconditioned gradient of the canonical gradient
matrix ``G`` (rows: output units, columns: ``[inputs, 1]``) is, by ``damping_mode``:

* ``"pi"``: ``(B + λ_B I)^{-1} G (A + λ_A I)^{-1}`` with the π split of λ
  (:func:`~leantrain.precond.curv.pi_damping`), two Cholesky inverses;
* ``"tikhonov"``: the same with ``λ_A = λ_B = sqrt(λ)``;
* ``"exact"``: ``(B ⊗ A + λ I)^{-1} vec(G)`` through the eigendecompositions
  ``A = Q_A Λ_A Q_A^T``, ``B = Q_B Λ_B Q_B^T``:
  ``Q_B [(Q_B^T G Q_A) / (λ_B λ_A^T + λ)] Q_A^T``.

LayerNorm and BatchNorm get their exact unit blocks (``[γ_i, β_i]``, 2x2 per unit)
inverted with Tikhonov damping λ; BatchNorm in training mode treats the batch
statistics as constants (the usual K-FAC approximation).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import Tensor, nn

from leantrain.precond._gram import (
    LowRankFactor,
    as_dense,
    factor_inverse,
    right_solve,
    trace_mean,
)
from leantrain.precond._kfac_apply import (
    inverse_state,
    inverses_from_state,
    split_inverse,
    write_operators,
    write_shortcut,
)
from leantrain.precond._kron import (
    KronFactorMaker,
    damped_inverses,
    read_canonical,
    write_canonical,
)
from leantrain.precond.curv import (
    cholesky_inverse,
    damped_inverse,
    pi_damping,
    pi_split,
    robust_eigh,
)
from leantrain.precond.curv.modules import LinearOp
from leantrain.precond.fisher_options import FisherOptions
from leantrain.precond.preconditioned import PreconditioningConfig

__all__ = ["DAMPING_MODES", "KfacGradientMaker", "kfac_precondition"]

DAMPING_MODES = ("pi", "tikhonov", "exact")


def kfac_precondition(
    grad: Tensor, a: Tensor, b: Tensor, damping: float, mode: str = "pi"
) -> Tensor:
    r"""Reference: the K-FAC preconditioned ``grad`` for one site (no caching).

    Args:
        grad: canonical gradient ``(R, U)``.
        a: input factor ``(U, U)``.
        b: output factor ``(R, R)``.
        damping: λ > 0.
        mode: ``"pi"``, ``"tikhonov"`` or ``"exact"`` (see the module docstring).

    Returns:
        The preconditioned ``(R, U)`` matrix.
    """
    if mode == "exact":
        la, qa = robust_eigh(a)
        lb, qb = robust_eigh(b)
        inner = qb.T @ grad @ qa
        return qb @ (inner / (lb.unsqueeze(1) * la.unsqueeze(0) + damping)) @ qa.T
    if mode == "pi":
        damp_a, damp_b = pi_damping(a, b, damping)
    else:
        damp_a = damp_b = math.sqrt(damping)
    return cholesky_inverse(b, damp_b) @ grad @ cholesky_inverse(a, damp_a)


class KfacGradientMaker(KronFactorMaker):
    r"""K-FAC with exact, Monte-Carlo or empirical Fisher factors.

    Curvature steps collect ``A`` and ``B`` of every supported module from module
    hooks (batched matmuls, no per-example gradients) and fold them into a
    bias-corrected EMA (``config.ema_decay``); preconditioner steps invert them
    (Cholesky, or ``eigh`` for ``damping_mode="exact"``; with
    ``preconditioner_interval=1`` the Cholesky factors are kept and applied by
    triangular solves); every step applies ``B^{-1} G A^{-1}`` per layer (two
    matmuls). A ``nn.Linear`` wider than the batch skips its weight gradient and is
    preconditioned as ``(B^{-1} E^T)([X, 1] A^{-1})`` from its output-gradients
    ``E`` and inputs ``X`` (same result, less arithmetic; single process, ``.grad``
    ``None`` before the step). When each factor replaces the last
    (``ema_decay=None``) and the preconditioner is rebuilt every step, a linear
    layer's factors are one batch's Gram matrices: where one has fewer rows than it
    is wide it is never formed and is inverted through the batch's ``P x P`` Gram
    matrix instead (``low_rank``, ``_gram.py``; same result). Under
    ``DistributedDataParallel``
    curvature steps bypass the wrapper and average the gradient and the factors over
    the group, so every rank holds the union-batch factors (for ``"fisher_mc"`` the
    draws differ per rank, so only the expectation matches).

    Args:
        model: the module to train (plain or ``DistributedDataParallel``).
        config: schedule, damping λ, EMA decay, ignored modules.
        fisher: the Fisher taken (:class:`~leantrain.precond.FisherOptions`:
            ``fisher_type``, ``n_mc_samples``, ``loss_type``, ``loss_reduction``,
            ``logits_fn``, ``seed``).
        **fisher_kwargs: those fields as keywords (``fisher_type="fisher_emp"``),
            overriding ``fisher``'s.
        damping_mode: ``"pi"``, ``"tikhonov"`` or ``"exact"`` (module docstring).
        low_rank: allow the Gram-matrix inverses of low-rank factors (single
            process, ``ema_decay=None``, ``preconditioner_interval=1``, not
            ``"exact"``); ``False`` always forms the factors.

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from leantrain.precond import PreconditioningConfig
        >>> from leantrain.precond.methods.kfac import KfacGradientMaker
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
        ...                             torch.nn.Linear(8, 3))
        >>> gm = KfacGradientMaker(model, PreconditioningConfig(damping=1e-3))
        >>> y = gm.setup_model_call(model, torch.randn(16, 4))
        >>> gm.setup_loss_call(F.cross_entropy, y, torch.randint(0, 3, (16,)))
        >>> output, loss = gm.forward_and_backward()
        >>> sorted(gm.factors), gm.factors["0"]["A"][0].shape
        (['0', '2'], torch.Size([5, 5]))
    """

    def __init__(
        self,
        model: nn.Module,
        config: PreconditioningConfig | None = None,
        *,
        fisher: FisherOptions | None = None,
        damping_mode: Literal["pi", "tikhonov", "exact"] = "pi",
        low_rank: bool = True,
        **fisher_kwargs: Any,
    ) -> None:
        if not isinstance(low_rank, bool):
            raise TypeError(f"low_rank must be a bool, got {low_rank!r}")
        if damping_mode not in DAMPING_MODES:
            raise ValueError(
                f"damping_mode must be one of {DAMPING_MODES}, got {damping_mode!r}"
            )
        self.damping_mode = damping_mode
        # Factored damping: wide linear layers skip their weight gradient and are
        # preconditioned as (B^-1 E^T)(X A^-1) (see
        # _output_grad_shortcut.shortcut_is_cheaper).
        self.factored_gradients = damping_mode != "exact"
        # Per module: {"A": [..], "B": [..]} inverses (or eigenpairs for "exact"),
        # or {"unit": (R, U, U) inverses}.
        self.inverses: dict[str, dict[str, Any]] = {}
        super().__init__(
            model,
            config,
            fisher=fisher,
            **fisher_kwargs,
        )
        config = self.config
        if (
            low_rank
            and damping_mode != "exact"
            and config.ema_decay is None
            and config.preconditioner_interval == 1
            and not isinstance(model, nn.parallel.DistributedDataParallel)
        ):
            # Each factor is this batch's alone and used once: keep its rows and
            # invert through the Gram matrix where that is narrower (_gram.py).
            self._collector.low_rank = frozenset(
                name for name, op in self.ops.items() if isinstance(op, LinearOp)
            )

    @property
    def factors(self) -> dict[str, dict[str, Any]]:
        """Per module ``{"A": [..], "B": [..], "rows": [..]}`` (or ``{"unit": ..}``):
        the current factors as ``(d, d)`` tensors. Low-rank factors (``low_rank``)
        are kept as their rows and formed here, on access only."""
        for f in self._factors.values():
            for key in ("A", "B"):
                if key in f and any(isinstance(x, LowRankFactor) for x in f[key]):
                    f[key] = [as_dense(x) for x in f[key]]
        return self._factors

    @factors.setter
    def factors(self, value: dict[str, dict[str, Any]]) -> None:
        self._factors = value

    def update_curvature(self) -> None:
        """Fold this pass's factors into :attr:`factors`; low-rank factors (see
        ``low_rank``) are kept as their rows, replacing the last."""
        low = {
            name: stats
            for name, stats in self._stats.items()
            if isinstance(stats.get("A", [None])[0], LowRankFactor)
        }
        self._stats = {n: s for n, s in self._stats.items() if n not in low}
        for name in low:  # replaced below; never formed just to be dropped
            self._factors.pop(name, None)
        super().update_curvature()
        for name, stats in low.items():
            self._factors[name] = {k: stats[k] for k in ("A", "B", "rows")}

    def update_preconditioner(self) -> None:
        """Invert the damped factors (or eigendecompose them for ``"exact"``)."""
        lam = self.config.damping
        # Used once (interval 1): keep Cholesky factors and solve; cholesky_inverse
        # costs twice the factorization and only pays off when reused.
        solve = self.config.preconditioner_interval == 1
        inverses: dict[str, dict[str, Any]] = {}
        dense: list[tuple[str, str]] = []  # (name, "A" | "B"), inverted together
        for name, f in self._factors.items():
            if "unit" in f:
                inverses[name] = {"unit": damped_inverse(f["unit"], lam)}
                continue
            if isinstance(f["A"][0], LowRankFactor):
                inverses[name] = self._operators(f, lam)
                continue
            inv: dict[str, Any] = {"A": [], "B": []}
            if self.damping_mode == "exact":
                for a, b in zip(f["A"], f["B"], strict=True):
                    inv["A"].append(robust_eigh(a))
                    inv["B"].append(robust_eigh(b))
            else:
                if solve:
                    inv["cholesky"] = True
                dense += [(name, "A"), (name, "B")]
            inverses[name] = inv
        if dense:
            matrices = [m for name, key in dense for m in self._factors[name][key]]
            damps = self._dense_dampings(dense, lam)
            done = iter(damped_inverses(matrices, damps, cholesky=solve))
            for name, key in dense:
                inverses[name][key] = [next(done) for _ in self._factors[name][key]]
        self.inverses = inverses

    def _dense_dampings(self, dense: list[tuple[str, str]], lam: float) -> list[float]:
        """Each dense factor's share of ``λ``, in the order of ``dense``'s matrices:
        the π split (traces read from the device in one transfer, not one per
        factor) or ``sqrt(λ)`` each."""
        count = sum(len(self._factors[name][key]) for name, key in dense)
        if self.damping_mode != "pi":
            return [math.sqrt(lam)] * count
        traces, sizes = {}, {}
        for name, key in dense:
            for i, m in enumerate(self._factors[name][key]):
                traces[(name, key, i)] = m.diagonal(dim1=-2, dim2=-1).sum()
                sizes[(name, key, i)] = m.shape[-1]
        # as pi_damping: the trace in the factor's dtype, the mean in Python floats;
        # one transfer per device
        by_device: dict[torch.device, list[tuple]] = {}
        for k, t in traces.items():
            by_device.setdefault(t.device, []).append(k)
        host = {}
        for keys in by_device.values():
            read = torch.stack([traces[k].double() for k in keys]).tolist()
            host.update({k: t / sizes[k] for k, t in zip(keys, read, strict=True)})
        damps = {}
        for name, key in dense:
            if key == "B":
                continue
            for i in range(len(self._factors[name]["A"])):
                a, b = pi_split(host[(name, "A", i)], host[(name, "B", i)], lam)
                damps[(name, "A", i)], damps[(name, "B", i)] = a, b
        return [
            damps[(name, key, i)]
            for name, key in dense
            for i in range(len(self._factors[name][key]))
        ]

    def _operators(self, f: dict[str, Any], lam: float) -> dict[str, Any]:
        """Inverse operators of low-rank factors: Gram-matrix or Cholesky, per side."""
        inv: dict[str, Any] = {"A": [], "B": [], "operators": True}
        for a, b in zip(f["A"], f["B"], strict=True):
            if self.damping_mode == "pi":
                damp_a, damp_b = pi_split(trace_mean(a), trace_mean(b), lam)
            else:
                damp_a = damp_b = math.sqrt(lam)
            inv["A"].append(factor_inverse(a, damp_a))
            inv["B"].append(factor_inverse(b, damp_b))
        return inv

    @torch.no_grad()
    def precondition(self) -> None:
        """``.grad`` of each module ← its (possibly stale) K-FAC preconditioned grad."""
        lam = self.config.damping
        captured, self._captured = self._captured, {}
        for name, (x, e) in captured.items():
            inv = self.inverses.get(name)
            if inv is None:  # no curvature yet: the plain gradient
                write_shortcut(self.ops[name], x, e)
                continue
            if inv.get("operators"):
                write_operators(self.ops[name], x, e, inv["A"][0], inv["B"][0])
                continue
            cholesky = inv.get("cholesky", False)
            parts = None
            if not cholesky and len(self.ops[name].params) == 2:
                parts = self._inverse_parts(inv, x.shape[1], x.dtype)
            write_shortcut(
                self.ops[name],
                x,
                e,
                inv["A"][0],
                inv["B"][0],
                cholesky=cholesky,
                a_parts=parts,
            )
        for name, inv in self.inverses.items():
            op = self.ops[name]
            if name in captured:
                continue
            if self._apply_linear(op, inv):
                continue
            g = read_canonical(op)
            if g is None:
                continue
            dtype = g.dtype
            if "unit" in inv:
                u = inv["unit"].to(dtype)
                write_canonical(op, torch.einsum("ruv,rv->ru", u, g))
                continue
            rows = self._factors[name]["rows"]
            parts = [self._apply(inv, i, g[sl], lam) for i, sl in enumerate(rows)]
            out = parts[0] if len(parts) == 1 else torch.cat(parts)  # sites: row blocks
            write_canonical(op, out)

    def _apply_linear(self, op: Any, inv: dict[str, Any]) -> bool:
        """``B^{-1} [G_W, g_b] A^{-1}`` for a whole ``nn.Linear`` or ``nn.Conv2d``,
        into its ``.grad`` fields, without the canonical layout's concatenate and
        split copies (a tenth of a millisecond per step on the digits MLP). False
        where the general path applies (other modules, several sites, Cholesky
        factors, ``"exact"``, a missing gradient)."""
        if (
            type(op.module) not in (nn.Linear, nn.Conv2d)
            or self.damping_mode == "exact"
            or inv.get("cholesky")
            or inv.get("operators")
            or "unit" in inv
            or len(inv["A"]) != 1
        ):
            return False
        params = op.params
        grads = [p.grad for p in params]
        if any(g is None for g in grads) or any(
            g.dtype != params[0].dtype for g in grads
        ):
            return False
        dtype = grads[0].dtype
        b = inv["B"][0].to(dtype)
        # A Conv2d's (out, in, kh, kw) weight is its (out, in*kh*kw) canonical matrix.
        gw = grads[0].reshape(grads[0].shape[0], -1)
        left = b @ gw  # B^-1 G_W
        # The products go into .grad itself (in place: DDP may hold it), which
        # ``left`` no longer reads: a fresh tensor and a copy would cost one more
        # pass over the weight. A strided .grad (channels-last) takes the copy.
        out = gw if grads[0].is_contiguous() else torch.empty_like(gw)
        if len(params) == 1:
            torch.mm(left, inv["A"][0].to(dtype), out=out)
        else:
            a_w, a_row, a_col, a_kk = self._inverse_parts(inv, gw.shape[1], dtype)
            left_b = b @ grads[1]  # B^-1 g_b
            # [L, l_b] A^-1 = L A^-1[:k] + l_b A^-1[k]: weight columns, then bias.
            grads[1].copy_(torch.addmv(left_b * a_kk, left, a_col))
            torch.mm(left, a_w, out=out).addr_(left_b, a_row)
        if out is not gw:
            grads[0].copy_(out.view_as(grads[0]))
        return True

    @staticmethod
    def _inverse_parts(inv: dict[str, Any], k: int, dtype: torch.dtype) -> tuple:
        """:func:`~leantrain.precond._kfac_apply.split_inverse` of the site's
        ``A^{-1}``, cut once per preconditioner update (kept in ``inv``, which the
        next update replaces; not saved by ``state_dict``)."""
        key = ("parts", dtype)
        if key not in inv:
            inv[key] = split_inverse(inv["A"][0].to(dtype), k)
        return inv[key]

    def _apply(self, inv: dict[str, Any], i: int, g: Tensor, lam: float) -> Tensor:
        """Preconditioned rows of site ``i``: two matmuls (four for ``"exact"``)."""
        dtype = g.dtype
        if self.damping_mode == "exact":
            (la, qa), (lb, qb) = inv["A"][i], inv["B"][i]
            inner = qb.T.to(dtype) @ g @ qa.to(dtype)
            scale = (lb.unsqueeze(1) * la.unsqueeze(0) + lam).to(dtype)
            return qb.to(dtype) @ (inner / scale) @ qa.T.to(dtype)
        if inv.get("operators"):
            return inv["B"][i].left(inv["A"][i].right(g))
        if inv.get("cholesky"):
            return right_solve(right_solve(g, inv["A"][i]).mT, inv["B"][i]).mT
        return inv["B"][i].to(dtype) @ g @ inv["A"][i].to(dtype)

    # -- state ------------------------------------------------------------------
    preconditioner_key = "inverses"

    def _preconditioner_state(self) -> dict[str, Tensor]:
        return inverse_state(self.inverses)

    def _load_preconditioner_state(self, tensors: dict[str, Tensor]) -> None:
        self.inverses = inverses_from_state(tensors)
