r"""The device tables that Gefen's Triton launches read (host side, no kernels).

The kernels (``_triton_kernels``, ``_triton_factored``, ``_triton_momentum_kernel``)
find everything through tables: each job's row of pointers and sizes (its columns,
``J_*`` there, are :func:`columns`), the search table of each job's first program
(:func:`starts`), and each codebook's quantizer table (:func:`device_codebook`,
built once per codebook version and device). This module builds them on the host
once per layout; a steady step only uploads its per-step columns
(``_triton_step.upload``).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from ._quant_table import quant_table

try:  # an optional dependency: the CPU path never needs it
    import triton

    from . import _triton_factored as factored_kernels
    from . import _triton_kernels as kernels
    from . import _triton_momentum_kernel as momentum_kernels
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = kernels = factored_kernels = momentum_kernels = None

__all__ = ["COLUMNS", "DeviceCodebook", "columns", "device_codebook", "pow2", "starts"]

# The codebooks' device tables: (id, device) -> (weak ref, version, DeviceCodebook).
_tables: dict[tuple[int, str], tuple] = {}


@dataclass(frozen=True)
class DeviceCodebook:
    """A codebook's quantizer table on one device and the scalars jobs need."""

    table: Tensor  # fp32 [Q_SIZE], the kernels' Q_* layout
    nuniq: int  # distinct values
    zero: int  # the value index nearest 0 (ties down): #{midpoints < 0}


def device_codebook(codebook: Tensor, device: torch.device) -> DeviceCodebook:
    """The quantizer table of ``codebook`` on ``device``, built once per codebook
    version (``_quant_table`` builds it on the host). A caller that writes the
    table's address into job rows keeps the returned object alive as long as
    those rows: this cache may drop its entry meanwhile."""
    entry = _tables.get((id(codebook), str(device)))
    if entry is not None and entry[0]() is codebook and entry[1] == codebook._version:
        return entry[2]
    t, q = quant_table(codebook), columns()
    u = t.uniq.numel()
    table = torch.full((q.Q_SIZE,), math.inf, dtype=torch.float32)
    table[q.Q_CB : q.Q_CB + t.codebook.numel()] = t.codebook
    table[q.Q_MID : q.Q_MID + u - 1] = t.mid[: u - 1]
    table[q.Q_UP : q.Q_UP + u - 1] = t.uniq[1:]
    table[q.Q_UNIQ : q.Q_UNIQ + u] = t.uniq
    table[q.Q_FIRST :] = 0.0
    table[q.Q_FIRST : q.Q_FIRST + u] = t.first.float()
    out = DeviceCodebook(table.to(device), u, int((t.mid < 0).sum()))
    if len(_tables) >= 16:
        _tables.clear()
    _tables[id(codebook), str(device)] = (weakref.ref(codebook), codebook._version, out)
    return out


_COLUMNS = None


def columns():
    """The kernels' table columns and kinds (constexpr there) as plain ints."""
    global _COLUMNS
    if _COLUMNS is None:
        import triton.language as tl

        values = {
            **vars(factored_kernels),
            **vars(kernels),
            **vars(momentum_kernels),
        }
        _COLUMNS = type(
            "Columns",
            (),
            {
                name: int(v.value)
                for name, v in values.items()
                if isinstance(v, tl.constexpr) and isinstance(v.value, int)
            },
        )
    return _COLUMNS


def pow2(x: int, lo: int, hi: int) -> int:
    """The power of two >= x, clamped to [lo, hi]."""
    return max(lo, min(hi, 1 << max(0, int(x) - 1).bit_length()))


def starts(counts: list[int], device: torch.device) -> Tensor:
    """Each job's first program index, then the total: the kernels' search table."""
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    # built once per layout (not in a steady step): a plain copy will do
    return torch.tensor(out, dtype=torch.int64, device=device)


# The columns as a constant, for the steady step's launches (no call to look them up).
COLUMNS = columns() if kernels is not None else None
