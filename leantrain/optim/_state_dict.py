"""Gefen's ``state_dict`` / ``load_state_dict`` hooks (checkpoint layout in and out).

``state_dict()`` puts each parameter's runtime state in the checkpoint layout of
``_checkpoint``; ``load_state_dict()`` validates a checkpoint-layout state, keeps it
aside from torch's dtype casting and installs it in the runtime layout (the rank's
part under FSDP2).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.optim import Optimizer

from . import _checkpoint, _checks, _dist
from ._options import second_moment_of
from ._state import share_codebooks
from .factored import factor_shape

# Keys kept on the CPU (0-dim bookkeeping, like torch's non-capturable `step`).
HOST_KEYS = ("step", "period", "qblock")


def label(group: dict, position: int, param: Tensor, index: int) -> str:
    """Names a parameter in messages: its name when the groups carry names."""
    names = group.get("param_names")
    if names is not None and position < len(names):
        return f"parameter '{names[position]}' (shape {tuple(param.shape)})"
    return f"parameter {index} (shape {tuple(param.shape)})"


class LazyLabel:
    """``label(group, position, param, index)``, formatted only when shown (an
    error or a warning): building it for every parameter at every step cost more
    than the step of a small tensor."""

    __slots__ = ("_args", "_text")

    def __init__(self, group: dict, position: int, param: Tensor, index: int):
        self._args = (group, position, param, index)
        self._text: str | None = None

    def __str__(self) -> str:
        if self._text is None:
            self._text = label(*self._args)
        return self._text


def group_pairs(
    optimizer: Optimizer, state_dict: dict, required: tuple[str, ...], kind: str
) -> list[tuple[dict, dict]] | None:
    """(this optimizer's group, the saved group) pairs, or None when the numbers of
    groups or parameters differ (torch's loader then raises its own error).

    Raises:
        ValueError: a saved group lacks one of the ``required`` option keys, i.e.
            the state dict is not one of a ``kind`` optimizer.
    """
    groups, saved_groups = optimizer.param_groups, state_dict["param_groups"]
    if len(groups) != len(saved_groups) or any(
        len(g["params"]) != len(s["params"])
        for g, s in zip(groups, saved_groups, strict=True)
    ):
        return None
    for index, saved in enumerate(saved_groups):
        if any(key not in saved for key in required):
            names = "/".join(f"'{key}'" for key in required)
            raise ValueError(
                f"not a {kind} state dict: param group {index} has no {names} "
                f"(its keys: {sorted(saved)})"
            )
    return list(zip(groups, saved_groups, strict=True))


def load_pre_hook(optimizer: Optimizer, state_dict: dict) -> dict | None:
    """Validates a Gefen state dict and keeps its per-parameter state aside.

    torch's ``load_state_dict`` casts every floating-point parameter's state to the
    parameter dtype (uint8 codes and int64 periods included). Gefen's state has
    fixed dtypes, so the per-parameter state is taken out here and installed
    unchanged (moved to the parameter's device) by ``load_post_hook``.
    """
    pairs = group_pairs(optimizer, state_dict, ("momentum_bits", "partition"), "Gefen")
    if pairs is None:
        return None  # torch raises its own ValueError for these
    for index, (group, saved) in enumerate(pairs):
        if saved["momentum_bits"] != group["momentum_bits"]:
            raise ValueError(
                f"param group {index}: the state dict has momentum_bits="
                f"{saved['momentum_bits']}, this optimizer momentum_bits="
                f"{group['momentum_bits']}"
            )
        mine, theirs = (
            group.get("second_moment", "blocks"),
            saved.get("second_moment", "blocks"),
        )
        # "auto" takes either layout; each state is checked against its group below
        if mine != theirs and "auto" not in (mine, theirs):
            raise ValueError(
                f"param group {index}: the state dict has second_moment={theirs!r}, "
                f"this optimizer second_moment={mine!r}"
            )
        _checks.check_group({**saved, "betas": tuple(saved["betas"])})
    id_map, where = {}, {}
    index = 0
    for group, saved in pairs:
        for position, (param, saved_id) in enumerate(
            zip(group["params"], saved["params"], strict=True)
        ):
            id_map[saved_id] = param
            where[saved_id] = (group, position, index, saved["momentum_bits"])
            index += 1
    pending = {}
    for saved_id, state in state_dict["state"].items():
        if saved_id not in id_map:
            continue
        group, position, index, bits = where[saved_id]
        param = id_map[saved_id]
        name = label(group, position, param, index)
        _checkpoint.check_checkpoint(
            state,
            param,
            bits,
            group["partition"],
            name,
            second_moment_of(group, param, state),
        )
        pending[param] = _checkpoint.from_checkpoint(state, param, bits)
    optimizer._pending_state = pending
    rest = {k: v for k, v in state_dict["state"].items() if k not in id_map}
    return {**state_dict, "state": rest}


def group_factors(group: dict, param: Tensor) -> tuple[int, int] | None:
    """``(R, C)`` when a fresh ``param`` gets a factored second moment."""
    if second_moment_of(group, param) != "factored":
        return None
    return factor_shape(tuple(param.shape))


def fresh(state: dict) -> bool:
    """True for a parameter without state or with a provisional one (period 0)."""
    return not state or int(state["period"]) == 0


def state_dict_post_hook(optimizer: Optimizer, state_dict: dict) -> dict:
    """Puts every parameter's state in the checkpoint layout (``_checkpoint``).

    Under FSDP2 this runs one MAX all_reduce over the concatenated block vectors of
    all sharded parameters, so every rank must call ``state_dict()`` (DCP does).
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    groups = [g for g in optimizer.param_groups for _ in g["params"]]
    items = []
    for index, saved in state_dict["state"].items():
        if not saved or index >= len(params):
            continue
        param, group = params[index], groups[index]
        vectors = _checkpoint.local_vectors(
            param, saved, group["partition"], group_factors(group, param)
        )
        items.append((index, param, group, saved, vectors))
    sharded = [it for it in items if _dist.is_sharded(it[1])]
    if sharded:
        flat = torch.cat([v for it in sharded for v in it[4].values()])
        flat = _dist.all_reduce(flat, "max", _dist.group_of(sharded[0][1]))
        pos = 0
        for it in sharded:
            for key, value in it[4].items():
                it[4][key] = flat[pos : pos + value.numel()]
                pos += value.numel()
    for index, param, group, saved, vectors in items:
        state_dict["state"][index] = _checkpoint.to_checkpoint(
            param,
            saved,
            group["momentum_bits"],
            group["partition"],
            vectors,
            group_factors(group, param),
        )
    return state_dict


def load_post_hook(optimizer: Optimizer) -> None:
    """Installs the kept state (fp32 as saved) and re-shares the codebooks."""
    pending = optimizer.__dict__.pop("_pending_state", {})
    copies: dict[int, Tensor] = {}  # keeps tensors shared in the checkpoint shared
    for param, saved in pending.items():
        state = {}
        for key, value in saved.items():
            if id(value) not in copies:
                device = "cpu" if key in HOST_KEYS else param.device
                copies[id(value)] = value.to(device=device, copy=True)
            state[key] = copies[id(value)]
        optimizer.state[param] = state
    share_codebooks(list(optimizer.state.values()))
