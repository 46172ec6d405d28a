r"""The job tables of Gefen's Triton step: one parameter's *job*, and the layout
of a launch's jobs that stays from step to step (host side, no kernels).

A job (``_triton_step.job``) is one parameter's pointers, sizes, per-step scalars and
keys, as the C kernel's ``_cabi.c_job``. :func:`build_layout` orders a launch's
jobs by (gradient dtype, parameter dtype), so that each pair is one contiguous
*segment* of rows (one launch), and builds what stays while the same states step
again (:class:`Layout`): the int64 job table but for the columns a step writes
(``_triton_step.fill``: the gradient pointer and the rounding keys), each
segment's search table, and the factored jobs' scratch and launch grids.
:class:`Tables` keeps the layouts of one set of jobs (the dispatch's cache holds
one); ``_triton_step.launch`` uses them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ._state_layout import packed_codes
from ._triton_tables import DeviceCodebook, columns, device_codebook, pow2, starts

__all__ = ["FACTOR_ROWS", "MAX_TILE", "Job", "Layout", "Tables", "build_layout"]

MAX_TILE = 1024  # elements a program holds at once (a longer unit takes 2 passes)
FACTOR_ROWS = 16  # rows of a factor-sum tile
MAX_CHUNKS = 64  # row chunks per factored gradient: scratch is 64 x cols doubles


@dataclass
class Job:
    """One parameter's share of a launch (what :func:`launch` reads)."""

    param: Tensor
    grad: Tensor
    state: dict
    layout: tuple[int, int, int]  # (period, block, bits): _state_layout
    hyper: dict[str, float]  # _fused.hyperparameters of this step
    stochastic: bool  # the parameter is rounded stochastically (bf16)
    key: int  # its rounding key (precision.rounding_key)
    code_key: int | None  # the codes' key (code_rounding.code_key), None: nearest
    index0: int  # global flat index of element 0 (a shard's offset)


@dataclass
class _Factored:
    """One factored job's shape and its share of the step's scratch."""

    slot: int  # the job's row in the tables
    rows: int
    cols: int
    chunk_rows: int  # rows per chunk of the row sums
    nchunk: int
    nct: int  # column tiles
    a: int  # addresses: a [rows], b [cols] (fp32), then the fp64 partial sums
    b: int
    colpart: int  # [nchunk, cols]
    rowpart: int  # [nct, rows]
    cpart: int  # [nct]


def _factored_layout(jobs: list[Job], device: torch.device, cols_tile: int):
    """The factored jobs' scratch (returned, to keep it alive) and layouts."""
    shapes, f32_size, f64_size = [], 0, 0
    for slot, j in enumerate(jobs):
        if "factored" not in j.state:
            continue
        rows = int(j.state["factored"])
        cols = j.param.numel() // rows
        nchunk = min(MAX_CHUNKS, math.ceil(rows / FACTOR_ROWS))
        chunk_rows = math.ceil(rows / nchunk)
        nchunk = math.ceil(rows / chunk_rows)
        nct = math.ceil(cols / cols_tile)
        shapes.append((slot, rows, cols, chunk_rows, nchunk, nct, f32_size, f64_size))
        f32_size += rows + cols
        f64_size += nchunk * cols + nct * rows + nct
    f32 = torch.empty(max(f32_size, 1), dtype=torch.float32, device=device)
    f64 = torch.empty(max(f64_size, 1), dtype=torch.float64, device=device)
    out = []
    for slot, rows, cols, chunk_rows, nchunk, nct, o32, o64 in shapes:
        a = f32.data_ptr() + 4 * o32
        colpart = f64.data_ptr() + 8 * o64
        rowpart = colpart + 8 * nchunk * cols
        out.append(
            _Factored(
                slot,
                rows,
                cols,
                chunk_rows,
                nchunk,
                nct,
                a,
                a + 4 * rows,
                colpart,
                rowpart,
                rowpart + 8 * nct * rows,
            )
        )
    return (f32, f64), out


def _factor_row(f: _Factored, j: Job) -> list[int]:
    """One factored job's row of its int64 table (``_triton_factored``'s F_*)."""
    k = columns()
    row = [0] * k.FACTOR_FIELDS
    row[k.F_GRAD], row[k.F_V] = j.grad.data_ptr(), j.state["exp_avg_sq"].data_ptr()
    row[k.F_ROWS], row[k.F_COLS], row[k.F_A], row[k.F_B] = f.rows, f.cols, f.a, f.b
    row[k.F_COLPART], row[k.F_ROWPART], row[k.F_CPART] = f.colpart, f.rowpart, f.cpart
    row[k.F_CHUNK_ROWS], row[k.F_NCHUNK], row[k.F_NCT] = f.chunk_rows, f.nchunk, f.nct
    row[k.F_JOB] = f.slot
    return row


def _job_row(j: Job, f: _Factored | None, codebook: DeviceCodebook | None) -> list[int]:
    """One job's row of the int64 table (the kernels' J_* columns), but for the
    columns :func:`_fill` writes each step (gradient pointer, rounding keys)."""
    q = columns()
    period, block, bits = j.layout
    packed = bits == 4 and packed_codes(j.param, j.state)
    row = [0] * q.JOB_FIELDS
    row[q.J_PARAM] = j.param.data_ptr()
    row[q.J_V] = j.state["exp_avg_sq"].data_ptr()
    row[q.J_N], row[q.J_BLOCK], row[q.J_BITS] = j.param.numel(), block, bits
    # 4-bit codes of an odd block share a byte with the next block: a program
    # takes two blocks, so one program writes that byte
    row[q.J_UNIT] = 2 if packed and block % 2 else 1
    row[q.J_PACKED] = int(packed)
    if bits:
        row[q.J_M] = j.state["exp_avg_codes"].data_ptr()
        row[q.J_ABSMAX] = j.state["exp_avg_absmax"].data_ptr()
        row[q.J_QTAB] = codebook.table.data_ptr()
        row[q.J_NUNIQ], row[q.J_ZERO] = codebook.nuniq, codebook.zero
    else:
        row[q.J_M] = j.state["exp_avg"].data_ptr()
    if f is not None:
        row[q.J_VKIND], row[q.J_COLS] = q.V_FACTORED, f.cols
        row[q.J_A], row[q.J_B] = f.a, f.b
    else:
        row[q.J_VKIND] = q.V_ELEMENT if period == 1 else q.V_BLOCKS
    row[q.J_INDEX0] = j.index0
    row[q.J_CODE_SR] = int(j.code_key is not None and bits != 0)
    row[q.J_PARAM_SR] = int(j.stochastic and j.param.dtype != torch.float32)
    return row


@dataclass
class _Segment:
    """The jobs ``[lo, hi)`` of one main launch (one gradient and parameter dtype)."""

    lo: int
    hi: int
    pair: tuple[torch.dtype, torch.dtype]  # (gradient dtype, parameter dtype)
    tile: int
    programs: int
    starts: Tensor  # each job's first program, on the device


@dataclass
class Layout:
    """What a device's launch keeps from step to step while its jobs hold."""

    order: list[int]  # the jobs sorted by (gradient dtype, parameter dtype)
    table: Tensor  # int64 [jobs, JOB_FIELDS] on the host, per-step columns 0
    segments: list[_Segment]
    cols_tile: int
    scratch: tuple  # the factored jobs' factors and partial sums
    factored: list[_Factored]
    factor_table: Tensor | None  # int64 [factored, FACTOR_FIELDS], F_GRAD 0
    factor_launches: tuple  # (row-sum segments, column starts, a tile, a starts)
    codebooks: list  # the device tables the rows point into, kept alive


class Tables:
    """The job tables of a launch, kept for the next while ``key`` holds (the
    dispatch's: each job's checked state and gradient dtype, in order)."""

    def __init__(self, key: tuple) -> None:
        self.key = key
        self.layouts: dict[torch.device, Layout] = {}


def build_layout(jobs: list[Job], device: torch.device) -> Layout:
    """The tables of ``jobs`` that stay while they step again (see :class:`_Layout`)."""
    q = columns()
    # rows of one (grad dtype, param dtype) pair are contiguous: one launch each
    order = sorted(
        range(len(jobs)),
        key=lambda i: (str(jobs[i].grad.dtype), str(jobs[i].param.dtype)),
    )
    jobs = [jobs[i] for i in order]
    cols_tile = pow2(
        max(
            (
                j.param.numel() // int(j.state["factored"])
                for j in jobs
                if "factored" in j.state
            ),
            default=1,
        ),
        16,
        256,
    )
    scratch, factored = _factored_layout(jobs, device, cols_tile)
    of_slot = {f.slot: f for f in factored}
    # one device table per job, kept with the layout: the rows hold only their
    # addresses, and the tables' cache may drop an entry while this one is alive
    codebooks = [
        device_codebook(j.state["codebook"], device) if j.layout[2] else None
        for j in jobs
    ]
    rows = [
        _job_row(j, of_slot.get(i), cb)
        for i, (j, cb) in enumerate(zip(jobs, codebooks, strict=True))
    ]
    units = [math.ceil(r[q.J_N] / (r[q.J_UNIT] * r[q.J_BLOCK])) for r in rows]
    segments, lo = [], 0
    while lo < len(jobs):
        pair = (jobs[lo].grad.dtype, jobs[lo].param.dtype)
        hi = lo
        while hi < len(jobs) and (jobs[hi].grad.dtype, jobs[hi].param.dtype) == pair:
            hi += 1
        # a tile holds the longest unit, up to MAX_TILE (longer: two passes)
        longest = max(min(r[q.J_UNIT] * r[q.J_BLOCK], r[q.J_N]) for r in rows[lo:hi])
        segments.append(
            _Segment(
                lo,
                hi,
                pair,
                pow2(longest, 16, MAX_TILE),
                sum(units[lo:hi]),
                starts(units[lo:hi], device),
            )
        )
        lo = hi
    factor_table, factor_launches = None, ()
    if factored:
        factor_table = torch.tensor(
            [_factor_row(f, jobs[f.slot]) for f in factored], dtype=torch.int64
        )
        factor_launches = _factor_launches(jobs, factored, device)
    return Layout(
        order,
        torch.tensor(rows, dtype=torch.int64),
        segments,
        cols_tile,
        scratch,
        factored,
        factor_table,
        factor_launches,
        codebooks,
    )


def _factor_launches(jobs: list[Job], factored: list[_Factored], device) -> tuple:
    """The factored launches' grids and search tables (they stay with the jobs)."""
    rows_segments, lo = [], 0
    while lo < len(factored):  # the row sums read the gradient: one per dtype
        gdtype = jobs[factored[lo].slot].grad.dtype
        hi = lo
        while hi < len(factored) and jobs[factored[hi].slot].grad.dtype == gdtype:
            hi += 1
        per = [f.nchunk * f.nct for f in factored[lo:hi]]
        rows_segments.append((lo, hi, gdtype, sum(per), starts(per, device)))
        lo = hi
    tiles = [f.nct for f in factored]
    cols = (sum(tiles), starts(tiles, device))
    rows_tile = pow2(max(f.rows for f in factored), 16, 256)
    tiles = [math.ceil(f.rows / rows_tile) for f in factored]
    return rows_segments, cols, rows_tile, (sum(tiles), starts(tiles, device))
