r"""Curvature statistics of a hook-based maker, recorded in the user's own loop.

A gradient maker's curvature pass runs the forward itself, back-propagates the loss
and then the Fisher vectors from the logits, with the curvature collector's hooks
attached. :class:`LoopRecorder` gets the same statistics from a forward and a
``loss.backward()`` that the user's loop runs:

* the collector's forward hooks record every tracked module's inputs, and a forward
  hook on the maker's model (the module whose output holds the logits) closes the
  recording of that call;
* ``fisher_emp``: the collector's gradient hooks keep the output-gradients of the
  user's backward, which are the loss gradient back-propagated from the logits, the
  vector the maker itself uses (times ``sqrt(r)``, corrected at the step);
* ``fisher_mc`` / ``fisher_exact``: the Fisher vectors are drawn from the logits
  inside that forward hook and back-propagated to the module outputs there (the
  graph exists then; the user's backward frees it), as the maker's pass does.

Every model call with gradients between two optimizer steps is one micro-batch. With
the convention of gradient accumulation in HF ``Trainer`` and Lightning (the
micro-batch losses sum to the mean loss over their union), :meth:`LoopRecorder.collect`
rescales each micro-batch's output-gradients to those of the union batch, so the
statistics are the maker's on the concatenated batch: ``B`` and the per-example
sums add, ``A`` is the example-weighted mean of the micro-batch ``A``.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from leantrain.precond._denormal import autocast_off
from leantrain.precond._gram import LowRankFactor
from leantrain.precond.curv import as_loss_spec
from leantrain.precond.curv._recompute import refuse_reentrant_checkpoint
from leantrain.precond.curv.extension import eager
from leantrain.precond.curv.kinds import reduction_factor
from leantrain.precond.gradient_maker import unwrap_model

__all__ = ["LoopRecorder", "ModuleHookGuards", "amp_scale"]


@dataclass
class _Forward:
    """One recorded model call: the collector's calls, and what scales them."""

    calls: dict[str, list]
    batch: int
    inv_r: float  # 1 / r: the number of terms the mean loss divides by
    passes: list[dict] = field(default_factory=list)  # Fisher vectors' sites


class LoopRecorder:
    """Records a Fisher maker's curvature data from the user's forward and backward.

    Args:
        maker: a :class:`~leantrain.precond._kron.KronFactorMaker` or
            :class:`~leantrain.precond._hooked.HookedMaker` (it owns the collector).
    """

    def __init__(self, maker: Any) -> None:
        self.maker = maker
        self.collector = maker._collector
        self.root = unwrap_model(maker.model)
        self.empirical = maker.fisher_type == "fisher_emp"
        self._forwards: list[_Forward] = []
        self._root_handle: Any = None

    @property
    def recording(self) -> bool:
        """Whether the hooks are attached (the next step updates the curvature)."""
        return self._root_handle is not None

    @property
    def micro_batches(self) -> int:
        """Model calls recorded since the last :meth:`collect`."""
        return len(self._forwards)

    def start(self) -> None:
        """Attach the hooks: the following model calls are recorded."""
        if self.recording:
            return
        self.collector.reset()
        self.collector.attach()
        # After the collector's hooks: the model's own hook fires once its
        # submodules' forwards (and their recordings) are done.
        self._root_handle = self.root.register_forward_hook(
            eager(self._on_model_forward)
        )
        # fisher_emp: the gradient hooks record during the user's backward, and
        # so do a reentrant checkpoint's re-runs there (its first forward had no
        # gradients), for the last recorded call.
        self.collector._in_pass = self.empirical
        if self.empirical:
            self.collector.reentrant_calls = self._last_calls

    def stop(self) -> None:
        """Detach every hook and forget what was recorded."""
        if self._root_handle is not None:
            self._root_handle.remove()
            self._root_handle = None
        self.collector.detach()
        self.collector._in_pass = False
        self.collector.reentrant_calls = None
        self.collector.reset()
        self._forwards = []

    def _last_calls(self) -> dict[str, list]:
        if not self._forwards:
            raise RuntimeError(
                "a reentrant checkpoint re-ran a module inside a backward, but no "
                "model call was recorded before it"
            )
        return self._forwards[-1].calls

    # -- recording -------------------------------------------------------------
    def _on_model_forward(self, module: Any, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled() or module is not self.root:
            return  # evaluation (no backward follows), or a deep copy of the model
        coll, maker = self.collector, self.maker
        calls, outputs = coll._calls, coll._outputs
        # A fresh recording for the next call (its own batch: micro-batches may
        # differ in size); the gradient hooks of this call keep writing into its
        # own call records.
        coll.next_call()
        logits = maker._logits(output)
        spec = as_loss_spec(maker.loss_type)
        spec = type(spec)(spec.name, maker.loss_reduction)
        out = logits.detach()
        if spec.name == "cross_entropy":
            targets = torch.zeros(out.shape[:-1], dtype=torch.long, device=out.device)
        else:
            targets = torch.zeros_like(out)
        forward = _Forward(
            calls, int(out.shape[0]), 1.0 / reduction_factor(spec, out, targets)
        )
        if not self.empirical:
            with refuse_reentrant_checkpoint(type(maker).__name__):
                for vector in maker._vectors(logits, None):
                    forward.passes.append(
                        self._vector_pass(calls, outputs, logits, vector)
                    )
        self._forwards.append(forward)

    def _vector_pass(
        self, calls: dict, outputs: list, logits: Tensor, vector: Tensor
    ) -> dict:
        """Back-propagate ``vector`` from the logits to the module outputs; return
        this pass's sites (as the collector's ``backward_pass``, statistics later)."""
        coll = self.collector
        for records in calls.values():
            for _, grads in records:
                grads[:] = [None] * len(grads)
        vector = vector.to(logits.dtype)
        if outputs and all(t._version == v for *_, t, v in outputs):
            grads = torch.autograd.grad(
                logits,
                [t for *_, t, _ in outputs],
                grad_outputs=vector,
                retain_graph=True,
                allow_unused=True,
            )
            for (name, call, slot, _, _), grad in zip(outputs, grads, strict=True):
                if grad is not None:
                    call[1][slot] = coll.ops[name].grad_feature(slot, grad)
        elif outputs:  # an output was modified in place: its hook sees the gradient
            coll._in_pass = True
            try:
                torch.autograd.grad(
                    logits,
                    [p for op in coll.ops.values() for p in op.params],
                    grad_outputs=vector,
                    retain_graph=True,
                    allow_unused=True,
                )
            finally:
                coll._in_pass = False
        return {name: op.combine(calls[name]) for name, op in coll.ops.items()}

    # -- the step --------------------------------------------------------------
    @autocast_off()
    def collect(self, loss_scale: float = 1.0) -> None:
        """Fold the recorded micro-batches into the maker's pass results.

        Sets what the maker's own curvature pass sets (``_stats``, and for the
        hook-based natural-gradient family ``_full`` / ``_sites``), then forgets the
        recording; the hooks stay attached. ``loss_scale``: the factor the losses
        were multiplied by before the backward (a GradScaler's), divided out of the
        recorded output-gradients.

        Raises:
            RuntimeError: no model call was recorded, or a maker that keeps
                per-pass sites saw more than one micro-batch.
            ValueError: a tracked module did not see the batch in dim 0.
        """
        forwards, self._forwards = self._forwards, []
        maker, coll = self.maker, self.collector
        if not forwards:
            raise RuntimeError(
                f"{type(maker).__name__}: no call of the model "
                f"({type(self.root).__name__}) with gradients was recorded since the "
                "last optimizer step, but this step updates the curvature. The maker "
                "must be built on the module whose call returns the logits (its "
                "forward hook captures them), and the loop must call it before "
                "optimizer.step()."
            )
        keeps_sites = getattr(coll, "keep_sites", False)
        if keeps_sites and len(forwards) > 1:
            raise RuntimeError(
                f"{type(maker).__name__} keeps the per-example gradients of one "
                f"batch, but {len(forwards)} model calls (micro-batches) ran since "
                "the last step; gradient accumulation is not supported for it (use "
                "K-FAC, EKFAC, Shampoo or NaturalGradientMaker)."
            )
        # Mean reduction: r of the union is 1 / (the union's number of terms).
        union_inv_r = sum(f.inv_r for f in forwards)
        if maker.loss_reduction == "sum":
            union_inv_r = 1.0
        coll.reset()
        for f in forwards:
            if self.empirical:
                # The user's output-gradients are r_union * grad(l_n); the
                # maker's vector is the loss gradient / sqrt(r_union).
                scale = math.sqrt(union_inv_r) / loss_scale
                passes = [{n: op.combine(f.calls[n]) for n, op in coll.ops.items()}]
            else:  # vectors of this micro-batch carry sqrt(r_j); the union sqrt(r)
                scale = math.sqrt(f.inv_r / union_inv_r)
                if maker.loss_reduction == "sum":
                    scale = 1.0
                passes = f.passes
            for data in passes:
                for name, sites in data.items():
                    if sites and coll.ops[name].n_examples(sites) != f.batch:
                        raise ValueError(
                            f"module {name!r} saw dim 0 of size "
                            f"{coll.ops[name].n_examples(sites)} but the batch has "
                            f"{f.batch} examples; every tracked module must see the "
                            "batch in dim 0 (list it in ignore_modules)"
                        )
                    if scale != 1.0:
                        for site in sites:
                            site.e = site.e * scale
                coll._update(data)
                coll.n_passes += 1
        coll._calls = forwards[-1].calls
        if hasattr(maker, "_sync_stats"):  # Kronecker makers
            maker._stats = coll.statistics()
            if len(forwards) > 1:
                self._union_input_factors(maker._stats, forwards)
            coll.reset()
            maker._sync_stats()
            return
        if coll.accumulate_stats:
            maker._stats = coll.statistics()
            full = coll.full
            if full is not None:
                index = maker.flat_index()
                full = full[index.unsqueeze(-1), index.unsqueeze(-2)]
            maker._full = full
        maker._sites = coll.sites
        coll.reset()

    def _union_input_factors(self, stats: dict, forwards: list[_Forward]) -> None:
        """Replace the last micro-batch's ``A`` by the union batch's: the
        example-weighted mean (low-rank factors: their rows stacked)."""
        coll = self.collector
        for name, module_stats in stats.items():
            if "A" not in module_stats:
                continue
            op = coll.ops[name]
            live = [f for f in forwards if f.calls[name]]
            total = sum(f.batch for f in live)
            if isinstance(module_stats["A"][0], LowRankFactor):
                rows = torch.cat([op.input_rows(f.calls[name]) for f in live])
                module_stats["A"] = [LowRankFactor(rows, 1.0 / total)]
                continue
            parts = [op.kron_a(f.calls[name]) for f in live]
            module_stats["A"] = [
                sum(p[i] * (f.batch / total) for p, f in zip(parts, live, strict=True))
                for i in range(len(parts[0]))
            ]


_HOOK_GUARDS = "skip_nnmodule_hook_guards"
# Process-wide, as the option is: how many leases are held, and the value the first
# one found (restored by the last one).
_hook_guard_leases = {"held": 0, "found": None}


class ModuleHookGuards:
    """A lease on dynamo's guards on module hooks, for one recorder's lifetime.

    Dynamo does not guard compiled graphs on module hooks by default
    (``torch._dynamo.config.skip_nnmodule_hook_guards = True``): a graph traced
    without the recorder's hooks would keep running without them (no statistics),
    and one traced with them would keep calling them after they are removed. With
    the guards, attaching or removing the hooks selects the graph traced for that
    state (two graphs).

    The option is read when dynamo builds a graph's guards, inside the user's
    compiled call, which the recorder does not wrap; so it is off while at least
    one lease is held (from the first step of a ``PreconditionedOptimizer`` after
    ``torch._dynamo`` is loaded until its ``close()`` or its collection) and put
    back exactly as it was found when the last lease is released. Graphs compiled
    before the first lease carry no hook guard and are dropped once
    (``torch._dynamo.reset()``); graphs compiled under a lease keep their extra
    guards afterwards, which is safe.
    """

    def __init__(self) -> None:
        self.held = False

    def acquire(self) -> None:
        """Hold the guards on (a no-op while held or before dynamo is loaded)."""
        if self.held:
            return
        dynamo = sys.modules.get("torch._dynamo")  # imported by torch.compile
        if dynamo is None or not hasattr(dynamo.config, _HOOK_GUARDS):
            return  # nothing compiled yet (asked again before every step)
        if _hook_guard_leases["held"] == 0:
            found = getattr(dynamo.config, _HOOK_GUARDS)
            _hook_guard_leases["found"] = found
            if found:
                setattr(dynamo.config, _HOOK_GUARDS, False)
                dynamo.reset()
        _hook_guard_leases["held"] += 1
        self.held = True

    def release(self) -> None:
        """Give the lease back; the last one restores the value found."""
        if not self.held:
            return
        self.held = False
        _hook_guard_leases["held"] -= 1
        if _hook_guard_leases["held"] == 0:
            dynamo = sys.modules["torch._dynamo"]
            setattr(dynamo.config, _HOOK_GUARDS, _hook_guard_leases["found"])


@torch.no_grad()
def amp_scale(
    optimizer: torch.optim.Optimizer, grad_scale: Tensor | None, grad_scaler: Any
) -> float | Tensor:
    """The loss scale of a ``GradScaler.step(optimizer)`` call; unscales ``.grad``
    when the scaler has not (``grad_scale`` given). A given ``grad_scale`` comes
    back as the scaler's 0-dim tensor, read on the host only by a step that
    records curvature (a steady step need not wait for the device).

    Raises:
        RuntimeError: the scaler unscaled ``.grad`` already and was not given to
            the optimizer, so the recorded statistics cannot be unscaled.
    """
    if grad_scale is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.div_(grad_scale.to(p.grad.dtype))
        return grad_scale
    if grad_scaler is None:
        raise RuntimeError(
            "GradScaler.unscale_(optimizer) ran before GradScaler.step(optimizer) "
            "(e.g. for gradient clipping): pass the scaler as "
            "PreconditionedOptimizer(optimizer, maker, grad_scaler=scaler) so the "
            "recorded curvature can be unscaled too"
        )
    return float(grad_scaler.get_scale())
