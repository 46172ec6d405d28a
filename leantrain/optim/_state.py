"""Gefen's per-parameter state: creation, validation and codebook sharing.

The layout is the one in docs/CONTRACTS.md ("Gefen state"); every step
implementation (the reference in ``_step.py`` and any fast path) reads and writes
exactly these tensors, so this module is the only place that knows their shapes.

Per parameter of n elements with block length p (nb = ceil(n / p)):

========================  =======  ================================================
key                       dtype    shape / meaning
========================  =======  ================================================
``step``                  fp32     0-dim, steps taken
``period``                int64    0-dim, block length p of the second moment
``exp_avg_sq``            fp32     [nb], one second moment per block; factored
                                   (``second_moment="factored"``): [R + C], the
                                   row and column factors (``factored.py``)
``factored``              int64    0-dim, R (factored states only)
``exp_avg``               fp32     param shape (``momentum_bits=None`` only)
``exp_avg_codes``         uint8    [n] (8-bit) or [ceil(n / 2)] (4-bit, 2 codes/byte)
``exp_avg_absmax``        fp32     [ceil(n / qblock)], momentum scale per block
``qblock``                int64    0-dim, p, or 256 when p == 1
``codebook``              fp32     [2**bits], one tensor shared by all parameters
========================  =======  ================================================
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# With p == 1 the second moment is per element but the momentum still needs a
# scale per block; 256 elements keep that scale at 4/256 B per element.
ELEMENT_QBLOCK = 256

QUANTIZED_KEYS = ("exp_avg_codes", "exp_avg_absmax", "qblock", "codebook")
COMMON_KEYS = ("step", "period", "exp_avg_sq")
FACTORED_KEY = "factored"  # present in factored states only: R, the row count


def qblock_for(period: int) -> int:
    """Returns the momentum quantization block length for second-moment period p."""
    return ELEMENT_QBLOCK if period == 1 else period


def num_blocks(n: int, block: int) -> int:
    """Number of contiguous blocks of length ``block`` covering n elements."""
    return math.ceil(n / block)


def codes_length(n: int, bits: int) -> int:
    """Bytes of momentum codes for n elements (two 4-bit codes share a byte)."""
    return n if bits == 8 else math.ceil(n / 2)


def state_bits(state: dict) -> int | None:
    """Momentum bits a (non-empty) state was created with, read from its codebook."""
    if "codebook" not in state:
        return None
    return int(state["codebook"].numel()).bit_length() - 1


def second_moment_length(n: int, period: int, state: dict) -> int:
    """Entries of ``exp_avg_sq``: R + C for a factored state, else ceil(n / p)."""
    rows = state.get(FACTORED_KEY)
    if rows is None:
        return num_blocks(n, period)
    return int(rows) + n // max(int(rows), 1)


def new_state(
    param: Tensor,
    period: int,
    bits: int | None,
    codebook: Tensor | None,
    factored: tuple[int, int] | None = None,
) -> dict[str, Tensor]:
    """Creates the zero state of one parameter (m = 0, v = 0, step = 0).

    Args:
        param: the parameter (its numel and device are used).
        period: block length p of the second moment, 1 <= p <= numel.
        bits: 8, 4 or None (fp32 momentum).
        codebook: the shared fp32 codebook of ``2**bits`` codes (None when bits is
            None). Stored by reference, never copied.
        factored: ``(R, C)`` for a factored second moment (``factored.factor_shape``),
            or None for one per block of ``period``.

    Returns:
        The state dict, laid out as in docs/CONTRACTS.md.
    """
    n, device = param.numel(), param.device
    state = {
        "step": torch.tensor(0.0, dtype=torch.float32),
        "period": torch.tensor(period, dtype=torch.int64),
        "exp_avg_sq": torch.zeros(
            num_blocks(n, period), dtype=torch.float32, device=device
        ),
    }
    if factored is not None:
        rows, cols = factored
        if rows * cols != n:
            raise ValueError(f"factors {rows} x {cols} do not cover {n} elements")
        state["exp_avg_sq"] = torch.zeros(
            rows + cols, dtype=torch.float32, device=device
        )
        state[FACTORED_KEY] = torch.tensor(rows, dtype=torch.int64)
    if bits is None:
        state["exp_avg"] = torch.zeros(param.shape, dtype=torch.float32, device=device)
        return state
    qblock = qblock_for(period)
    # m = 0 is stored as absmax 0 and the code nearest 0, the quantizer's rule.
    zero = int(torch.argmin(codebook.abs()))
    fill = zero if bits == 8 else zero | (zero << 4)
    state["exp_avg_codes"] = torch.full(
        (codes_length(n, bits),), fill, dtype=torch.uint8, device=device
    )
    state["exp_avg_absmax"] = torch.zeros(
        num_blocks(n, qblock), dtype=torch.float32, device=device
    )
    state["qblock"] = torch.tensor(qblock, dtype=torch.int64)
    state["codebook"] = codebook
    return state


def _expect(label: str, key: str, value: Tensor, dtype: torch.dtype, shape) -> None:
    if not isinstance(value, Tensor):
        raise ValueError(f"{label}: state '{key}' must be a tensor, got {type(value)}")
    if value.dtype != dtype:
        raise ValueError(
            f"{label}: state '{key}' has dtype {value.dtype}, Gefen expects {dtype}"
        )
    if tuple(value.shape) != tuple(shape):
        raise ValueError(
            f"{label}: state '{key}' has shape {tuple(value.shape)}, "
            f"expected {tuple(shape)}"
        )


def check_keys(state: dict, bits: int | None, label: str) -> None:
    """The keys of a Gefen state (in memory or in the checkpoint layout, which
    share them) and its step and period scalars.

    Raises:
        ValueError: a missing or unexpected key (another optimizer, or another
            momentum_bits), or a step / period of the wrong dtype or shape.
    """
    wanted = set(COMMON_KEYS) | ({"exp_avg"} if bits is None else set(QUANTIZED_KEYS))
    missing, extra = wanted - set(state), set(state) - wanted - {FACTORED_KEY}
    if missing or extra:
        found_bits = "fp32" if "exp_avg" in state else "quantized"
        raise ValueError(
            f"{label}: the state does not match a Gefen parameter with "
            f"momentum_bits={bits}: missing keys {sorted(missing)}, unexpected keys "
            f"{sorted(extra)} (the saved momentum looks {found_bits}; is this a "
            "state dict of another optimizer or another momentum_bits?)"
        )
    _expect(label, "step", state["step"], torch.float32, ())
    _expect(label, "period", state["period"], torch.int64, ())
    if FACTORED_KEY in state:
        _expect(label, FACTORED_KEY, state[FACTORED_KEY], torch.int64, ())


def check_state(
    state: dict,
    param: Tensor,
    bits: int | None,
    label: str,
    second_moment: str = "blocks",
) -> None:
    """Checks a loaded state matches ``param`` and the group's ``momentum_bits``
    and ``second_moment``.

    An empty state (parameter never stepped) always matches.

    Raises:
        ValueError: naming ``label`` and what differs (missing or unknown keys,
            dtypes, shapes, bits, a period outside [1, numel]).
    """
    if not state:
        return
    n = param.numel()
    check_keys(state, bits, label)
    period = int(state["period"])
    if not 1 <= period <= max(n, 1):
        raise ValueError(f"{label}: period {period} outside [1, {n}] (numel {n})")
    check_factored(state, tuple(param.shape), second_moment, label)
    _expect(
        label,
        "exp_avg_sq",
        state["exp_avg_sq"],
        torch.float32,
        (second_moment_length(n, period, state),),
    )
    if bits is None:
        _expect(label, "exp_avg", state["exp_avg"], torch.float32, param.shape)
        return
    codebook = state["codebook"]
    if not isinstance(codebook, Tensor) or codebook.numel() != 2**bits:
        size = codebook.numel() if isinstance(codebook, Tensor) else codebook
        raise ValueError(
            f"{label}: codebook has {size} codes, momentum_bits={bits} needs {2**bits}"
        )
    _expect(label, "codebook", codebook, torch.float32, (2**bits,))
    _expect(label, "qblock", state["qblock"], torch.int64, ())
    qblock = int(state["qblock"])
    if qblock != qblock_for(period):
        raise ValueError(
            f"{label}: qblock {qblock} does not match period {period} "
            f"(expected {qblock_for(period)})"
        )
    _expect(
        label,
        "exp_avg_codes",
        state["exp_avg_codes"],
        torch.uint8,
        (codes_length(n, bits),),
    )
    _expect(
        label,
        "exp_avg_absmax",
        state["exp_avg_absmax"],
        torch.float32,
        (num_blocks(n, qblock),),
    )


def check_factored(
    state: dict, shape: tuple[int, ...], second_moment: str, label: str
) -> None:
    """A state is factored exactly when its group's ``second_moment`` factors a
    parameter of this shape, with its row count.

    Raises:
        ValueError: naming what the state holds and what the group expects.
    """
    from .factored import factor_shape

    want = factor_shape(shape) if second_moment == "factored" else None
    rows = state.get(FACTORED_KEY)
    have = None if rows is None else int(rows)
    if (want is None) != (have is None) or (want is not None and want[0] != have):
        held = "blocks" if have is None else f"factored with {have} rows"
        expected = "blocks" if want is None else f"factored with {want[0]} rows"
        raise ValueError(
            f"{label}: the state's second moment is {held}, but its group "
            f"(second_moment={second_moment!r}) and shape {shape} need {expected}"
        )


def share_codebooks(states: list[dict]) -> None:
    """Makes equal codebooks one tensor object again (in place).

    Loading a checkpoint can yield one codebook copy per parameter (a device move,
    a consolidated or re-serialized state dict). Equal codebooks on one device are
    replaced by the first of them, so the optimizer again holds one 1 KB tensor.
    """
    kept: list[Tensor] = []
    for state in states:
        codebook = state.get("codebook")
        if codebook is None:
            continue
        for candidate in kept:
            if (
                candidate is codebook
                or candidate.device == codebook.device
                and candidate.shape == codebook.shape
                and torch.equal(candidate, codebook)
            ):
                state["codebook"] = candidate
                break
        else:
            kept.append(codebook)
