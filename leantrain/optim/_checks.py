"""Validation of Gefen's arguments, parameters and gradients.

Every check raises ``ValueError`` or ``TypeError`` with the offending value and what
is allowed, in torch.optim's wording where torch has one ("Invalid beta parameter
at index 0: 1.0"), so a user switching from AdamW reads familiar messages.
"""

from __future__ import annotations

import numbers
import os
import sys
import warnings

import torch
from torch import Tensor

from ._options import as_float, stochastic_codes_of, update_clip_of

MOMENTUM_BITS = (8, 4, None)
PARTITION_NAMES = ("auto", "element", "tensor")
NONFINITE_MODES = ("skip", "raise")


def check_hyperparameters(
    lr: float | Tensor,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """Checks AdamW's hyper-parameters with AdamW's rules and messages.

    Raises:
        ValueError: lr, eps or weight_decay negative (or NaN), a beta outside [0, 1),
            or betas not a pair.
        TypeError: a value that is not a real number.
    """
    if not 0.0 <= as_float(lr, "lr"):
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= as_float(eps, "eps"):
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for index, beta in enumerate(betas):
        if not 0.0 <= as_float(beta, f"betas[{index}]") < 1.0:
            raise ValueError(f"Invalid beta parameter at index {index}: {beta}")
    if not 0.0 <= as_float(weight_decay, "weight_decay"):
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def check_momentum_bits(bits: object) -> None:
    """Checks ``momentum_bits`` is 8, 4 or None."""
    if bits is None:
        return
    if isinstance(bits, bool) or bits not in (8, 4):
        raise ValueError(f"Invalid momentum_bits: {bits!r}; allowed: 8, 4 or None")


def check_partition(partition: object) -> None:
    """Checks ``partition`` is "auto", "element", "tensor" or a positive int."""
    if isinstance(partition, str):
        if partition not in PARTITION_NAMES:
            raise ValueError(
                f"Invalid partition: {partition!r}; allowed: 'auto', 'element', "
                "'tensor' or a positive int block length"
            )
        return
    if isinstance(partition, bool) or not isinstance(partition, numbers.Integral):
        raise ValueError(
            f"Invalid partition: {partition!r}; allowed: 'auto', 'element', "
            "'tensor' or a positive int block length"
        )
    if partition < 1:
        raise ValueError(f"Invalid partition block length: {partition}; must be >= 1")


def check_second_moment(value: object, partition: object) -> None:
    """Checks ``second_moment`` is "auto", "blocks" or "factored", not "factored" with
    ``partition="element"`` (which asks for AdamW's per-element second moment)."""
    from .factored import check_second_moment as check_name

    check_name(value)
    if value == "factored" and partition == "element":
        raise ValueError(
            "second_moment='factored' contradicts partition='element' (a per-element "
            "second moment); use one of them"
        )


def check_nonfinite(mode: object) -> None:
    """Checks the non-finite gradient policy is "skip" or "raise"."""
    if mode not in NONFINITE_MODES:
        raise ValueError(f"Invalid nonfinite: {mode!r}; allowed: 'skip' or 'raise'")


def check_group(group: dict) -> None:
    """Checks every Gefen option of one param group (after defaults are filled)."""
    check_hyperparameters(
        group["lr"], group["betas"], group["eps"], group["weight_decay"]
    )
    check_momentum_bits(group["momentum_bits"])
    stochastic_codes_of(group)  # checks momentum_rounding against the bits
    check_partition(group["partition"])
    check_second_moment(group.get("second_moment", "blocks"), group["partition"])
    update_clip_of(group)
    if not isinstance(group["maximize"], bool):
        raise TypeError(f"maximize must be a bool, got {group['maximize']!r}")


def check_param(param: Tensor, label: str) -> None:
    """Rejects parameters Gefen cannot train (complex or non-floating dtypes)."""
    if param.is_complex():
        raise TypeError(
            f"Gefen does not support complex parameters ({label}, dtype "
            f"{param.dtype}); pass torch.view_as_real(param) as a real parameter"
        )
    if not param.is_floating_point():
        raise TypeError(
            f"Gefen needs floating-point parameters; {label} has dtype {param.dtype}"
        )


def check_grad(grad: Tensor, label: str) -> None:
    """Rejects sparse and complex gradients."""
    if grad.is_sparse or grad.layout != torch.strided:
        raise TypeError(
            f"Gefen does not support sparse gradients ({label}, layout {grad.layout}); "
            "use dense gradients (e.g. nn.Embedding(sparse=False))"
        )
    if grad.is_complex():
        raise TypeError(
            f"Gefen does not support complex gradients ({label}, dtype {grad.dtype})"
        )


# Exponent field of each float format the native check reads: all bits set means
# NaN or infinity.
_EXPONENT = {torch.float32: 0x7F800000, torch.bfloat16: 0x7F80, torch.float16: 0x7C00}
# From this many elements a CPU tensor is checked by the native pass (one read, no
# temporaries); smaller ones share one batched 2-norm (a ctypes call per tensor
# would cost more than it saves).
_NATIVE_NUMEL = 1 << 16


def _native_all_finite(g: Tensor) -> bool | None:
    """The native check of one contiguous CPU float tensor; None where it cannot run."""
    from . import _native

    mask = _EXPONENT.get(g.dtype)
    if mask is None or g.device.type != "cpu" or not g.is_contiguous():
        return None
    lib = _native.load()
    if lib is None:
        return None
    threads = torch.get_num_threads()
    rc = lib.lt_all_finite(g.data_ptr(), g.numel(), g.element_size(), mask, threads)
    if rc < 0:
        raise ValueError(f"the native finite check rejected a {g.dtype} tensor")
    return bool(rc)


def finite_flags(grads: list[Tensor]) -> list[bool]:
    """``is_finite`` of every tensor: large CPU tensors by the native pass, the rest
    in one batched call per (device, dtype), read on the host once per device.

    A NaN or an infinity makes the 2-norm NaN or inf, so a finite norm proves the
    tensor finite; a non-finite norm may also be an overflow of finite values
    (|g| ~ 1e19 in fp32, far less in fp16/bf16), so those tensors are confirmed
    one by one with ``is_finite``. One ``_foreach_norm`` saves the per-call
    overhead that dominates the check on a model of many small tensors.
    """
    flags = [True] * len(grads)
    batches: dict[tuple, list[int]] = {}
    for i, g in enumerate(grads):
        if not g.numel():
            continue
        native = _native_all_finite(g) if g.numel() >= _NATIVE_NUMEL else None
        if native is not None:
            flags[i] = native
        else:
            batches.setdefault((g.device, g.dtype), []).append(i)
    # The verdicts of each device's dtypes are read together: one wait of the host
    # for a CUDA device per step, which the policy needs (skip or step).
    per_device: dict[torch.device, list[tuple[list[int], Tensor]]] = {}
    for (device, _), members in batches.items():
        norms = torch._foreach_norm([grads[i] for i in members], 2)
        finite = torch.stack(norms).isfinite()
        per_device.setdefault(device, []).append((members, finite))
    for parts in per_device.values():
        members = [i for indices, _ in parts for i in indices]
        verdicts = torch.cat([finite for _, finite in parts]).tolist()
        for i, ok in zip(members, verdicts, strict=True):
            flags[i] = ok or is_finite(grads[i])
    return flags


def is_finite(grad: Tensor) -> bool:
    """True when every element of ``grad`` is finite (no NaN, no +-inf).

    ``aminmax`` reads the gradient once without a full-size boolean temporary
    (``isfinite(grad).all()`` makes one); NaN propagates into both results
    and an infinity is its own min or max, so checking the two extremes is exact.
    """
    if grad.numel() == 0:
        return True
    low, high = torch.aminmax(grad)
    return bool(torch.isfinite(low) & torch.isfinite(high))


# Frames in these directories are ours or torch's (the @no_grad decorator and the
# optimizer's step hooks wrap ``step``): a warning skips them to reach the caller.
_INTERNAL_DIRS = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # leantrain/
    os.path.dirname(os.path.abspath(torch.__file__)),
)


def caller_stacklevel() -> int:
    """The ``warnings.warn`` stacklevel, for a warning issued by the function that
    calls this, of the first frame outside leantrain and torch: the user's call
    of ``step()`` however many wrappers torch puts around it."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL_DIRS):
        frame, level = frame.f_back, level + 1
    return level


def reject_nonfinite(optimizer: object, label: object) -> None:
    """The non-finite policy of a skipped step (``optimizer.nonfinite``): raise
    ``FloatingPointError``, or count it in ``optimizer.nonfinite_steps`` and warn
    at the line that called ``step()``."""
    name = type(optimizer).__name__
    if optimizer.nonfinite == "raise":
        raise FloatingPointError(f"{name}: non-finite gradient in {label}")
    optimizer.nonfinite_steps += 1
    warnings.warn(
        f"{name}: non-finite gradient in {label}; step skipped, parameters and "
        f"state unchanged ({optimizer.nonfinite_steps} skipped so far)",
        RuntimeWarning,
        stacklevel=caller_stacklevel(),
    )
