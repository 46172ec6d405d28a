"""GefenMuon's validation: options, per-parameter state, and checkpoint loading.

A Muon parameter's state is Gefen's (docs/CONTRACTS.md) without ``exp_avg_sq``; an
AdamW-side parameter's state is exactly Gefen's. Loading a state dict checks every
state against its parameter and group before anything changes, and installs the
saved tensors unchanged (torch's loader would cast uint8 codes to the parameter
dtype), so a resume is bit-exact.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.optim import Optimizer

from ._muon_math import ADJUST_LR_FNS, check_ns_arguments
from ._options import as_float
from ._state import check_state, num_blocks
from ._state_dict import group_pairs

# Keys kept on the CPU (0-dim bookkeeping, like torch's non-capturable `step`).


def check_muon_options(
    lr: object,
    weight_decay: object,
    momentum: object,
    nesterov: object,
    ns_coefficients: object,
    eps: object,
    ns_steps: object,
    adjust_lr_fn: object,
) -> None:
    """Checks Muon's options with torch.optim's wording, naming the value."""
    if not 0.0 <= as_float(lr, "lr"):
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= as_float(weight_decay, "weight_decay"):
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if not 0.0 <= as_float(momentum, "momentum") < 1.0:
        raise ValueError(f"Invalid momentum value: {momentum}; allowed: [0, 1)")
    if not isinstance(nesterov, bool):
        raise TypeError(f"nesterov must be a bool, got {nesterov!r}")
    check_ns_arguments(ns_steps, ns_coefficients, eps)
    if adjust_lr_fn not in ADJUST_LR_FNS:
        raise ValueError(
            f"Invalid adjust_lr_fn: {adjust_lr_fn!r}; allowed: None, 'original', "
            "'match_rms_adamw'"
        )


def check_ns_dtype(ns_dtype: object) -> None:
    if ns_dtype is not None and not (
        isinstance(ns_dtype, torch.dtype) and ns_dtype.is_floating_point
    ):
        raise ValueError(
            f"Invalid ns_dtype: {ns_dtype!r}; allowed: None (bfloat16 on CUDA, "
            "float32 elsewhere) or a floating torch.dtype"
        )


def check_muon_state(state: dict, param: Tensor, bits: int | None, label: str) -> None:
    """Checks a Muon parameter's loaded state (Gefen's layout minus ``exp_avg_sq``).

    Raises:
        ValueError: naming ``label`` and what differs.
    """
    if not state:
        return
    if "exp_avg_sq" in state:
        raise ValueError(
            f"{label}: the state has 'exp_avg_sq', but a Muon parameter keeps no "
            "second moment (is this the state of an AdamW-side parameter?)"
        )
    period = state.get("period")
    period = int(period) if isinstance(period, Tensor) and period.numel() == 1 else 1
    # check_state knows the rest of the layout; give it the one key Muon lacks.
    blocks = num_blocks(param.numel(), max(1, period))
    check_state(
        {**state, "exp_avg_sq": torch.zeros(blocks, dtype=torch.float32)},
        param,
        bits,
        label,
    )


def load_pre_hook(optimizer: Optimizer, state_dict: dict) -> dict | None:
    """Validates a GefenMuon state dict and keeps its per-parameter state aside.

    The states are installed unchanged by ``_state_dict.load_post_hook`` (shared
    with Gefen); torch's loader only sees the rest (and restores the param groups).
    """
    pairs = group_pairs(
        optimizer, state_dict, ("use_muon", "momentum_bits"), "GefenMuon"
    )
    if pairs is None:
        return None  # torch raises its own ValueError for these
    for index, (group, saved) in enumerate(pairs):
        for key in ("use_muon", "momentum_bits"):
            if saved[key] != group[key]:
                raise ValueError(
                    f"param group {index}: the state dict has {key}={saved[key]!r}, "
                    f"this optimizer {key}={group[key]!r}"
                )
    pending, loaded = {}, set()
    for group, saved in pairs:
        params = zip(group["params"], saved["params"], strict=True)
        for position, (param, saved_id) in enumerate(params):
            state = state_dict["state"].get(saved_id)
            loaded.add(saved_id)
            if state is None:
                continue
            label = (
                f"parameter {position} of a param group (shape {tuple(param.shape)})"
            )
            check = check_muon_state if group["use_muon"] else check_state
            check(state, param, saved["momentum_bits"], label)
            pending[param] = state
    optimizer._pending_state = pending
    rest = {k: v for k, v in state_dict["state"].items() if k not in loaded}
    return {**state_dict, "state": rest}
