"""Curvature arithmetic with subnormal floats flushed to zero (CPU).

Near convergence, softmax output-gradients reach 1e-30 and Kronecker factors hold
entries near 1e-34, so the products of a K-FAC apply land in the subnormal range
(below 1.2e-38 in float32). x86 CPUs compute on subnormals through a microcode
assist that is many times slower than a normal multiply-add: on the digits MLP
near convergence, one 256-wide K-FAC apply took 0.53 ms instead of 0.37 ms
(benchmarks/precond.py, docs/notebook/2026-12-02-precond-step-cost.md). A subnormal
entry of a preconditioned gradient is below anything an optimizer step can express
against weights of order 1e-2, so flushing it to zero changes no update.

:func:`denormals_flushed` sets the CPU's flush-to-zero / denormals-are-zero modes
for the calling thread (``torch.set_flush_denormal``) around the preconditioner's
own arithmetic only (never the model's forward or backward) and puts the previous
mode back, so the user's setting is left as found.

:func:`curvature_arithmetic` adds what else the preconditioner's arithmetic must not
inherit from the user's step: ``torch.autocast`` (a maker called inside an autocast
region would otherwise factor and invert its curvature in bfloat16, or fail on
mixed dtypes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

__all__ = [
    "autocast_off",
    "curvature_arithmetic",
    "denormals_flushed",
    "flushing_denormals",
]

# A float32 subnormal (2^-148) and one: their product is zero only on a thread that
# flushes. NumPy's scalar multiply runs on the same thread's SSE control register as
# torch's CPU kernels and costs ~1 us, against ~10 us for a torch tensor probe.
_SUBNORMAL = np.float32(2.0**-148)
_ONE = np.float32(1.0)


def flushing_denormals() -> bool:
    """Whether this thread currently flushes subnormal floats to zero.

    torch has a setter but no getter, so it is observed: a subnormal times one
    stays subnormal unless flush-to-zero or denormals-are-zero is on.
    """
    return bool(_SUBNORMAL * _ONE == 0)


@contextlib.contextmanager
def denormals_flushed() -> Iterator[None]:
    """Run the block with subnormals flushed to zero; restore the mode after.

    A no-op where flushing is already on or the CPU cannot flush (torch returns
    False: then the arithmetic is exact IEEE, only slower).
    """
    if flushing_denormals() or not torch.set_flush_denormal(True):
        yield
        return
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


@contextlib.contextmanager
def autocast_off() -> Iterator[None]:
    """Run the block without ``torch.autocast`` (CPU and CUDA): the curvature
    statistics are taken in the dtypes of their tensors (float32 or wider)."""
    with contextlib.ExitStack() as stack:
        for device in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


@contextlib.contextmanager
def curvature_arithmetic() -> Iterator[None]:
    """The preconditioner's own arithmetic: subnormals flushed, autocast off."""
    with autocast_off(), denormals_flushed():
        yield
