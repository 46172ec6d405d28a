"""How much memory an optimizer keeps and adds: state bytes and the step's peak.

:func:`state_nbytes` counts every state tensor (tensor subclasses opened, top-level
tensors of :func:`extra_state_tensors` included, each storage once), for any
optimizer, ours or a peer's; :func:`measured_step` times one ``step()`` and the
resident memory it adds (Linux ``/proc``). Used by ``leantrain compare --peers``
and ``benchmarks/optimizers.py``.
"""

from __future__ import annotations

import ctypes
import time
from typing import NamedTuple

from torch import Tensor
from torch.optim import Optimizer


def extra_state_tensors(optimizer: Optimizer) -> list[Tensor]:
    """Tensors a peer keeps on the optimizer object rather than in ``.state``.

    * gefen 1.2.3: ``_gefen_codebook`` (the 256-entry codebook, 1 KB).
    * bitsandbytes: ``name2qmap`` (the 256-entry dynamic maps; also referenced from
      each quantized parameter's state, and counted once).
    Everyone else keeps all tensors in ``.state``.
    """
    extra: list[Tensor] = []
    codebook = getattr(optimizer, "_gefen_codebook", None)
    if isinstance(codebook, Tensor):
        extra.append(codebook)
    qmaps = getattr(optimizer, "name2qmap", None)
    if isinstance(qmaps, dict):
        extra += [t for t in qmaps.values() if isinstance(t, Tensor)]
    return extra


try:  # glibc: malloc_trim lets the step's temporaries show up as new pages
    _LIBC: ctypes.CDLL | None = ctypes.CDLL("libc.so.6")
except OSError:
    _LIBC = None


def _inner_tensors(value: object) -> list[Tensor]:
    """Plain tensors inside a state value; opens tensor subclasses (torchao)."""
    if isinstance(value, Tensor):
        if type(value) is not Tensor and hasattr(value, "__tensor_flatten__"):
            names, _ = value.__tensor_flatten__()
            return [t for n in names for t in _inner_tensors(getattr(value, n))]
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _inner_tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _inner_tensors(v)]
    return []


def state_nbytes(optimizer: Optimizer) -> int:
    """Bytes of the optimizer's state tensors, each storage counted once.

    Counts every tensor in ``optimizer.state`` (tensor subclasses such as torchao's
    opened into their inner tensors) plus :func:`extra_state_tensors`.
    """
    tensors = _inner_tensors(list(optimizer.state.values()))
    tensors += extra_state_tensors(optimizer)
    sizes = {}
    for t in tensors:
        storage = t.untyped_storage()
        # A live allocation has one address; empty storages (address 0) weigh 0.
        sizes[(str(t.device), storage.data_ptr())] = storage.nbytes()
    return sum(sizes.values())


def proc_status_kib(key: str) -> int:
    """``key`` (``"VmRSS"``, ``"VmHWM"``) of ``/proc/self/status``, in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def reset_peak_rss() -> bool:
    """Returns freed heap memory to the OS, then resets VmHWM to the current RSS
    (False where ``/proc`` cannot be written: VmHWM then keeps earlier peaks)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:  # not Linux, or /proc not writable
        return False


class StepMeasure(NamedTuple):
    """What :func:`measured_step` saw: seconds, and extra peak RSS (None if unknown)."""

    seconds: float
    peak_bytes: int | None


def measured_step(optimizer: Optimizer) -> StepMeasure:
    """Run ``optimizer.step()``; return its wall time and the peak RSS it added.

    VmHWM is reset by writing "5" to ``/proc/self/clear_refs`` just before the step
    (after glibc's ``malloc_trim(0)`` hands freed heap pages back); the step's peak is
    VmHWM after it minus VmRSS before it. Freed memory the allocator still holds and
    reuses is not seen, so this is a lower bound on the step's temporaries. Where
    ``/proc`` cannot be used, ``peak_bytes`` is None.
    """
    tracked = reset_peak_rss()
    rss_before = proc_status_kib("VmRSS") if tracked else 0
    t0 = time.perf_counter()
    optimizer.step()
    seconds = time.perf_counter() - t0
    if not tracked:
        return StepMeasure(seconds, None)
    return StepMeasure(seconds, 1024 * (proc_status_kib("VmHWM") - rss_before))
