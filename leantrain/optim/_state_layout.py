"""Validation of one parameter's Gefen state against it, before any step: the
layout ``(period, block, bits)`` every step path works with, and the 4-bit code
storage (packed or one per byte)."""

from __future__ import annotations

import math

from torch import Tensor

from ._state import second_moment_length


def state_layout(param: Tensor, state: dict) -> tuple[int, int, int]:
    """(period, block, bits) of a state, after checking its tensors' sizes.

    ``block`` is the absmax block (qblock); for fp32 momentum it is the period, or
    256 elements (just a unit of work) when the period is 1.
    """
    n = param.numel()
    period = int(state["period"])
    if not 1 <= period <= n:
        raise ValueError(f"state 'period' is {period}; allowed: 1 <= period <= {n}")
    nb = second_moment_length(n, period, state)
    if state["exp_avg_sq"].numel() != nb:
        what = "its factors" if "factored" in state else f"period {period}"
        raise ValueError(
            f"state 'exp_avg_sq' has {state['exp_avg_sq'].numel()} elements; "
            f"{what} over {n} elements need {nb}"
        )
    codebook = state.get("codebook")
    if codebook is None:
        if state["exp_avg"].numel() != n:
            raise ValueError(
                f"state 'exp_avg' has {state['exp_avg'].numel()} elements, "
                f"parameter {n}"
            )
        return period, (256 if period == 1 else period), 0
    bits = {256: 8, 16: 4}.get(codebook.numel())
    if bits is None:
        raise ValueError(
            f"codebook has {codebook.numel()} codes; allowed: 256 (8-bit) or 16 (4-bit)"
        )
    block = int(state["qblock"])
    if block != period and period != 1:
        raise ValueError(f"state 'qblock' {block} must equal 'period' {period}")
    codes = state["exp_avg_codes"].numel()
    allowed = (n,) if bits == 8 else ((n + 1) // 2, n)  # 4-bit: packed or not
    if codes not in allowed:
        need = " or ".join(str(a) for a in sorted(set(allowed)))
        raise ValueError(
            f"state 'exp_avg_codes' has {codes} elements; a {bits}-bit state of {n} "
            f"elements needs {need}"
        )
    absmax = math.ceil(n / block)
    if state["exp_avg_absmax"].numel() != absmax:
        raise ValueError(
            f"state 'exp_avg_absmax' has {state['exp_avg_absmax'].numel()} elements; "
            f"{n} elements with qblock {block} need {absmax}"
        )
    return period, block, bits


def packed_codes(param: Tensor, state: dict) -> bool:
    """True when the state's 4-bit codes are packed two per byte (element 2i in the
    low nibble); 8-bit codes, and 4-bit codes stored one per byte, are not.

    A parameter's codes are flat or take its shape (4-bit: packed along the last
    dimension when it is even); either way the flat, row-major order is the same,
    so only the byte count tells the two storages apart (and for one element they
    are the same bytes).
    """
    codes = state.get("exp_avg_codes")
    return (
        codes is not None
        and state["codebook"].numel() == 16
        and codes.numel() != param.numel()
    )
