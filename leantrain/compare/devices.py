"""The device ``leantrain compare`` runs its axes on, and their sizes there.

``--device auto|cpu|cuda`` (default ``auto``: CUDA when ``torch.cuda.is_available()``,
else the CPU) is resolved once by :func:`resolve_device`; every axis' configuration
then carries the device's name, so its models, batches, optimizer state and
generators are made on it. Timed regions on CUDA end with a synchronisation
(:func:`device_clock`): kernels run asynchronously, and a host clock read without
one times the launches, not the work.

The sizes of the axes on each device are in one place, :data:`DEVICE_SIZES`: the
CPU sizes are the axes' own defaults (``memory.DEFAULT``, ...), and a GPU gets the
larger sizes below, chosen so that the work is not launch-bound and the whole
``leantrain compare`` still finishes in about 3 minutes on one data-centre GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")

# Fields of each axis' config that differ from its CPU default, per device type.
DEVICE_SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "cpu": {"memory": {}, "curvature": {}, "depth": {}},
    "cuda": {
        # A GPT-2-small-sized model (12 blocks, d 768, 12 heads; byte vocabulary:
        # 85M parameters): the size at which optimizer state is the memory question.
        # 9 runs x 200 steps of 8 x 256 bytes take ~40 ms a step on an H100-class GPU
        # (~80 s in all); 200 steps leave the first plateau at this learning rate
        # (GPT-2 small's 6e-4) with a 10-step warm-up.
        "memory": {
            "d_model": 768,
            "n_layer": 12,
            "n_head": 12,
            "block_size": 256,
            "steps": 200,
            "warmup": 10,
            "batch_size": 8,
            "lr": 6e-4,
            "val_batches": 8,
            "seconds_per_step": 0.04,
        },
        # The same MLP (K-FAC's and Shampoo's factors keep their CPU sizes, so the
        # rows compare the same curvature work) on 4x the batch: at 64 images a
        # GPU step is kernel launches alone and every ratio reads ~1.
        "curvature": {"batch_size": 256},
        # The stack at GPT-2-small width (d 768, 12 heads) on 8 x 128 tokens: the
        # layer times fed to the simulator are then a GPU's, not its launch latency.
        "depth": {
            "d_model": 768,
            "n_head": 12,
            "tokens": 128,
            "batch": 8,
            "repeats": 10,
            "layer_reps": 20,
        },
    },
}


def resolve_device(name: str) -> str:
    """``"cpu"`` or ``"cuda"`` for ``--device name``.

    Raises:
        ValueError: ``name`` is not one of :data:`DEVICE_CHOICES`, or it is
            ``"cuda"`` and no CUDA device is available.
    """
    if name not in DEVICE_CHOICES:
        raise ValueError(f"--device {name!r} is not one of {', '.join(DEVICE_CHOICES)}")
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "--device cuda: no CUDA device is available here "
            "(torch.cuda.is_available() is False); the devices available are: cpu "
            "(--device cpu, or auto)"
        )
    return name


def axis_sizes(device: str, axis: str) -> dict[str, Any]:
    """The fields of ``axis``' config that ``device`` changes (see
    :data:`DEVICE_SIZES`); ``device`` is ``"cpu"`` or ``"cuda"``."""
    if device not in DEVICE_SIZES:
        raise ValueError(
            f"device {device!r} has no sizes; allowed: {', '.join(DEVICE_SIZES)}"
        )
    return DEVICE_SIZES[device][axis]


def device_label(device: str, threads: int) -> str:
    """The device as the report names it: ``"cpu (2 threads)"`` (``threads``: the
    torch threads of each run) or ``"cuda (<the device's name>)"``."""
    if device == "cuda":
        return f"cuda ({torch.cuda.get_device_name()})"
    return f"cpu ({threads} thread{'s' if threads > 1 else ''})"


def synchronize(device: torch.device | str) -> None:
    """Wait for the work queued on ``device`` (nothing to wait for on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def device_clock(device: torch.device | str) -> Callable[[], float]:
    """``time.perf_counter`` after :func:`synchronize`: differences of its readings
    time the work done on ``device`` between them, not just its launch."""
    if torch.device(device).type != "cuda":
        return time.perf_counter

    def clock() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return clock


def to_device(batch: tuple[torch.Tensor, ...], device: torch.device | str) -> tuple:
    """Every tensor of ``batch`` on ``device`` (the data is made on the CPU, from
    the same seeded generator on every device)."""
    return tuple(t.to(device) for t in batch)
