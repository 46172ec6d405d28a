r"""Gefen's CUDA step: Triton kernels over tables of parameters (the host side).

The dispatch (``_fused.implementation``, for ``_dispatch.step_many`` and
``_fused.fused_step``) sends CUDA tensors here when :func:`problem` finds nothing
the kernels do not cover; the kernels (``_triton_kernels.py``) compute
``_step.reference_step``'s update with the C kernel's roundings and the same
counter-based random bits, so a run moved between CPU and GPU continues on the
same stream. Like the C kernel's ``_cabi``, this module turns each parameter into
a *job* (:func:`job`: pointers, sizes, per-step scalars and keys) and steps a list
of jobs at once (:func:`launch`).

**Covered:** 8-bit and 4-bit codes (packed or one per byte) and fp32 momentum;
second moment per block, per element or factored; nearest and stochastic codes;
fp32, bf16 and fp16 parameters and gradients, rounded to nearest or
stochastically; weight decay, ``maximize``, ``update_clip``; non-contiguous
parameters through ``step_many``'s contiguous twins. **Not covered** (:func:`problem`
names it; the caller takes the eager PyTorch fallback and warns once):
an environment without ``triton``, non-contiguous tensors handed to
``fused_step`` directly, state tensors that are not Gefen's dtypes or not on the
parameter's device.

**Launches per step:** one main launch per (parameter dtype, gradient dtype)
pair among the jobs (one for a model of one dtype), plus three when any job has
a factored second moment (its row and column sums, then the factors: see
``_triton_factored``), so the 8-bit and 4-bit defaults (which factor matrices)
take 4 launches, blocks alone 1, whatever the number of parameters. A few small
host-to-device copies carry the job tables (non-blocking, from pinned memory);
nothing waits for the device. The tables' columns that stay from step to step
(pointers into the state, sizes, layouts, the factored scratch, the programs'
search tables) are kept in :class:`Tables` (the dispatch's cache holds one) while
the same states step; a steady step writes only each job's gradient pointer and
rounding keys, and the per-step scalars.

**Without a GPU:** with ``TRITON_INTERPRET=1`` set before triton is first
imported, CPU tensors run the same kernels through Triton's interpreter, which is
how the parity tests run in the default CPU suite (``tests/conftest.py``).
"""

from __future__ import annotations

import math
import warnings
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from ._quant_table import quant_table
from ._state_layout import packed_codes

try:  # an optional dependency: the CPU path never needs it
    import triton

    from . import _triton_factored as _factored
    from . import _triton_kernels as _compiled
except ImportError:  # pragma: no cover - exercised where triton is absent
    _compiled = _factored = None

__all__ = [
    "Tables",
    "available",
    "grad_fits",
    "job",
    "launch",
    "problem",
    "serves",
    "warn_fallback",
]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_TILE = 1024  # elements a program holds at once (a longer unit takes 2 passes)
_FACTOR_ROWS = 16  # rows of a factor-sum tile
_MAX_CHUNKS = 64  # row chunks per factored gradient: scratch is 64 x cols doubles


def available() -> bool:
    """Whether ``triton`` is importable (the kernels can run)."""
    return _compiled is not None


def serves(device: torch.device) -> bool:
    """Whether Gefen's step sends tensors on ``device`` here (CUDA; the CPU has
    the C kernel)."""
    return device.type == "cuda"


def interpreting() -> bool:
    """Whether Triton runs kernels through its interpreter (``TRITON_INTERPRET=1``
    before triton was first imported): then they take CPU tensors."""
    return _compiled is not None and bool(triton.knobs.runtime.interpret)


def _tensor_problem(name: str, t: Tensor, device: torch.device) -> str | None:
    if t.layout != torch.strided or t.dtype not in _DTYPES:
        return f"{name} of dtype {t.dtype} and layout {t.layout}"
    if not t.is_contiguous():
        return f"a non-contiguous {name}"
    if t.device != device:
        return f"{name} on {t.device} beside param on {device}"
    return None


def grad_fits(param: Tensor, grad: Tensor) -> bool:
    """The gradient's half of :func:`problem` (the dispatch asks it of each new
    gradient of a parameter whose checks it keeps)."""
    return grad.numel() == param.numel() and (
        _tensor_problem("grad", grad, param.device) is None
    )


def problem(param: Tensor, grad: Tensor, state: dict, stochastic: bool) -> str | None:
    """Why the Triton step cannot take these tensors, naming the option or layout
    (None: it can). ``stochastic``: the parameter is rounded stochastically."""
    if _compiled is None:
        return "an environment without triton"
    for name, t in (("param", param), ("grad", grad)):
        if (why := _tensor_problem(name, t, param.device)) is not None:
            return why
    names = ["exp_avg_sq"]
    names += ["exp_avg_absmax", "exp_avg_codes"] if "codebook" in state else ["exp_avg"]
    for name in names:
        t = state[name]
        want = torch.uint8 if name == "exp_avg_codes" else torch.float32
        if t.dtype != want or t.device != param.device or not t.is_contiguous():
            return (
                f"state '{name}' of dtype {t.dtype} on {t.device} "
                f"(contiguous={t.is_contiguous()})"
            )
    return None


_warned: set[str] = set()


def warn_fallback(reason: str) -> None:
    """Warns once per reason that CUDA tensors take the eager PyTorch fallback."""
    if reason in _warned:
        return
    _warned.add(reason)
    warnings.warn(
        f"Gefen's Triton step does not cover {reason} yet: those parameters step "
        "through the eager PyTorch fallback (_torch_step), far slower",
        stacklevel=3,
    )


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


def job(
    param: Tensor,
    grad: Tensor,
    state: dict,
    hyper: dict[str, float],
    *,
    layout: tuple[int, int, int],
    stochastic: bool = False,
    key: int = 0,
    code_key: int | None = None,
    index0: int = 0,
) -> Job:
    """One parameter's job (``state['step']`` already advanced by the caller, as
    for the C kernel's ``_cabi.c_job``; the caller checked :func:`problem`)."""
    return Job(param, grad, state, layout, hyper, stochastic, key, code_key, index0)


# The codebooks' device tables: (id, device) -> (weak ref, version, _Codebook).
_tables: dict[tuple[int, str], tuple] = {}


@dataclass(frozen=True)
class _Codebook:
    """A codebook's quantizer table on one device and the scalars jobs need."""

    table: Tensor  # fp32 [Q_SIZE], the kernels' Q_* layout
    nuniq: int  # distinct values
    zero: int  # the value index nearest 0 (ties down): #{midpoints < 0}


def _device_table(codebook: Tensor, device: torch.device) -> _Codebook:
    """The quantizer table of ``codebook`` on ``device``, built once per codebook
    version (``_quant_table`` builds it on the host)."""
    entry = _tables.get((id(codebook), str(device)))
    if entry is not None and entry[0]() is codebook and entry[1] == codebook._version:
        return entry[2]
    t, q = quant_table(codebook), _ints()
    u = t.uniq.numel()
    table = torch.full((q.Q_SIZE,), math.inf, dtype=torch.float32)
    table[q.Q_CB : q.Q_CB + t.codebook.numel()] = t.codebook
    table[q.Q_MID : q.Q_MID + u - 1] = t.mid[: u - 1]
    table[q.Q_UP : q.Q_UP + u - 1] = t.uniq[1:]
    table[q.Q_UNIQ : q.Q_UNIQ + u] = t.uniq
    table[q.Q_FIRST :] = 0.0
    table[q.Q_FIRST : q.Q_FIRST + u] = t.first.float()
    out = _Codebook(table.to(device), u, int((t.mid < 0).sum()))
    if len(_tables) >= 16:
        _tables.clear()
    _tables[id(codebook), str(device)] = (weakref.ref(codebook), codebook._version, out)
    return out


_INTS = None


def _ints():
    """The kernels' table columns and kinds (constexpr there) as plain ints."""
    global _INTS
    if _INTS is None:
        import triton.language as tl

        values = {**vars(_factored), **vars(_compiled)}
        _INTS = type(
            "Columns",
            (),
            {
                name: int(v.value)
                for name, v in values.items()
                if isinstance(v, tl.constexpr) and isinstance(v.value, int)
            },
        )
    return _INTS


def _signed(key: int) -> int:
    """A 64-bit key as the int64 with its bits."""
    return key - (1 << 64) if key >= 1 << 63 else key


def _pow2(x: int, lo: int, hi: int) -> int:
    """The power of two >= x, clamped to [lo, hi]."""
    return max(lo, min(hi, 1 << max(0, int(x) - 1).bit_length()))


def _upload(rows: list | Tensor, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A table built on the host, on ``device`` without waiting for it (pinned:
    the copy is asynchronous, and the pinned block is not reused before it ran)."""
    table = rows if isinstance(rows, Tensor) else torch.tensor(rows, dtype=dtype)
    if device.type == "cuda":
        return table.pin_memory().to(device, non_blocking=True)
    return table


def _starts(counts: list[int], device: torch.device) -> Tensor:
    """Each job's first program index, then the total: the kernels' search table."""
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return _upload(out, torch.int64, device)


def _log_jobs(count: int) -> int:
    """Probes of the kernels' binary search over ``count`` jobs."""
    return max(1, (count - 1).bit_length())


def _tl_dtype(dtype: torch.dtype):
    import triton.language as tl

    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16}.get(
        dtype, tl.float16
    )


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
        nchunk = min(_MAX_CHUNKS, math.ceil(rows / _FACTOR_ROWS))
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
    k = _ints()
    row = [0] * k.FACTOR_FIELDS
    row[k.F_GRAD], row[k.F_V] = j.grad.data_ptr(), j.state["exp_avg_sq"].data_ptr()
    row[k.F_ROWS], row[k.F_COLS], row[k.F_A], row[k.F_B] = f.rows, f.cols, f.a, f.b
    row[k.F_COLPART], row[k.F_ROWPART], row[k.F_CPART] = f.colpart, f.rowpart, f.cpart
    row[k.F_CHUNK_ROWS], row[k.F_NCHUNK], row[k.F_NCT] = f.chunk_rows, f.nchunk, f.nct
    row[k.F_JOB] = f.slot
    return row


def _job_row(j: Job, f: _Factored | None, codebook: _Codebook | None) -> list[int]:
    """One job's row of the int64 table (the kernels' J_* columns), but for the
    columns :func:`_fill` writes each step (gradient pointer, rounding keys)."""
    q = _ints()
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
class _Layout:
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
        self.layouts: dict[torch.device, _Layout] = {}


def launch(jobs: list[Job], tables: Tables | None = None) -> int:
    """One Gefen step of every job, on the device of its tensors (CPU tensors run
    through the interpreter). Returns the number of kernel launches: per device,
    one per (gradient dtype, parameter dtype) pair, plus three with factored jobs.
    ``tables``: the tables of the previous launch of the same jobs (filled here
    on first use); None builds them for this launch only.

    Raises:
        RuntimeError: triton is not installed.
    """
    if jobs and _compiled is None:
        raise RuntimeError("Gefen's Triton step needs triton: pip install triton")
    by_device: dict[torch.device, list[Job]] = {}
    for j in jobs:
        by_device.setdefault(j.param.device, []).append(j)
    count = 0
    for device, group in by_device.items():
        layout = tables.layouts.get(device) if tables is not None else None
        if layout is None:
            layout = _layout(group, device)
            if tables is not None:
                tables.layouts[device] = layout
        if device.type == "cuda":
            with torch.cuda.device(device):  # triton launches on the current one
                count += _launch(group, layout, device, {"enable_fp_fusion": False})
        else:
            count += _launch(group, layout, device, {})
    return count


def _layout(jobs: list[Job], device: torch.device) -> _Layout:
    """The tables of ``jobs`` that stay while they step again (see :class:`_Layout`)."""
    q = _ints()
    # rows of one (grad dtype, param dtype) pair are contiguous: one launch each
    order = sorted(
        range(len(jobs)),
        key=lambda i: (str(jobs[i].grad.dtype), str(jobs[i].param.dtype)),
    )
    jobs = [jobs[i] for i in order]
    cols_tile = _pow2(
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
        _device_table(j.state["codebook"], device) if j.layout[2] else None
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
        # a tile holds the longest unit, up to _MAX_TILE (longer: two passes)
        longest = max(min(r[q.J_UNIT] * r[q.J_BLOCK], r[q.J_N]) for r in rows[lo:hi])
        segments.append(
            _Segment(
                lo,
                hi,
                pair,
                _pow2(longest, 16, _MAX_TILE),
                sum(units[lo:hi]),
                _starts(units[lo:hi], device),
            )
        )
        lo = hi
    factor_table, factor_launches = None, ()
    if factored:
        factor_table = torch.tensor(
            [_factor_row(f, jobs[f.slot]) for f in factored], dtype=torch.int64
        )
        factor_launches = _factor_launches(jobs, factored, device)
    return _Layout(
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


def _fill(table: Tensor, column: int, values: list[int]) -> None:
    table[:, column] = torch.tensor(values, dtype=torch.int64)


def _launch(jobs: list[Job], layout: _Layout, device: torch.device, opts: dict) -> int:
    """:func:`launch`'s work on one device: this step's columns of the kept
    tables, the uploads, the kernels (``opts``: their compile options)."""
    k, q = _compiled, _ints()
    exact = device.type == "cpu"  # the interpreter's tl.fma rounds twice
    jobs = [jobs[i] for i in layout.order]
    table = layout.table.clone()
    _fill(table, q.J_GRAD, [j.grad.data_ptr() for j in jobs])
    _fill(table, q.J_CODE_KEY, [_signed(j.code_key or 0) for j in jobs])
    _fill(table, q.J_ROUND_KEY, [_signed(j.key) for j in jobs])
    hypers = [[j.hyper[f] for f in k.HYPER_FIELDS] for j in jobs]
    jobs_t = _upload(table, torch.int64, device)
    hyper_t = _upload(hypers, torch.float32, device)
    count = 0
    if layout.factored:
        count += _launch_factored(jobs, layout, hyper_t, device, opts)
    for seg in layout.segments:
        k.gefen_step_kernel[(seg.programs,)](
            jobs_t[seg.lo : seg.hi],
            hyper_t[seg.lo : seg.hi],
            seg.starts,
            seg.hi - seg.lo,
            TILE=seg.tile,
            LOG_JOBS=_log_jobs(seg.hi - seg.lo),
            P_DTYPE=_tl_dtype(seg.pair[1]),
            G_DTYPE=_tl_dtype(seg.pair[0]),
            EXACT=exact,
            **opts,
        )
        count += 1
    return count


def _factor_launches(jobs: list[Job], factored: list[_Factored], device) -> tuple:
    """The factored launches' grids and search tables (they stay with the jobs)."""
    rows_segments, lo = [], 0
    while lo < len(factored):  # the row sums read the gradient: one per dtype
        gdtype = jobs[factored[lo].slot].grad.dtype
        hi = lo
        while hi < len(factored) and jobs[factored[hi].slot].grad.dtype == gdtype:
            hi += 1
        per = [f.nchunk * f.nct for f in factored[lo:hi]]
        rows_segments.append((lo, hi, gdtype, sum(per), _starts(per, device)))
        lo = hi
    tiles = [f.nct for f in factored]
    cols = (sum(tiles), _starts(tiles, device))
    rows_tile = _pow2(max(f.rows for f in factored), 16, 256)
    tiles = [math.ceil(f.rows / rows_tile) for f in factored]
    return rows_segments, cols, rows_tile, (sum(tiles), _starts(tiles, device))


def _launch_factored(jobs, layout: _Layout, hyper_t, device, opts) -> int:
    """The three launches that advance the factored jobs' factors and leave this
    step's ``a`` and ``b`` in scratch; returns 3 (the row sums go once per
    gradient dtype, so more with mixed gradient dtypes)."""
    k = _ints()
    factored, cols_tile = layout.factored, layout.cols_tile
    rows_segments, (col_programs, col_starts), rows_tile, a_grid = (
        layout.factor_launches
    )
    f_table = layout.factor_table.clone()
    _fill(f_table, k.F_GRAD, [jobs[f.slot].grad.data_ptr() for f in factored])
    f_t = _upload(f_table, torch.int64, device)
    count = 0
    for lo, hi, gdtype, programs, starts in rows_segments:
        _factored.factor_rows_kernel[(programs,)](
            f_t[lo:hi],
            starts,
            hi - lo,
            ROWS=_FACTOR_ROWS,
            COLS=cols_tile,
            LOG_JOBS=_log_jobs(hi - lo),
            G_DTYPE=_tl_dtype(gdtype),
            **opts,
        )
        count += 1
    nf, log = len(factored), _log_jobs(len(factored))
    _factored.factor_cols_kernel[(col_programs,)](
        f_t,
        hyper_t,
        col_starts,
        nf,
        COLS=cols_tile,
        LOG_JOBS=log,
        EXACT=device.type == "cpu",
        **opts,
    )
    _factored.factor_a_kernel[(a_grid[0],)](
        f_t,
        hyper_t,
        a_grid[1],
        nf,
        ROWS=rows_tile,
        LOG_JOBS=log,
        EXACT=device.type == "cpu",
        **opts,
    )
    return count + 2
