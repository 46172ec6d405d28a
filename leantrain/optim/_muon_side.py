"""GefenMuon's Muon side for one step: which path each parameter's momentum takes.

The momentum of parameters whose tensors ``_triton_step.serves`` (CUDA) goes
through one Triton launch per gradient dtype (``_triton_momentum``) when the kernel
covers them; every other Muon parameter steps through the reference
``_muon_math.muon_step``, one at a time. Either way, the Newton–Schulz iteration
and the weight update (``_muon_math.muon_update``) run in torch per parameter, as
Muon's always do, and a parameter steps as the reference steps it (codes equal but
for ties, stochastic codes on the same keyed bits).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from . import _triton_momentum, _triton_step
from ._muon_math import default_ns_dtype, muon_momentum, muon_update
from ._options import stochastic_codes_of
from .code_rounding import code_key
from .quant import NearestCode

__all__ = ["MuonEntry", "step_muon_side"]


@dataclass
class MuonEntry:
    """One Muon parameter of this step: its group, state and rounding seed."""

    group: dict
    param: Tensor
    state: dict
    seed: int  # its position in the optimizer (code_rounding.code_key)


def _on_triton(entry: MuonEntry) -> bool:
    """Whether the entry's momentum takes the Triton kernel."""
    param = entry.param
    return (
        _triton_step.serves(param.device)
        and _triton_momentum.problem(param, param.grad, entry.state) is None
    )


def step_muon_side(
    entries: list[MuonEntry], quantizer: Callable[[Tensor], NearestCode]
) -> int:
    """One Muon step of every entry, in place. ``quantizer``: the optimizer's
    kept nearest-code quantizer of a codebook (for the reference path). Returns
    the number of Triton launches (0 when every entry took the reference)."""
    fast = [e for e in entries if _on_triton(e)]
    fast_ids = {id(e) for e in fast}
    updates: list[tuple[MuonEntry, Tensor]] = []
    jobs = []
    for e in fast:
        e.state["step"] += 1
        stochastic = stochastic_codes_of(e.group) and "codebook" in e.state
        key = code_key(e.seed, int(e.state["step"])) if stochastic else None
        jobs.append(
            _triton_momentum.job(
                e.param,
                e.param.grad,
                e.state,
                momentum=float(e.group["momentum"]),
                nesterov=e.group["nesterov"],
                code_key=key,
            )
        )
    outs, launches = _triton_momentum.launch(jobs)
    updates += list(zip(fast, outs, strict=True))
    for e in entries:
        if id(e) in fast_ids:
            continue
        e.state["step"] += 1
        codebook = e.state.get("codebook")
        update = muon_momentum(
            e.param,
            e.param.grad,
            e.state,
            momentum=float(e.group["momentum"]),
            nesterov=e.group["nesterov"],
            nearest=None if codebook is None else quantizer(codebook),
            stochastic_codes=stochastic_codes_of(e.group),
            seed=e.seed,
        )
        updates.append((e, update))
    for e, update in updates:
        group = e.group
        muon_update(
            e.param,
            update,
            lr=float(group["lr"]),
            weight_decay=float(group["weight_decay"]),
            ns_coefficients=group["ns_coefficients"],
            ns_steps=group["ns_steps"],
            eps=float(group["eps"]),
            adjust_lr_fn=group["adjust_lr_fn"],
            ns_dtype=group["ns_dtype"] or default_ns_dtype(e.param.device),
        )
    return launches
