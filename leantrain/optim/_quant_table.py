r"""Lookup tables for nearest-code quantization, built once per codebook.

With the distinct codebook values :math:`u_0 < \dots < u_{U-1}` and their
midpoints :math:`\mu_j = (u_j + u_{j+1})/2` (exact, then rounded down to fp32,
which keeps :math:`x > \mu_j` exact for fp32 x), the nearest value to x has index
:math:`k(x) = \#\{j : \mu_j < x\}` (a tie goes to the lower value) and the stored
code is ``first[k]``, the lowest code holding :math:`u_k` (so ties between equal
codes go to the lower code too).

The C kernel finds :math:`k(x)` with a table over ``ncell`` uniform cells of
[-1, 1]. The cell of a float y is ``floor((y + 1) * ncell / 2)`` evaluated in fp32
(the kernel's own arithmetic), a monotone function of y: every midpoint in a lower
cell than x's is below x and every midpoint in a higher cell is above it. So
``lut[c]`` stores the number of midpoints in cells below c, bitwise-NOT'ed when
cell c itself holds midpoints; only then does the kernel compare x with the next
midpoint(s) of its cell. This is exact for any sorted codebook. How many
comparisons it takes depends on the grid: a learned codebook has distinct values
at least one histogram bin (2/4096) apart, hence midpoints too, so with 16384
cells a cell holds at most one midpoint (one neighbour comparison) and only about
U/16384 of the cells hold any (1.6% for 8-bit), so most elements need none.

Stochastic 8-bit codes (:mod:`.code_rounding`) need the lower end i of x's
interval, :math:`i(x) = \#\{j \ge 1 : x \ge u_j\}`, instead. The same cells give it
in one load: ``sr_entry[c]`` holds the number of values :math:`u_j` (j >= 1) in
cells below c and, where cell c holds one such value u, the fp32 number just
below u (so :math:`x \ge u \iff x >` it for fp32 x; +inf where the cell holds
none): i(x) = count + (x > threshold). ``upad`` (the values, then +inf) lets the
kernel load :math:`u_i` and :math:`u_{i+1}` as one 8-byte pair.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

CELLS = 1 << 14  # int16 entries: 32 KiB, an L1-sized table


@dataclass(frozen=True)
class QuantTable:
    """The quantizer tables of one codebook (CPU, contiguous).

    Attributes:
        codebook: fp32 [K], the codebook (dequantizes old codes).
        uniq: fp32 [U], its distinct values, ascending.
        mid: fp32 [U], midpoints between consecutive ``uniq``; ``mid[U-1] = +inf``.
        first: uint8 [U], the lowest code holding each distinct value.
        lut: int16 [ncell], the number of midpoints in lower cells, bitwise NOT
            where the cell holds a midpoint itself.
        steps: the most midpoints any one cell holds (comparisons needed).
        entry: int64 [ncell], the C kernel's one-load form of ``lut`` for
            ``steps <= 1``: high 32 bits the count j of midpoints in lower cells,
            low 32 bits the fp32 bits of ``mid[j]`` (so k(x) = j + (x > mid[j])).
        sr_entry: int64 [ncell], the stochastic 8-bit rule's form for
            ``sr_steps <= 1``: high 32 bits the count of values u_j (j >= 1) in lower
            cells, low 32 bits the fp32 bits of the number just below the cell's own
            such value, or of +inf (so i(x) = count + (x > threshold)).
        sr_steps: the most values u_j (j >= 1) any one cell holds.
        upad: fp32 [U + 1], ``uniq`` then +inf (pairs u_i, u_{i+1} for any i < U).
    """

    codebook: Tensor
    uniq: Tensor
    mid: Tensor
    first: Tensor
    lut: Tensor
    steps: int
    entry: Tensor
    sr_entry: Tensor
    sr_steps: int
    upad: Tensor


def cell_index(y: Tensor, ncell: int) -> Tensor:
    """The cell of each fp32 value, computed exactly as the C kernel does."""
    t = (y.float() + 1.0) * (0.5 * ncell)  # fp32 add, exact power-of-two scale
    return t.nan_to_num(0.0).clamp(0.0, ncell - 1).to(torch.int64)


def build_table(codebook: Tensor) -> QuantTable:
    """Builds the tables of a sorted fp32 codebook.

    Raises:
        ValueError: the codebook is empty, not 1-D, not finite or not sorted.
    """
    cb = codebook.detach().to("cpu", torch.float32).contiguous()
    if cb.dim() != 1 or cb.numel() == 0:
        raise ValueError(
            f"codebook must be a non-empty 1-D tensor, got {tuple(cb.shape)}"
        )
    if not bool(torch.isfinite(cb).all()):
        raise ValueError("codebook has non-finite values")
    if cb.numel() > 1 and not bool((cb[1:] >= cb[:-1]).all()):
        raise ValueError(f"codebook must be sorted ascending, got {cb.tolist()}")
    uniq, counts = torch.unique_consecutive(cb, return_counts=True)
    first = torch.cumsum(counts, 0) - counts
    if cb.numel() > 256:
        raise ValueError(f"codebook has {cb.numel()} codes; at most 256 (8-bit codes)")
    # The exact midpoint (a sum of two fp32 numbers is exact in float64) rounded
    # down to fp32: for fp32 x, x > mid_down <=> x > exact midpoint, so the rule
    # is the exact nearest value with ties to the lower one (as quant.NearestCode).
    exact = (uniq[:-1].double() + uniq[1:].double()) / 2
    mids = exact.float()
    over = mids.double() > exact
    mids[over] = torch.nextafter(
        mids[over], torch.tensor(-float("inf"), dtype=torch.float32)
    )
    cells = cell_index(mids, CELLS)
    # cells are non-decreasing (mids ascending), so a search counts lower cells
    lut = torch.searchsorted(cells, torch.arange(CELLS), side="left")
    per_cell = torch.bincount(cells, minlength=CELLS)
    # Explicit fp32 (whatever torch's default dtype): the kernel reads mid's bits as
    # int32, so a float64 sentinel would promote mid and double the view's length.
    mid = torch.cat(
        [mids, torch.tensor([float("inf")], dtype=torch.float32)]
    ).contiguous()
    # A cell without a midpoint gets mid[j], which lies in a higher cell, so the
    # comparison is false there and the entry is right for every cell.
    mid_bits = mid[lut].view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    entry = (lut.to(torch.int64) << 32) | mid_bits
    lut = torch.where(per_cell > 0, ~lut, lut)
    sr_entry, sr_steps = _interval_entry(uniq)
    inf = torch.tensor([float("inf")], dtype=torch.float32)
    return QuantTable(
        codebook=cb,
        uniq=uniq.contiguous(),
        mid=mid,
        first=first.to(torch.uint8).contiguous(),
        lut=lut.to(torch.int16).contiguous(),
        steps=int(per_cell.max()) if mids.numel() else 0,
        entry=entry.contiguous(),
        sr_entry=sr_entry,
        sr_steps=sr_steps,
        upad=torch.cat([uniq, inf]).contiguous(),
    )


def _interval_entry(uniq: Tensor) -> tuple[Tensor, int]:
    """``sr_entry`` and ``sr_steps`` of :class:`QuantTable` (see the module doc)."""
    upper = uniq[1:]  # the values that count in i(x) = #{j >= 1 : x >= u_j}
    cells = cell_index(upper, CELLS)  # non-decreasing: upper is ascending
    below = torch.searchsorted(cells, torch.arange(CELLS), side="left")
    per_cell = torch.bincount(cells, minlength=CELLS)
    # where the cell holds a value u (the first, if several: sr_steps says so), the
    # largest fp32 number below it; else +inf, which no x exceeds (NaN neither)
    own = upper[below.clamp(max=max(upper.numel() - 1, 0))] if upper.numel() else None
    thr = torch.full((CELLS,), float("inf"), dtype=torch.float32)
    if own is not None:
        below_own = torch.nextafter(own, torch.tensor(-float("inf")))
        thr = torch.where(per_cell > 0, below_own, thr)
    bits = thr.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    sr_steps = int(per_cell.max()) if upper.numel() else 0
    return ((below.to(torch.int64) << 32) | bits).contiguous(), sr_steps


# id(codebook) -> (weak reference, version, device, table, the table's copies on
# other devices); the codebook is one tensor shared by all parameters, so this
# holds one or two entries in practice.
_cache: dict[int, tuple[weakref.ref, int, str, QuantTable, dict]] = {}
_CACHE_LIMIT = 16


def quant_table(codebook: Tensor, device: torch.device | None = None) -> QuantTable:
    """The (cached) table of ``codebook``, rebuilt if the tensor was modified.

    The table is built on the CPU; with ``device``, its copy on that device, made
    once per table: a copy per step would be a host-to-device copy per step, each
    one a wait of the host for the device.
    """
    key = id(codebook)
    entry = _cache.get(key)
    version = codebook._version  # bumped by every in-place change
    if (
        entry is not None
        and entry[0]() is codebook
        and entry[1] == version
        and entry[2] == str(codebook.device)
    ):
        table, copies = entry[3], entry[4]
    else:
        table, copies = build_table(codebook), {}
        if len(_cache) >= _CACHE_LIMIT:
            _cache.clear()
        device_name = str(codebook.device)
        _cache[key] = (weakref.ref(codebook), version, device_name, table, copies)
    if device is None or torch.device(device) == table.codebook.device:
        return table
    name = str(torch.device(device))
    if name not in copies:
        copies[name] = QuantTable(
            *(
                t.to(device) if isinstance(t, Tensor) else t
                for t in vars(table).values()
            )
        )
    return copies[name]


def nearest_index(x: Tensor, table: QuantTable) -> Tensor:
    """Index k into ``table.uniq`` of the value nearest each x (ties to the lower),
    by the kernel's table lookup, in tensor ops (int64, on x's and table's device).
    """
    j = table.lut[cell_index(x, table.lut.numel())].long()
    inside = j < 0  # the cell holds midpoints: count those below x
    k = torch.where(inside, ~j, j)
    for _ in range(table.steps):
        k += inside & (x > table.mid[k])
    return k
