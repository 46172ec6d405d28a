r"""Shared machinery of the Kronecker-factored makers (K-FAC, EKFAC).

:class:`KronFactorMaker` runs the curvature pass through the curvature layer's
:class:`~leantrain.precond.curv.CurvatureCollector` and keeps, per module, the
(bias-corrected EMA) Kronecker factors ``A`` (inputs) and ``B`` (output-gradients)
of every site, or the exact unit blocks of LayerNorm / BatchNorm. Subclasses turn
them into a preconditioner.

Gradients are handled in the curvature layer's *canonical layout*: a module's
gradient is a matrix ``G`` of shape ``(R, U)`` (output units by ``[inputs, 1]``);
for ``nn.Linear`` it is ``[dW, db]``, for ``nn.Conv2d`` the weight flattened per
output channel with its bias, for ``nn.Embedding`` the weight transposed, for
``nn.MultiheadAttention`` ``[in_proj_weight, in_proj_bias]``. K-FAC then reads
``(B ⊗ A)^{-1} vec(G) = vec(B^{-1} G A^{-1})``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from leantrain.precond._checks import check_extra_state
from leantrain.precond._coverage import hidden_parameters
from leantrain.precond._fisher import FisherMaker
from leantrain.precond._gram import LowRankFactor
from leantrain.precond._output_grad_shortcut import LinearCapture
from leantrain.precond._safeguards import PlainGradient
from leantrain.precond.curv import (
    CurvatureCollector,
    cholesky_ex,
    damped_cholesky,
    damped_inverse,
)
from leantrain.precond.curv.modules import ModuleOp
from leantrain.precond.gradient_maker import unwrap_model
from leantrain.precond.preconditioned import PreconditioningConfig

__all__ = [
    "KronFactorMaker",
    "damped_inverses",
    "read_canonical",
    "write_canonical",
]


def damped_inverses(
    matrices: list[Tensor], dampings: list[float], *, cholesky: bool = False
) -> list[Tensor]:
    """:func:`damped_inverse` of every matrix with its own damping (or, with
    ``cholesky``, :func:`~leantrain.precond.curv.damped_cholesky`'s lower factor),
    one batched factorization per group of the same shape, dtype and device.

    The same arithmetic on the same entries as one matrix at a time (LAPACK factors
    a batch member by member); what a batch saves is calls, and on a GPU the check
    of each factorization's ``info``, which waits for the device: one wait per
    group instead of one per factor. A group where a member fails is redone one
    matrix at a time, through the single-matrix path and its float64 retry.
    """
    groups: dict[tuple, list[int]] = {}
    for i, m in enumerate(matrices):
        groups.setdefault((m.shape, m.dtype, m.device), []).append(i)
    out: list[Tensor] = [matrices[0]] * len(matrices)
    for (_, dtype, _), members in groups.items():
        result = None
        if dtype in (torch.float32, torch.float64):
            damped = torch.stack([matrices[i] for i in members])
            for k, i in enumerate(members):  # scalars: nothing copied to the device
                damped[k].diagonal().add_(dampings[i])
            factor, info = cholesky_ex(damped)
            if not bool((info != 0).any()):
                # row-major copies: see damped_inverse
                result = factor if cholesky else torch.cholesky_inverse(factor)
        for k, i in enumerate(members):
            if result is not None:
                out[i] = result[k].contiguous()
            elif cholesky:
                out[i] = damped_cholesky(matrices[i], dampings[i]).contiguous()
            else:
                out[i] = damped_inverse(matrices[i], dampings[i]).contiguous()
    return out


def read_canonical(op: ModuleOp) -> Tensor | None:
    """The module's gradient in canonical ``(R, U)`` layout (``None``: no grad)."""
    grads = [p.grad for p in op.params]
    if all(g is None for g in grads):
        return None
    module = op.module
    if isinstance(module, (nn.Linear, nn.Conv2d)):  # fast path: no gather
        w = grads[0] if grads[0] is not None else torch.zeros_like(op.params[0])
        w = w.reshape(w.shape[0], -1)
        if len(grads) == 1:
            return w
        b = grads[1] if grads[1] is not None else torch.zeros_like(op.params[1])
        return torch.cat([w, b.unsqueeze(1)], dim=1)
    flat = torch.cat(
        [
            (g if g is not None else torch.zeros_like(p)).reshape(-1)
            for p, g in zip(op.params, grads, strict=True)
        ]
    )
    return flat[op.index_on(flat.device)]


def write_canonical(op: ModuleOp, canon: Tensor) -> None:
    """Write a canonical ``(R, U)`` matrix back into the module's ``.grad`` fields."""
    module = op.module
    if isinstance(module, (nn.Linear, nn.Conv2d)):
        pieces = [canon[:, : op.params[0][0].numel()]]
        if len(op.params) == 2:
            pieces.append(canon[:, -1])
    else:
        flat = canon.new_empty(op.numel)
        flat[op.index_on(flat.device).reshape(-1)] = canon.reshape(-1)
        pieces = list(flat.split([p.numel() for p in op.params]))
    for p, piece in zip(op.params, pieces, strict=True):
        piece = piece.reshape(p.shape).to(p.dtype)
        if p.grad is None:
            p.grad = piece.clone()
        else:  # in place: DDP may hold .grad as a view of its buckets
            p.grad.copy_(piece)


class _PassCollector(CurvatureCollector):
    """The curvature layer's collector, with a callback on every backward pass.

    EKFAC needs the per-pass sites (inputs and output-gradients) to re-estimate its
    scaling in the eigenbasis; the collector only keeps running factor sums.

    For the modules in :attr:`low_rank` (one-site linear maps) the factors are not
    formed: :meth:`statistics` returns them as :class:`LowRankFactor` rows (inputs
    with the bias column, scaled ``1/N``; the output-gradients of every pass), for
    K-FAC's Gram-matrix inverses (``_gram.py``).
    """

    on_pass: Callable[[dict], None] | None = None
    low_rank: frozenset[str] = frozenset()

    def reset(self) -> None:
        super().reset()
        self._grad_rows: dict[str, list[Tensor]] = {}

    def _wants_kron(self, name: str) -> bool:
        return name not in self.low_rank

    def _update(self, data: dict) -> None:
        super()._update(data)
        for name in self.low_rank:
            for site in data.get(name) or ():
                e = site.e.reshape(-1, site.e.shape[-1])
                self._grad_rows.setdefault(name, []).append(e)
        if self.on_pass is not None:
            self.on_pass({name: sites for name, sites in data.items() if sites})

    def statistics(self) -> dict[str, dict]:
        out = super().statistics()
        for name in self.low_rank:
            calls, grads = self._calls[name], self._grad_rows.get(name)
            if not calls or not grads:
                continue  # no forward, or no gradient reached the module
            op = self.ops[name]
            n = calls[0][0]["a"][0].shape[0]  # examples: A = rows^T rows / N
            out[name]["A"] = [LowRankFactor(op.input_rows(calls), 1.0 / n)]
            rows = grads[0] if len(grads) == 1 else torch.cat(grads)
            out[name]["B"] = [LowRankFactor(rows, 1.0)]
            out[name]["rows"] = op.site_rows(calls)
        return out


class KronFactorMaker(FisherMaker):
    """Base of the makers built on Kronecker factors ``B ⊗ A`` (see module doc).

    A subclass that can precondition a linear layer from ``(E, X)`` directly sets
    :attr:`factored_gradients`; the weight gradients of the layers where that is
    cheaper are then never formed (single process only) and :meth:`precondition`
    must consume :attr:`_captured`.

    Args:
        model: the module to train (plain or ``DistributedDataParallel``).
        config: schedule, damping, EMA decay, ignored modules.
        **fisher: the Fisher options of :class:`~leantrain.precond._fisher.FisherMaker`
            (``fisher_type``, ``n_mc_samples``, ``loss_type``, ...).
    """

    def __init__(
        self,
        model: nn.Module,
        config: PreconditioningConfig | None,
        **fisher: Any,
    ) -> None:
        # Per module name: {"A": [..], "B": [..], "rows": [..]} or {"unit": tensor}.
        self.factors: dict[str, dict[str, Any]] = {}
        self._stats: dict[str, dict] = {}
        super().__init__(model, config, **fisher)
        inner = unwrap_model(model)
        # The collector refuses modules it cannot handle, and ignoring by name covers
        # a whole subtree (the root's name "" covers everything), so the parameters
        # of every module we leave alone are hidden from it while it is built: they
        # keep their plain gradients and the modules inside them stay tracked.
        with hidden_parameters(inner, {name for name, _ in self.modules()}):
            self._collector = _PassCollector(
                inner,
                shapes=("kron",),
                # BatchNorm in training mode: batch statistics treated as constants.
                allow_batch_coupling=True,
                # A per-example check each step would double the curvature cost.
                check_gradients=False,
            )
        self.ops: dict[str, ModuleOp] = self._collector.ops
        # Output-gradient / input pairs of the layers whose weight gradient was
        # skipped this step (see LinearCapture); precondition() consumes them.
        self._captured: dict[str, tuple[Tensor, Tensor]] = {}
        self._capture = LinearCapture(
            {
                name: op.module
                for name, op in self.ops.items()
                if self.factored_gradients and type(op.module) is nn.Linear
            }
        )

    factored_gradients = False
    scales_loss = True
    records_in_loop = True

    def _accumulation_refusal(self) -> str | None:
        return None

    # -- the passes -------------------------------------------------------------
    def _discard_pass(self) -> None:
        self._captured = {}  # a skipped pass's (X, E) must not reach a later step

    def _plain_gradient(self, *, keep: bool, norms: bool = True) -> PlainGradient:
        # A captured layer's plain gradient E^T [X, 1] is never formed: it enters
        # as its (X, E).
        index = {name: i for i, (name, _) in enumerate(self.modules())}
        factored = {
            index[name]: (x, e, len(self.ops[name].params) == 2)
            for name, (x, e) in self._captured.items()
        }
        return PlainGradient(self._layer_gradients(), factored, keep=keep, norms=norms)

    def _unwritten_gradients(self) -> list[Tensor]:
        # Captured layers hold (X, E) instead of .grad until precondition().
        return [t for pair in self._captured.values() for t in pair]

    def _capturing(self) -> bool:
        """Skip weight gradients of factored layers? Never under DDP (the wrapper
        averages ``.grad``; ``E`` and ``X`` are per rank)."""
        return (
            bool(self._capture.modules)
            and self._loss_scale == 1.0  # the captured E would carry the scale
            and self._process_group() is None
            and not isinstance(self.model, nn.parallel.DistributedDataParallel)
        )

    def _forward_backward(self) -> tuple[Any, Tensor]:
        if not self._capturing():
            return super()._forward_backward()
        with self._capture:
            output = self._call_model()
            loss = self._loss_from_output(output)
        usable = self._capture.usable()
        if not usable:  # nothing to skip: exactly loss.backward()
            self._captured = {}
            loss.backward()
            return output, loss
        # Like the curvature pass, only the model's parameters receive gradient.
        self._loss_grads(loss, [], retain_graph=False, captured=usable)
        return output, loss

    def _loss_grads(
        self,
        loss: Tensor,
        extra: list[Tensor],
        *,
        retain_graph: bool,
        captured: dict | None = None,
    ) -> tuple:
        """Gradient of ``loss``: into ``.grad`` of the model's parameters, except
        the captured layers (their ``(X, E)`` go to :attr:`_captured`); returns the
        gradients w.r.t. ``extra``. ``captured``: the capture's usable layers when
        the caller has just asked for them."""
        params = [p for p in unwrap_model(self.model).parameters() if p.requires_grad]
        if captured is None:
            captured = self._capture.usable() if self._capturing() else {}
        skip = {id(p) for name in captured for p in self.ops[name].params}
        params = [p for p in params if id(p) not in skip]
        outputs = [out for _, out in captured.values()]
        grads = torch.autograd.grad(
            loss,
            params + outputs + extra,
            retain_graph=retain_graph,
            allow_unused=True,
        )
        self._add_grads(params, list(grads[: len(params)]))
        self._captured = {
            name: (x, torch.zeros_like(out) if e is None else e)
            for (name, (x, out)), e in zip(
                captured.items(), grads[len(params) :], strict=False
            )
        }
        return grads[len(params) + len(outputs) :]

    def _curvature_pass(self) -> tuple[Any, Tensor]:
        fn = self._unwrapped_call()  # we average gradient and factors ourselves
        capture = self._capture if self._capturing() else contextlib.nullcontext()
        with torch.enable_grad(), self._collector, capture:
            output = self._call_model(fn)
            loss = self._loss_from_output(output)
            logits = self._logits(output)
            emp = self.fisher_type == "fisher_emp"
            dlogits = self._loss_grads(loss, [logits] if emp else [], retain_graph=True)
            emp_vector = dlogits[0] / self._loss_scale if emp else None
            self._collector.accumulate(logits, self._vectors(logits, emp_vector))
        self._stats = self._collector.statistics()
        self._collector.reset()
        self._sync_stats()
        return output, loss.detach()

    def _sync_stats(self) -> None:
        tensors = []
        for name in sorted(self._stats):
            stats = self._stats[name]
            for key in ("A", "B"):
                tensors += [t for t in stats.get(key, []) if t is not None]
            if "unit" in stats:
                tensors.append(stats["unit"])
        self._all_reduce_mean(tensors)

    # -- factors ----------------------------------------------------------------
    def update_curvature(self) -> None:
        """Fold this pass's factors into the (EMA) estimates in :attr:`factors`."""
        for name, stats in self._stats.items():
            if "unit" in stats:
                self.factors[name] = {
                    "unit": self._ema_update(f"{name}/U", stats["unit"])
                }
                continue
            if "A" not in stats:
                continue  # the module saw no gradient in this pass
            factors = {"A": [], "B": [], "rows": stats["rows"]}
            for i, (a, b) in enumerate(zip(stats["A"], stats["B"], strict=True)):
                if b is None:  # this site saw no gradient: its B is zero
                    k = stats["rows"][i].stop - stats["rows"][i].start
                    b = a.new_zeros(k, k)
                factors["A"].append(self._ema_update(f"{name}/A{i}", a))
                factors["B"].append(self._ema_update(f"{name}/B{i}", b))
            self.factors[name] = factors
        self._stats = {}

    # -- state ------------------------------------------------------------------
    # ``state['extra']`` holds the factors, the subclass's preconditioner tensors
    # (flat name -> tensor, under this key) and the Monte-Carlo generator.
    preconditioner_key = "preconditioner"

    def _preconditioner_state(self) -> dict[str, Tensor]:
        raise NotImplementedError

    def _load_preconditioner_state(self, tensors: dict[str, Tensor]) -> None:
        raise NotImplementedError

    def _extra_state(self) -> dict[str, Any]:
        return {
            "factors": self._factor_state(),
            self.preconditioner_key: self._preconditioner_state(),
            "generator": self._generator_state(),
        }

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        keys = ("factors", self.preconditioner_key, "generator")
        check_extra_state(state, keys, tensor_maps=keys[:2])
        self._load_factor_state(state["factors"])
        self._load_preconditioner_state(state[self.preconditioner_key])
        self.generators.set_state(state["generator"])

    def _factor_state(self) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for name, f in self.factors.items():
            if "unit" in f:
                out[f"{name}/U"] = f["unit"]
            else:
                for i, (a, b) in enumerate(zip(f["A"], f["B"], strict=True)):
                    out[f"{name}/A{i}"], out[f"{name}/B{i}"] = a, b
        return out

    def _load_factor_state(self, state: dict[str, Tensor]) -> None:
        factors: dict[str, dict[str, Any]] = {}
        for key, value in state.items():
            name, _, part = key.rpartition("/")
            if name not in self.ops:
                raise ValueError(f"factor {key!r} names no preconditioned module")
            if part == "U":
                factors[name] = {"unit": value.clone()}
                continue
            f = factors.setdefault(name, {"A": {}, "B": {}})
            f[part[0]][int(part[1:])] = value.clone()
        for name, f in factors.items():
            if "unit" in f:
                continue
            n = len(f["A"])
            f["A"] = [f["A"][i] for i in range(n)]
            f["B"] = [f["B"][i] for i in range(n)]
            op = self.ops[name]
            f["rows"] = (
                [slice(0, op.canon_index.shape[0])]
                if n == 1
                else [
                    slice(i * b.shape[0], (i + 1) * b.shape[0])
                    for i, b in enumerate(f["B"])
                ]
            )
        self.factors = factors
