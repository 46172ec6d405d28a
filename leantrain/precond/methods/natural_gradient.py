r"""Natural gradient with the Fisher in one of four representations.

The preconditioned gradient is :math:`(F + \lambda I)^{-1} g`, where ``F`` is the
Fisher of ``fisher_type`` (exact, Monte-Carlo or empirical; see
``docs/curvature.md``) kept in one representation (``shape``):

==========  =================================================================
``full``    the whole ``P x P`` matrix over every preconditioned parameter
``layer``   one dense block per module (its weight and bias together)
``unit``    one block per output unit (a weight row with its bias entry)
``diag``    the diagonal
==========  =================================================================

Each is the *exact* corresponding part of the Fisher (the curvature layer forms
per-example gradients where the representation needs them), inverted with a Cholesky
factorization (``diag``: a reciprocal) that is kept and applied by two triangular
solves per step (cheaper than forming the inverse: a batched ``cholesky_inverse`` of
the 256 unit blocks of a 256-wide layer costs twice the factorization).
``full`` and ``layer`` hold dense blocks and
are meant for small models: a block of more than ``max_block`` parameters is
rejected when the maker is built.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor, nn

from leantrain.precond._checks import check_choice, check_extra_state
from leantrain.precond._hooked import HookedMaker
from leantrain.precond._kron import read_canonical, write_canonical
from leantrain.precond.curv import damped_cholesky
from leantrain.precond.fisher_options import FisherOptions
from leantrain.precond.preconditioned import PreconditioningConfig

__all__ = ["NG_SHAPES", "NaturalGradientMaker", "damped_cholesky", "natural_gradient"]

NG_SHAPES = ("full", "layer", "unit", "diag")


def natural_gradient(fisher: Tensor, grad: Tensor, damping: float) -> Tensor:
    r"""Reference: :math:`(F + \lambda I)^{-1} g` for a dense ``F`` (Cholesky solve).

    Args:
        fisher: symmetric PSD ``(P, P)``.
        grad: ``(P,)``.
        damping: :math:`\lambda > 0`.
    """
    eye = torch.eye(fisher.shape[0], dtype=fisher.dtype, device=fisher.device)
    factor = torch.linalg.cholesky(fisher + damping * eye)
    return torch.cholesky_solve(grad.unsqueeze(-1), factor).squeeze(-1)


def _solve(factor: Tensor, rhs: Tensor) -> Tensor:
    """``(L L^T)^{-1} rhs`` by two triangular solves.

    Not ``torch.cholesky_solve``: on a batch of 256 factors of 257x257 it copies the
    factors each call and costs ~4x more on CPU.
    """
    y = torch.linalg.solve_triangular(factor, rhs.to(factor.dtype), upper=False)
    return torch.linalg.solve_triangular(factor.mH, y, upper=True).to(rhs.dtype)


class NaturalGradientMaker(HookedMaker):
    r"""Natural gradient :math:`(F + \lambda I)^{-1} g`, full, layer-, unit-wise or
    diagonal.

    Curvature steps collect the Fisher of ``fisher_type`` in representation ``shape``
    from module hooks (one backward per Fisher vector on the graph of the ordinary
    forward, which also yields the loss gradient), fold it into a bias-corrected EMA
    (``config.ema_decay``); preconditioner steps invert the damped blocks (Cholesky);
    every step multiplies ``.grad`` by the (possibly stale) inverse. Under
    ``DistributedDataParallel`` the gradient and the Fisher are averaged over the
    group, so every rank holds the union-batch Fisher.

    Args:
        model: the module to train (plain or ``DistributedDataParallel``).
        config: schedule, damping :math:`\lambda`, EMA decay, ignored modules.
        fisher: the Fisher taken (:class:`~leantrain.precond.FisherOptions`:
            ``fisher_type``, ``n_mc_samples``, ``loss_type``, ``loss_reduction``,
            ``logits_fn``, ``seed``).
        **fisher_kwargs: those fields as keywords (``fisher_type="fisher_emp"``),
            overriding ``fisher``'s.
        shape: ``"full"``, ``"layer"``, ``"unit"`` or ``"diag"``.
        max_block: largest dense block (parameters) ``"full"`` / ``"layer"`` accept.

    Raises:
        ValueError: an unknown ``shape`` / ``fisher_type``, or a dense block larger
            than ``max_block`` (its ``P x P`` matrix would not fit in memory).

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from leantrain.precond import PreconditioningConfig
        >>> from leantrain.precond.methods.natural_gradient import NaturalGradientMaker
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
        ...                             torch.nn.Linear(8, 3))
        >>> gm = NaturalGradientMaker(model, PreconditioningConfig(damping=1e-3),
        ...                           fisher_type="fisher_emp", shape="layer")
        >>> y = gm.setup_model_call(model, torch.randn(16, 4))
        >>> gm.setup_loss_call(F.cross_entropy, y, torch.randint(0, 3, (16,)))
        >>> output, loss = gm.forward_and_backward()
        >>> gm.preconditioner["0"].shape  # Cholesky factor of the 40x40 block
        torch.Size([40, 40])
    """

    def __init__(
        self,
        model: nn.Module,
        config: PreconditioningConfig | None = None,
        *,
        fisher: FisherOptions | None = None,
        shape: Literal["full", "layer", "unit", "diag"] = "full",
        max_block: int = 16384,
        **fisher_kwargs: Any,
    ) -> None:
        self.shape = check_choice("shape", shape, NG_SHAPES)
        if isinstance(max_block, bool) or not isinstance(max_block, int):
            raise TypeError(f"max_block must be an int, got {max_block!r}")
        # Per module name (``"full"``: the key ""): the EMA Fisher, and its
        # preconditioner: 1 / (F + lambda) for "diag", else the lower Cholesky factor
        # of F + lambda I (unit: batched over the units).
        self.fisher: dict[str, Tensor] = {}
        self.preconditioner: dict[str, Tensor] = {}
        super().__init__(
            model,
            config,
            fisher=fisher,
            **fisher_kwargs,
            shapes=(shape,),
            keep_sites=False,
        )
        self.couples_modules = shape == "full"
        sizes = {name: op.numel for name, op in self.ops.items()}
        if shape == "full":
            sizes = {"all preconditioned modules": self._collector.numel}
        if shape in ("full", "layer"):
            for name, size in sizes.items():
                if size > max_block:
                    gib = size * size * 4 / 2**30
                    raise ValueError(
                        f"shape={shape!r}: {name!r} has {size} parameters, a dense "
                        f"{size}x{size} Fisher block (~{gib:.1f} GiB in fp32) exceeds "
                        f"max_block={max_block}; use shape='unit' or 'diag', "
                        "SmwNgGradientMaker / SengGradientMaker, or raise max_block"
                    )

    def update_curvature(self) -> None:
        """Average the collected Fisher over the DDP group and fold it into the EMA."""
        if self.shape == "full":
            parts = {"": self._full}
        else:
            parts = {name: stats.get(self.shape) for name, stats in self._stats.items()}
        # A module that saw no gradient in this pass keeps its previous estimate.
        parts = {name: t for name, t in parts.items() if t is not None}
        self._all_reduce_mean([parts[k] for k in sorted(parts)])
        for name, value in parts.items():
            self.fisher[name] = self._ema_update(name, value)
        self._stats, self._full = {}, None

    def update_preconditioner(self) -> None:
        r"""Factor :math:`F + \lambda I` blockwise (Cholesky; ``diag``: reciprocal)."""
        lam = self.config.damping
        if self.shape == "diag":
            self.preconditioner = {n: 1.0 / (f + lam) for n, f in self.fisher.items()}
        else:  # full / layer blocks (P, P) and unit blocks (R, U, U), batched
            self.preconditioner = {
                n: damped_cholesky(f, lam) for n, f in self.fisher.items()
            }

    @torch.no_grad()
    def precondition(self) -> None:
        """``.grad`` of each module ← its (possibly stale) natural gradient."""
        if self.shape == "full":
            factor = self.preconditioner.get("")
            if factor is None:
                return
            flats = {name: self.read_flat(name) for name in self.ops}
            flat = torch.cat(
                [
                    f if f is not None else factor.new_zeros(self.ops[n].numel)
                    for n, f in flats.items()
                ]
            )
            out = _solve(factor, flat.unsqueeze(-1)).squeeze(-1)
            for name, piece in zip(
                self.ops, out.split([op.numel for op in self.ops.values()]), strict=True
            ):
                if flats[name] is not None:
                    self.write_flat(name, piece)
            return
        for name, pre in self.preconditioner.items():
            op = self.ops[name]
            if self.shape == "layer":
                g = self.read_flat(name)
                if g is not None:
                    self.write_flat(name, _solve(pre, g.unsqueeze(-1)).squeeze(-1))
                continue
            g = read_canonical(op)
            if g is None:
                continue
            if self.shape == "unit":  # (R, U, U) factors, one solve per unit
                write_canonical(op, _solve(pre, g.unsqueeze(-1)).squeeze(-1))
            else:
                write_canonical(op, g * pre.to(g.dtype))

    # -- state ----------------------------------------------------------------------
    def _extra_state(self) -> dict[str, Any]:
        return {
            "fisher": dict(self.fisher),
            "preconditioner": dict(self.preconditioner),
            "generator": self._generator_state(),
        }

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        keys = ("fisher", "preconditioner", "generator")
        check_extra_state(state, keys, tensor_maps=keys[:2])
        known = {""} if self.shape == "full" else set(self.ops)
        for key in keys[:2]:
            unknown = set(state[key]) - known
            if unknown:
                raise ValueError(
                    f"state['extra'][{key!r}] names modules {sorted(unknown)} that "
                    f"this maker does not precondition ({sorted(known)})"
                )
        self.fisher = {k: v.clone() for k, v in state["fisher"].items()}
        self.preconditioner = {k: v.clone() for k, v in state["preconditioner"].items()}
        self.generators.set_state(state["generator"])
