"""What Gefen and GefenMuon share: their step's bookkeeping around the one dispatch.

Both optimizers step the parameters that have a gradient, apply the same
non-finite policy to all of them before anything changes, key each parameter's
rounding streams by its fixed position in the optimizer, share one codebook per
momentum width, and hand their AdamW-style parameters (all of Gefen's, GefenMuon's
AdamW side) to ``_dispatch.step_many`` with the optimizer's one
``_dispatch.StepCache``. After a full step whose parameters all take the C kernel
the cache keeps its plan (``_fused_plan``), and the next step of those groups is
one kernel call (:meth:`GefenBase._planned_step`).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.optim import Optimizer

from . import _checks, _dist, _dtensor
from ._dispatch import StepCache, StepItem, step_many
from ._fused_plan import build_plan
from ._state import state_bits
from ._state_dict import fresh as _fresh


class GefenBase(Optimizer):
    """The shared bookkeeping of :class:`~leantrain.optim.Gefen` and
    :class:`~leantrain.optim.GefenMuon` (not an optimizer of its own).

    A subclass sets ``nonfinite`` ("skip" or "raise") and ``nonfinite_steps``,
    gives :meth:`_label` (how an error names a parameter) and says whether it
    takes DTensor parameters (``takes_dtensors``: GefenMuon needs whole tensors).
    """

    nonfinite: str
    nonfinite_steps: int
    takes_dtensors = True

    @property
    def _steps(self) -> StepCache:
        """The optimizer's one cache of its steps (made on first use: an optimizer
        unpickled from before the cache existed gets one too)."""
        cache = self.__dict__.get("_cache")
        if cache is None:
            cache = self.__dict__["_cache"] = StepCache()
        return cache

    def _label(self, group: dict, position: int, param: Tensor, index: int) -> object:
        raise NotImplementedError

    def _active(self) -> list[tuple[dict, Tensor, object]]:
        """(group, param, label) of every parameter with a non-empty gradient."""
        active, index = [], 0
        for group in self.param_groups:
            for position, param in enumerate(group["params"]):
                label = self._label(group, position, param, index)
                index += 1
                if param.grad is None or param.numel() == 0:
                    continue
                grad = _dtensor.local(param.grad) if self.takes_dtensors else param.grad
                _checks.check_grad(grad, label)
                active.append((group, param, label))
        return active

    def _all_finite(self, active: list[tuple[dict, Tensor, object]]) -> bool:
        """Applies the non-finite policy; False means: skip this whole step.

        One batched verdict (one read on the host per device, not one per
        tensor). With sharded parameters it is agreed across their ranks (one small
        MIN all_reduce), so every rank skips or steps together.
        """
        if not self.takes_dtensors:
            finite = _checks.finite_flags([p.grad for _, p, _ in active])
        else:
            finite = self._agreed_finite(active)
        for ok, (_, _, label) in zip(finite, active, strict=True):
            if not ok:
                _checks.reject_nonfinite(self, label)
                return False
        return True

    def _agreed_finite(self, active: list[tuple[dict, Tensor, object]]) -> list:
        """The finite flags of possibly sharded gradients, agreed across ranks."""
        local = _dtensor.local
        finite = _checks.finite_flags([local(p.grad) for _, p, _ in active])
        sharded = [p for _, p, _ in active if _dtensor.is_sharded(p)]
        if sharded:
            # On the parameters' device: NCCL reduces device tensors only.
            flags = torch.tensor(finite, dtype=torch.float32, device=sharded[0].device)
            group = _dist.group_of(sharded[0])
            finite = [bool(f) for f in _dist.all_reduce(flags, "min", group)]
        return finite

    def _check_bits(self, active: list[tuple[dict, Tensor, object]]) -> None:
        """Rejects a group whose ``momentum_bits`` differ from its parameters'
        existing states. A state checked before with the same bits and codebook
        is not read again (the step cache keeps the answers of the last step)."""
        before, checked = self._steps.bits, {}
        for group, param, label in active:
            state = self.state[param]
            bits, codebook = group["momentum_bits"], state.get("codebook")
            entry = before.get(id(state))
            if not (entry and entry[0] is state and entry[1:] == (bits, codebook)):
                if not state or _fresh(state):
                    continue  # it gets the group's bits
                if state_bits(state) != bits:
                    raise ValueError(
                        f"{label}: its state holds momentum_bits={state_bits(state)} "
                        f"but its group now says {bits}; momentum_bits cannot change "
                        "after the first step"
                    )
            checked[id(state)] = (state, bits, codebook)
        self._steps.bits = checked

    def _positions(self) -> dict[int, int]:
        """A parameter's fixed position in the optimizer (by ``id``): the seed of
        its rounding streams."""
        return {
            id(p): i
            for i, p in enumerate(p for g in self.param_groups for p in g["params"])
        }

    def _codebook(self, bits: int) -> Tensor | None:
        """The optimizer's codebook for ``bits`` if any parameter holds one."""
        for state in self.state.values():
            codebook = state.get("codebook")
            if codebook is not None and codebook.numel() == 2**bits:
                return codebook
        return None

    def _planned_step(self, groups: list[dict]) -> bool:
        """The steady step of ``groups`` through the cached plan: True when it took
        the step (or found a non-finite gradient and applied the policy); False
        when there is no plan or it does not hold (then the caller takes the full
        path, which builds a new one)."""
        plan = self._steps.plan
        if plan is None:
            return False
        if plan.run(self, groups) is not None:
            return True
        self._steps.plan = None
        return False

    def _dispatched_step(
        self,
        groups: list[dict],
        active: list[tuple[dict, Tensor, object]],
        items: list[StepItem],
    ) -> None:
        """The full step of ``items`` (the parameters of ``active`` in ``groups``,
        in order) through the one dispatch, then the plan of the next step."""
        kinds = step_many(items, self._steps)
        self._steps.plan = build_plan(groups, active, items, kinds, self._steps.triton)
