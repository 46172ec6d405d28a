"""Gefen's checkpoint layout: world-size independent, DCP-ready.

At run time a parameter's state is laid out for the step (docs/CONTRACTS.md "Gefen
state": flat codes, ``[nb]`` block statistics, only the rank's part under FSDP2).
``Gefen.state_dict()`` exposes every parameter's state in the *checkpoint layout*
instead, and ``load_state_dict()`` maps it back, so that a checkpoint never depends
on the sharding and ``torch.distributed.checkpoint`` (DCP) can reshard it:

* ``exp_avg_codes`` in the parameter's shape (uint8). 4-bit codes are packed two per
  byte along the last dim when the parameter has ``ndim >= 2`` and an even last dim
  (the same bytes as the flat packing), otherwise stored one per byte. Under FSDP2
  they are a DTensor with the parameter's placements, so dim-0 shards hold exactly
  the codes of the parameter's rows.
* ``exp_avg_sq`` ``[NB]`` and ``exp_avg_absmax`` ``[NQ]`` padded with zeros to a
  length that depends only on the parameter's shape and the group's ``partition``
  (the most blocks any period that ``partition`` can choose would need), so that a
  template made before the period is known (DCP's zero-gradient initialisation) has
  the checkpoint's shapes. The first ``nb`` entries are the blocks. Under FSDP2 they
  are DTensors of global shape ``[NB]`` in the standard ``Shard(0)`` layout: the
  rank-local block windows (boundary blocks duplicated) are combined with one MAX
  ``all_reduce`` (every value is >= 0; duplicates are equal) and each rank keeps its
  standard chunk; loading gathers the vector and slices the rank's own window, which
  is what makes a change of world size free.
* ``exp_avg`` (fp32 momentum) in the parameter's shape, a DTensor like the codes.
* ``step``, ``period``, ``qblock``, ``codebook``: plain tensors, identical on every
  rank (DCP keeps one copy). ``period == 0`` marks a *provisional* state: a
  template made by a zero-gradient, zero-lr step, which the first real gradient
  replaces (the partition and codebook are never learned from a zero gradient).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import _dist
from ._sharded import block_window
from ._state import (
    FACTORED_KEY,
    _expect,
    check_factored,
    check_keys,
    codes_length,
    qblock_for,
)
from .factored import factor_shape
from .partition import period_floor
from .quant import pack_nibbles, unpack_nibbles


def min_period(n: int, partition: str | int) -> int:
    """The smallest period the group's ``partition`` can give ``n`` elements."""
    if n <= 1 or partition == "element":
        return 1
    if partition == "tensor":
        return n
    if partition == "auto":
        return period_floor(n, 256, 16384)
    return min(int(partition), n)


def padded_lengths(
    n: int, partition: str | int, factors: tuple[int, int] | None = None
) -> tuple[int, int]:
    """``(NB, NQ)``: checkpoint lengths of ``exp_avg_sq`` and ``exp_avg_absmax``
    (``factors``: ``(R, C)`` of a factored second moment, whose ``exp_avg_sq`` is
    its ``R + C`` factors)."""
    p = min_period(n, partition)
    nb = sum(factors) if factors is not None else max(1, -(-n // p))
    return nb, max(1, -(-n // qblock_for(p)))


def packed_rows(shape: tuple[int, ...], bits: int | None) -> bool:
    """True when 4-bit codes are stored packed along the last dim."""
    return bits == 4 and len(shape) >= 2 and shape[-1] % 2 == 0


def codes_shape(shape: tuple[int, ...], bits: int | None) -> tuple[int, ...]:
    """Checkpoint shape of ``exp_avg_codes``."""
    if packed_rows(shape, bits):
        return (*shape[:-1], shape[-1] // 2)
    return tuple(shape)


# ------------------------------------------------------------------ to checkpoint
def _codes_local(state: dict, local_shape: tuple[int, ...], bits: int) -> Tensor:
    codes = state["exp_avg_codes"]
    n = math.prod(local_shape)
    if bits == 8:
        return codes.view(local_shape)
    if packed_rows(local_shape, bits) or (len(local_shape) >= 2 and n == 0):
        return codes.view(codes_shape(local_shape, bits))
    return unpack_nibbles(codes, n).view(local_shape)


def _like_param(param: Tensor, value: Tensor, global_shape: tuple[int, ...]):
    """``value`` (this rank's rows) as a DTensor with the parameter's layout."""
    if not _dist.is_dtensor(param):
        return value
    stride = tuple(math.prod(global_shape[i + 1 :]) for i in range(len(global_shape)))
    return _dist.dtensor_api().DTensor.from_local(
        value,
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=torch.Size(global_shape),
        stride=stride,
    )


def to_checkpoint(
    param: Tensor,
    state: dict,
    bits: int | None,
    partition,
    vectors: dict,
    factors: tuple[int, int] | None = None,
) -> dict:
    """One parameter's runtime state in the checkpoint layout.

    ``vectors`` maps ``"exp_avg_sq"``/``"exp_avg_absmax"`` to the full padded
    ``[NB]``/``[NQ]`` vectors (assembled by :func:`full_vectors`); ``factors``:
    ``(R, C)`` when the group factors this parameter's second moment (a template
    gets the ``factored`` key too, so it has the checkpoint's keys).
    """
    shape = tuple(param.shape)
    n = math.prod(shape)
    local_shape = tuple(_dist.local(param).shape)
    out = {"step": state["step"], "period": state["period"]}
    if factors is not None:
        out[FACTORED_KEY] = torch.tensor(factors[0], dtype=torch.int64)
    if bits is None:
        momentum = state.get("exp_avg")
        if momentum is None:  # provisional
            momentum = torch.zeros(
                local_shape, dtype=torch.float32, device=_dist.local(param).device
            )
        out["exp_avg"] = _like_param(param, momentum, shape)
    else:
        if "exp_avg_codes" in state:
            codes = _codes_local(state, local_shape, bits)
            out["qblock"], out["codebook"] = state["qblock"], state["codebook"]
        else:  # provisional: a template of the right shapes
            codes = torch.zeros(
                codes_shape(local_shape, bits),
                dtype=torch.uint8,
                device=_dist.local(param).device,
            )
            out["qblock"] = torch.tensor(0, dtype=torch.int64)
            out["codebook"] = torch.zeros(2**bits, dtype=torch.float32)
        out["exp_avg_codes"] = _like_param(param, codes, codes_shape(shape, bits))
    nb, nq = padded_lengths(n, partition, factors)
    for key, length in (("exp_avg_sq", nb), ("exp_avg_absmax", nq)):
        if key == "exp_avg_absmax" and bits is None:
            continue
        full = vectors[key]
        if _dist.is_sharded(param):
            world = param.device_mesh.size()
            chunk = -(-length // world)
            k = param.device_mesh.get_local_rank()
            piece = full[min(k * chunk, length) : min((k + 1) * chunk, length)]
            out[key] = _dist.dtensor_api().DTensor.from_local(
                piece.clone(),
                param.device_mesh,
                [_dist.dtensor_api().Shard(0)],
                run_check=False,
                shape=torch.Size((length,)),
                stride=(1,),
            )
        else:
            out[key] = full
    return out


def local_vectors(
    param: Tensor, state: dict, partition, factors: tuple[int, int] | None = None
) -> dict[str, Tensor]:
    """This rank's block statistics placed in zero vectors of length NB / NQ (a
    factored state's ``R + C`` factors: factored parameters are never sharded)."""
    n = param.numel()
    nb, nq = padded_lengths(n, partition, factors)
    device = _dist.local(param).device
    out = {}
    period = int(state["period"])
    for key, length in (("exp_avg_sq", nb), ("exp_avg_absmax", nq)):
        full = torch.zeros(length, dtype=torch.float32, device=device)
        if key in state and period > 0:
            block = period if key == "exp_avg_sq" else int(state["qblock"])
            values = state[key]
            if _dist.is_sharded(param):
                b0, _ = block_window(_dist.my_span(param), block)
            else:
                b0 = 0
            full[b0 : b0 + values.numel()] = values
        out[key] = full
    return out


# ---------------------------------------------------------------- from checkpoint
def _full(value: Tensor) -> Tensor:
    return value.full_tensor() if _dist.is_dtensor(value) else value


def _rows(param: Tensor, value: Tensor) -> Tensor:
    """This rank's rows of a parameter-shaped checkpoint tensor."""
    if _dist.is_dtensor(value) and _dist.is_dtensor(param):
        if value.device_mesh == param.device_mesh and tuple(value.placements) == tuple(
            param.placements
        ):
            return value.to_local()
    full = _full(value)
    if not _dist.is_sharded(param):
        return full
    span = _dist.my_span(param)
    per_row = max(math.prod(param.shape[1:]) if param.dim() > 1 else 1, 1)
    return full[span.start // per_row : span.stop // per_row]


def _check_saved_shape(saved: dict, shape: tuple, bits, label: str) -> None:
    """The momentum is saved in its parameter's shape: a state saved for a parameter
    of another shape (another model) is named as such, before the derived layout
    (period, factors) would disagree in less telling words."""
    key = "exp_avg" if bits is None else "exp_avg_codes"
    value = saved[key]
    want = shape if bits is None else codes_shape(shape, bits)
    if isinstance(value, Tensor) and tuple(value.shape) != tuple(want):
        raise ValueError(
            f"{label}: the state was saved for a parameter of another shape (its "
            f"'{key}' has shape {tuple(value.shape)}; this parameter's is "
            f"{tuple(want)}): is it another model's optimizer state?"
        )


def check_checkpoint(
    saved: dict, param: Tensor, bits, partition, label: str, second_moment="blocks"
) -> None:
    """Checks one parameter's checkpoint-layout state (keys, dtypes, shapes, and a
    factored second moment exactly where the group's ``second_moment`` asks)."""
    if not saved:
        return
    shape = tuple(param.shape)
    n = math.prod(shape)
    check_keys(saved, bits, label)
    _check_saved_shape(saved, shape, bits, label)
    check_factored(saved, shape, second_moment, label)
    factors = factor_shape(shape) if FACTORED_KEY in saved else None
    period = int(saved["period"])
    low = min_period(n, partition)
    if period != 0 and not low <= period <= max(n, 1):
        raise ValueError(
            f"{label}: period {period} outside [{low}, {n}], the periods partition="
            f"{partition!r} allows for {n} elements (was it saved with another "
            "partition?)"
        )
    nb, nq = padded_lengths(n, partition, factors)
    _expect(label, "exp_avg_sq", saved["exp_avg_sq"], torch.float32, (nb,))
    if bits is None:
        _expect(label, "exp_avg", saved["exp_avg"], torch.float32, shape)
        return
    codebook = saved["codebook"]
    if not isinstance(codebook, Tensor) or codebook.numel() != 2**bits:
        size = codebook.numel() if isinstance(codebook, Tensor) else codebook
        raise ValueError(
            f"{label}: codebook has {size} codes, momentum_bits={bits} needs {2**bits}"
        )
    _expect(label, "codebook", codebook, torch.float32, (2**bits,))
    _expect(label, "qblock", saved["qblock"], torch.int64, ())
    if period and int(saved["qblock"]) != qblock_for(period):
        raise ValueError(
            f"{label}: qblock {int(saved['qblock'])} does not match period {period} "
            f"(expected {qblock_for(period)})"
        )
    _expect(
        label,
        "exp_avg_codes",
        saved["exp_avg_codes"],
        torch.uint8,
        codes_shape(shape, bits),
    )
    _expect(label, "exp_avg_absmax", saved["exp_avg_absmax"], torch.float32, (nq,))


def from_checkpoint(saved: dict, param: Tensor, bits: int | None) -> dict:
    """One parameter's checked checkpoint-layout state in the runtime layout
    (this rank's part under FSDP2); tensors may still be views of ``saved``'s."""
    if not saved:
        return {}
    period = int(saved["period"])
    if period == 0:  # provisional
        return {"step": saved["step"], "period": saved["period"]}
    out = {"step": saved["step"], "period": saved["period"]}
    if FACTORED_KEY in saved:  # never sharded: the factors as saved
        out[FACTORED_KEY] = saved[FACTORED_KEY]
        out["exp_avg_sq"] = _full(saved["exp_avg_sq"])
    sharded = _dist.is_sharded(param)
    span = _dist.my_span(param) if sharded else None
    n_local = _dist.local(param).numel()
    blocks = {} if FACTORED_KEY in saved else {"exp_avg_sq": period}
    if bits is not None:
        blocks["exp_avg_absmax"] = int(saved["qblock"])
    for key, block in blocks.items():
        full = _full(saved[key])
        nb = -(-param.numel() // block)
        b0, b1 = block_window(span, block) if sharded else (0, nb)
        out[key] = full[:nb][b0:b1]
    if bits is None:
        out["exp_avg"] = _rows(param, saved["exp_avg"])
        return out
    out["qblock"], out["codebook"] = saved["qblock"], saved["codebook"]
    codes = _rows(param, saved["exp_avg_codes"]).reshape(-1)
    if bits == 4 and not packed_rows(tuple(param.shape), bits):
        codes = pack_nibbles(codes.contiguous())
    out["exp_avg_codes"] = codes
    if codes.numel() != codes_length(n_local, bits):
        raise ValueError(
            f"exp_avg_codes holds {codes.numel()} bytes for {n_local} local elements"
        )
    return out
