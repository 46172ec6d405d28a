"""Gefen's step options: the one object every step implementation takes, and the
one place where the "auto" options are resolved.

:class:`StepOptions` holds the hyper-parameters of one parameter's step, already
resolved (no "auto" left): the reference oracle (``_step.reference_step``), the
fused step (``_fused.fused_step``: C kernel, Triton kernels or the chunked PyTorch
fallback), the dispatch (``_dispatch.step_many``) and the cached plans
(``_fused_plan``) all read them from here, and :meth:`StepOptions.scalars` derives
the per-step scalars they share (:func:`scalar_options`: the group's options a
scheduler may change). :func:`options_of` turns a param group (Gefen's or
GefenMuon's AdamW side) and a parameter's state into one; the "auto" rules
(:func:`second_moment_of`, :func:`stochastic_codes_of` with :func:`resolved`,
:func:`update_clip_of`) live here and only here, with :func:`as_float`, the
options' number check.
"""

from __future__ import annotations

import math
import numbers
import struct
from dataclasses import dataclass

from torch import Tensor

# _dist's DTensor predicates, from the leaf below it (_dist imports the step's
# math, which imports this module); the name keeps second_moment_of's text as is.
from . import _dtensor as _dist
from .factored import factor_shape

__all__ = [
    "AUTO_UPDATE_CLIP",
    "MOMENTUM_ROUNDINGS",
    "StepOptions",
    "as_float",
    "max_step",
    "options_of",
    "own_v",
    "resolved",
    "scalar_options",
    "second_moment_of",
    "stochastic_codes_of",
    "update_clip_of",
]

# update_clip="auto": the bound for 4-bit momentum on a second moment of the weight's
# own (factored or per element). The codes are coarse near 0, so a weight with a
# small sqrt(v) in a block with a large absmax sees the codes' rounding error divided
# by that small sqrt(v): a step of many lr. One lr per element is Adam's own nominal
# step. A block-shared v does not have the problem (a quiet weight shares a loud
# block's v), and there a clip only cuts the legitimate steps of the loud weights
# (measured worse: docs/gefen.md, "Update clipping").
AUTO_UPDATE_CLIP = 1.0

# Gefen's ``momentum_rounding`` option: "auto" is stochastic for 4-bit codes and
# for 8-bit codes on a weight's own second moment, nearest for other 8-bit codes
# (:func:`stochastic_codes_of`; docs/gefen.md says why).
MOMENTUM_ROUNDINGS = ("auto", "nearest", "stochastic")


def max_step(lr: float, update_clip: float | None) -> float:
    """The largest step of one element, ``lr * update_clip`` rounded to fp32 once
    (every path compares fp32 steps with this same number); inf without a clip."""
    if update_clip is None:
        return math.inf
    try:
        return struct.unpack("f", struct.pack("f", lr * update_clip))[0]
    except OverflowError:  # beyond fp32's range: no fp32 step reaches it
        return math.inf


def as_float(value: object, what: str) -> float:
    """Returns ``value`` as a float; a 1-element tensor is accepted like torch does."""
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"Tensor {what} must be 1-element, got shape {value.shape}"
            )
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a real number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class StepOptions:
    r"""The resolved hyper-parameters of one parameter's Gefen step.

    Attributes:
        lr: learning rate.
        beta1: momentum decay.
        beta2: second-moment decay.
        eps: added to the bias-corrected :math:`\sqrt{v}`.
        weight_decay: decoupled weight decay (``param *= 1 - lr * weight_decay``).
        maximize: ascend instead of descend (g = -grad).
        update_clip: each element's :math:`|\hat m / (\sqrt{\hat v} + \epsilon)|`
            is clipped to this (a step of at most ``lr * update_clip``); None: no
            clip.
        stochastic_rounding: round a bf16/fp16 parameter stochastically; None: on
            for bf16, off otherwise (the reference rounds to nearest).
        stochastic_codes: store 4- or 8-bit codes with stochastic rounding
            (:mod:`leantrain.optim.code_rounding`) instead of the nearest code.
    """

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    maximize: bool = False
    update_clip: float | None = None
    stochastic_rounding: bool | None = None
    stochastic_codes: bool = False

    def scalars(self, step: float) -> dict[str, float]:
        """The per-step scalars of step number ``step``, in double here, rounded to
        fp32 once where used (``max_step``: already fp32, inf without a clip); the
        names are the C kernel's ``lt_hyper`` fields and the Triton jobs'."""
        return {
            "w1": 1 - self.beta1,
            "beta2": self.beta2,
            "omb2": 1 - self.beta2,
            "decay": 1 - self.lr * self.weight_decay,
            "step_size": self.lr / (1 - self.beta1**step),
            "sqrt_bc2": math.sqrt(1 - self.beta2**step),
            "eps": self.eps,
            "sign": -1.0 if self.maximize else 1.0,
            "max_step": max_step(self.lr, self.update_clip),
        }

    def max_step(self) -> float:
        """``lr * update_clip`` in fp32 (inf without a clip)."""
        return max_step(self.lr, self.update_clip)


def scalar_options(group: dict) -> tuple[float, float, float, float, float, bool]:
    """A group's per-step scalars ``(lr, beta1, beta2, eps, weight_decay,
    maximize)``, the options a scheduler may change between steps (GefenMuon's
    AdamW side has no ``maximize``: it never maximizes)."""
    beta1, beta2 = group["betas"]
    return (
        float(group["lr"]),
        float(beta1),
        float(beta2),
        float(group["eps"]),
        float(group["weight_decay"]),
        group.get("maximize", False),
    )


def options_of(
    group: dict, state: dict | None = None, *, maximize: bool | None = None
) -> StepOptions:
    """The step options of a parameter of ``group`` with ``state``, every "auto"
    resolved. ``maximize``: overrides the group's (GefenMuon's AdamW side has no
    such key and never maximizes)."""
    lr, beta1, beta2, eps, weight_decay, maximized = scalar_options(group)
    return StepOptions(
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        maximize=maximized if maximize is None else maximize,
        update_clip=update_clip_of(group, state),
        stochastic_rounding=group.get("stochastic_rounding"),
        stochastic_codes=stochastic_codes_of(group, state),
    )


def own_v(state: dict | None) -> bool:
    """True for a state whose second moment is each weight's own: factored, or
    per element (``period`` 1)."""
    if not state:
        return False
    return "factored" in state or int(state.get("period", 0)) == 1


def _fresh(state: dict | None) -> bool:
    return not state or int(state["period"]) == 0


def second_moment_of(group: dict, param: Tensor, state: dict | None = None) -> str:
    """The second moment ``param`` has or gets: "blocks" or "factored".

    The group's ``second_moment`` when it names one. ``"auto"`` is "factored" with
    ``partition="auto"`` on a parameter that factors (two or more dims, both sides
    >= 2) and is not FSDP2-sharded, whatever the momentum's precision: the factors
    follow each input's and each output's scale where a block mixes them, which
    closes most of the quality gap of blocks at a few hundredths of a byte per
    element (docs/gefen.md, "Factored second moment"). "blocks" otherwise (vectors,
    an explicit partition, sharded parameters). Once a state exists, "auto" is what
    that state holds, so a checkpoint made with either layout resumes as it was. A
    group without the key (a checkpoint from before the option) has blocks.
    """
    chosen = group.get("second_moment", "blocks")
    if chosen != "auto":
        return chosen
    if not _fresh(state):
        return "factored" if "factored" in state else "blocks"
    shape = factor_shape(tuple(param.shape))
    factors = (
        shape is not None
        and group["partition"] == "auto"
        and not _dist.is_sharded(param)
    )
    return "factored" if factors else "blocks"


def resolved(rounding: str, bits: int | None) -> bool:
    """Whether a group's ``momentum_rounding`` means stochastic codes for ``bits``.

    "auto" is stochastic for 4-bit codes and nearest for 8-bit ones; "stochastic"
    asks for it with 8-bit codes too (no effect on fp32 momentum).

    Raises:
        ValueError: ``rounding`` is not one of :data:`MOMENTUM_ROUNDINGS`.
    """
    if rounding not in MOMENTUM_ROUNDINGS:
        raise ValueError(
            f"Invalid momentum_rounding: {rounding!r}; allowed: 'auto', 'nearest' "
            "or 'stochastic'"
        )
    if bits == 4:
        return rounding != "nearest"
    return bits == 8 and rounding == "stochastic"


def stochastic_codes_of(group: dict, state: dict | None = None) -> bool:
    """Whether a param group's codes are rounded stochastically for a parameter
    with ``state`` (a group loaded from a checkpoint older than
    ``momentum_rounding`` has none: "auto").

    "auto" is stochastic for 4-bit codes, and for 8-bit codes on a second moment of
    the weight's own (:func:`own_v`): there a weight whose gradients stop keeps a
    nearest-rounded momentum residue that no longer decays while its own ``v``
    does, so its step grows without bound (docs/gefen.md, "4-bit momentum:
    stochastic code rounding"); a block-shared ``v`` bounds it.

    Raises:
        ValueError: ``momentum_rounding`` is not "auto", "nearest" or "stochastic".
    """
    rounding = group.get("momentum_rounding", "auto")
    if rounding == "auto" and group["momentum_bits"] == 8 and own_v(state):
        return True
    return resolved(rounding, group["momentum_bits"])


def update_clip_of(group: dict, state: dict | None = None) -> float | None:
    """The bound on each element's ``|m_hat / (sqrt(v_hat) + eps)|`` a param group
    asks for, for a parameter with ``state``: ``update_clip`` resolved. "auto" is
    :data:`AUTO_UPDATE_CLIP` for 4-bit momentum on a factored or per-element
    (``period`` 1) second moment, None otherwise (and None without a state); a group
    from a checkpoint older than the option has none: "auto". None: no clipping,
    AdamW's update.

    Raises:
        ValueError: not "auto", None or a positive finite number.
        TypeError: a number that is not real (a bool, a string other than "auto").
    """
    clip = group.get("update_clip", "auto")
    if isinstance(clip, str) and clip == "auto":
        if group["momentum_bits"] != 4 or state is None:
            return None
        return AUTO_UPDATE_CLIP if own_v(state) else None
    if clip is None:
        return None
    if isinstance(clip, str) or isinstance(clip, bool):
        raise ValueError(
            f"Invalid update_clip: {clip!r}; allowed: 'auto', None or a positive "
            "number (the largest |m_hat / (sqrt(v_hat) + eps)| of an element)"
        )
    value = as_float(clip, "update_clip")
    if not 0.0 < value < float("inf"):
        raise ValueError(
            f"Invalid update_clip: {clip!r}; must be positive and finite, or None "
            "(no clipping) or 'auto'"
        )
    return value
