r"""Gefen's CUDA step: Triton kernels over tables of parameters (the host side).

``_fused.fused_step`` (one parameter) and ``_fused_many.step_many`` (all of a
step's parameters) send CUDA tensors here when :func:`problem` finds nothing the
kernels do not cover; the kernels (``_triton_kernels.py``) compute
``_step.reference_step``'s update with the C kernel's roundings and the same
counter-based random bits, so a run moved between CPU and GPU continues on the
same stream. Like the C kernel's ``_cabi``, this module turns each parameter into
a *job* (:func:`job`: pointers, sizes, per-step scalars and keys) and steps a list
of jobs at once (:func:`launch`).

**Covered:** 8-bit and 4-bit codes (packed or one per byte) and fp32 momentum;
second moment per block, per element or factored; nearest and stochastic codes;
fp32, bf16 and fp16 parameters and gradients, bf16 parameters rounded to nearest
or stochastically; weight decay, ``maximize``, ``update_clip``. **Not covered**
(:func:`problem` names it; the caller keeps the ``torch.compile``'d fallback):
stochastic rounding of fp16 parameters, non-contiguous tensors, and anything
without ``triton`` installed.

**Launches per step:** one main launch per (parameter dtype, gradient dtype)
pair among the jobs (one for a model of one dtype), plus three when any job has
a factored second moment (its row and column sums, then the factors: see
``_triton_kernels``), so the 8-bit and 4-bit defaults (which factor matrices)
take 4 launches, blocks alone 1, whatever the number of parameters. Two small
host-to-device copies carry the job tables (non-blocking, from pinned memory);
nothing waits for the device. The tables are rebuilt every step in Python (about
a dozen scalars per parameter): cheap next to a step's other per-parameter
bookkeeping in ``Gefen.step``, but not free; caching them is future work.

**Without a GPU:** with ``TRITON_INTERPRET=1`` set before triton is first
imported, CPU tensors run the same kernels through Triton's interpreter, which is
how the parity tests run in the default CPU suite (``tests/conftest.py``).
"""

from __future__ import annotations

import math
import os
import warnings
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from ._quant_table import quant_table
from ._state_layout import packed_codes

try:  # an optional dependency: the CPU path never needs it
    import triton

    from . import _triton_kernels as _compiled
except ImportError:  # pragma: no cover - exercised where triton is absent
    _compiled = None

__all__ = ["available", "job", "launch", "problem", "serves", "warn_fallback"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TRITON_DTYPES = {}  # torch dtype -> tl dtype, filled on first use
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


def problem(param: Tensor, grad: Tensor, state: dict, stochastic: bool) -> str | None:
    """Why the Triton step cannot take these tensors, naming the option or layout
    (None: it can). ``stochastic``: the parameter is rounded stochastically."""
    if _compiled is None:
        return "an environment without triton"
    for name, t in (("param", param), ("grad", grad)):
        if t.layout != torch.strided or t.dtype not in _DTYPES:
            return f"{name} of dtype {t.dtype} and layout {t.layout}"
        if not t.is_contiguous():
            return f"a non-contiguous {name}"
        if t.device != param.device:
            return f"{name} on {t.device} beside param on {param.device}"
    if stochastic and param.dtype == torch.float16:
        return "stochastic rounding of fp16 parameters"
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
    """Warns once per reason that CUDA tensors take the compiled fallback."""
    if reason in _warned:
        return
    _warned.add(reason)
    warnings.warn(
        f"Gefen's Triton step does not cover {reason} yet: those parameters step "
        "through the torch.compile'd PyTorch fallback, far slower",
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


# The codebooks' device tables: (id, device) -> (weak ref, version, table).
_tables: dict[tuple[int, str], tuple[weakref.ref, int, Tensor]] = {}


def _device_table(codebook: Tensor, device: torch.device, k) -> Tensor:
    """The quantizer table of ``codebook`` on ``device`` (``k``: the kernels
    module, for the layout), built once per codebook version."""
    entry = _tables.get((id(codebook), str(device)))
    if entry is not None and entry[0]() is codebook and entry[1] == codebook._version:
        return entry[2]
    t = quant_table(codebook)
    u = t.uniq.numel()
    table = torch.full((k.Q_SIZE,), math.inf, dtype=torch.float32)
    table[k.Q_CB : k.Q_CB + t.codebook.numel()] = t.codebook
    table[k.Q_MID : k.Q_MID + u - 1] = t.mid[: u - 1]
    table[k.Q_UP : k.Q_UP + u - 1] = t.uniq[1:]
    table[k.Q_UNIQ : k.Q_UNIQ + u] = t.uniq
    table[k.Q_FIRST :] = 0.0
    table[k.Q_FIRST : k.Q_FIRST + u] = t.first.float()
    table = table.to(device)
    if len(_tables) >= 16:
        _tables.clear()
    _tables[id(codebook), str(device)] = (weakref.ref(codebook), codebook._version, table)
    return table


def _signed(key: int) -> int:
    """A 64-bit key as the int64 with its bits."""
    return key - (1 << 64) if key >= 1 << 63 else key


def _pow2(x: int, lo: int, hi: int) -> int:
    """The power of two >= x, clamped to [lo, hi]."""
    return max(lo, min(hi, 1 << max(0, int(x) - 1).bit_length()))


def _upload(rows: list[list], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A table built on the host, on ``device`` without waiting for it."""
    table = torch.tensor(rows, dtype=dtype)
    if device.type == "cuda":
        return table.pin_memory().to(device, non_blocking=True)
    return table


def _log_jobs(count: int) -> int:
    return max(1, (count - 1).bit_length())


def launch(jobs: list[Job]) -> int:
    """One Gefen step of every job, on the device of their tensors (all the same;
    CPU tensors run through the interpreter). Returns the number of kernel
    launches (see the module docstring)."""
    if not jobs:
        return 0
    device = jobs[0].param.device
    if _compiled is None:
        raise RuntimeError("Gefen's Triton step needs triton: pip install triton")
    k = _compiled
    if not _TRITON_DTYPES:
        import triton.language as tl

        _TRITON_DTYPES.update(
            {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
        )
    exact = device.type == "cpu"  # the interpreter's tl.fma rounds twice
    # jobs of one (grad dtype, param dtype) pair are contiguous rows: one launch each
    jobs = sorted(jobs, key=lambda j: (str(j.grad.dtype), str(j.param.dtype)))
    factored = [i for i, j in enumerate(jobs) if "factored" in j.state]
    # factored scratch: a, b (fp32, R + C each); colpart, rowpart, cpart (fp64)
    shapes = []
    cols_tile = _pow2(max((j.param.numel() // int(jobs[i].state["factored"]) for i in factored for j in [jobs[i]]), default=1), 16, 256)
    f32_size = f64_size = 0
    for i in factored:
        rows = int(jobs[i].state["factored"])
        cols = jobs[i].param.numel() // rows
        nchunk = min(_MAX_CHUNKS, math.ceil(rows / _FACTOR_ROWS))
        chunk_rows = math.ceil(rows / nchunk)
        nchunk = math.ceil(rows / chunk_rows)
        nct = math.ceil(cols / cols_tile)
        shapes.append((rows, cols, nchunk, chunk_rows, nct, f32_size, f64_size))
        f32_size += rows + cols
        f64_size += nchunk * cols + nct * rows + nct
    f32 = torch.empty(max(f32_size, 1), dtype=torch.float32, device=device)
    f64 = torch.empty(max(f64_size, 1), dtype=torch.float64, device=device)
    ab = {}  # job index -> (a address, b address, cols)
    frows = []
    for i, (rows, cols, nchunk, chunk_rows, nct, o32, o64) in zip(factored, shapes, strict=True):
        a = f32.data_ptr() + 4 * o32
        b = a + 4 * rows
        colpart = f64.data_ptr() + 8 * o64
        rowpart = colpart + 8 * nchunk * cols
        cpart = rowpart + 8 * nct * rows
        ab[i] = (a, b, cols)
        fj = [0] * k.FACTOR_FIELDS
        fj[k.F_GRAD] = jobs[i].grad.data_ptr()
        fj[k.F_V] = jobs[i].state["exp_avg_sq"].data_ptr()
        fj[k.F_ROWS], fj[k.F_COLS] = rows, cols
        fj[k.F_A], fj[k.F_B] = a, b
        fj[k.F_COLPART], fj[k.F_ROWPART], fj[k.F_CPART] = colpart, rowpart, cpart
        fj[k.F_CHUNK_ROWS], fj[k.F_NCHUNK], fj[k.F_NCT] = chunk_rows, nchunk, nct
        fj[k.F_JOB] = i
        frows.append(fj)
    table, hypers, units = [], [], []
    for i, j in enumerate(jobs):
        period, block, bits = j.layout
        n = j.param.numel()
        packed = bits == 4 and packed_codes(j.param, j.state)
        unit = 2 if packed and block % 2 else 1
        row = [0] * k.JOB_FIELDS
        row[k.J_PARAM], row[k.J_GRAD] = j.param.data_ptr(), j.grad.data_ptr()
        row[k.J_V] = j.state["exp_avg_sq"].data_ptr()
        row[k.J_N], row[k.J_BLOCK], row[k.J_UNIT], row[k.J_BITS] = n, block, unit, bits
        row[k.J_PACKED] = int(packed)
        if bits:
            row[k.J_M] = j.state["exp_avg_codes"].data_ptr()
            row[k.J_ABSMAX] = j.state["exp_avg_absmax"].data_ptr()
            row[k.J_QTAB] = _device_table(j.state["codebook"], device, k).data_ptr()
            row[k.J_NUNIQ] = quant_table(j.state["codebook"]).uniq.numel()
        else:
            row[k.J_M] = j.state["exp_avg"].data_ptr()
        if i in ab:
            row[k.J_VKIND] = k.V_FACTORED
            row[k.J_A], row[k.J_B], row[k.J_COLS] = ab[i]
        else:
            row[k.J_VKIND] = k.V_ELEMENT if period == 1 else k.V_BLOCKS
        row[k.J_INDEX0] = j.index0
        row[k.J_CODE_SR] = int(j.code_key is not None and bits != 0)
        row[k.J_CODE_KEY] = _signed(j.code_key or 0)
        row[k.J_PARAM_SR] = int(j.stochastic and j.param.dtype == torch.bfloat16)
        row[k.J_ROUND_KEY] = _signed(j.key)
        table.append(row)
        hypers.append([j.hyper[f] for f in k.HYPER_FIELDS])
        units.append(math.ceil(n / (unit * block)))
    jobs_t = _upload(table, torch.int64, device)
    hyper_t = _upload(hypers, torch.float32, device)
    # Keep the tensors the tables point into alive until the kernels ran: the
    # caching allocator reuses freed memory only in stream order, so holding
    # them to the end of this function is enough.
    count = 0
    opts = {"enable_fp_fusion": False} if device.type == "cuda" else {}
    if factored:
        f_t = _upload(frows, torch.int64, device)
        log = _log_jobs(len(factored))
        nf = len(factored)
        per = [s[2] * s[4] for s in shapes]
        starts = _upload([_cumsum(per)], torch.int64, device).view(-1)
        # the row sums read the gradient: one launch per gradient dtype
        groups: dict[torch.dtype, list[int]] = {}
        for slot, i in enumerate(factored):
            groups.setdefault(jobs[i].grad.dtype, []).append(slot)
        for gdtype, slots in groups.items():
            lo, hi = slots[0], slots[-1] + 1
            if slots != list(range(lo, hi)):
                raise AssertionError("factored jobs of one gradient dtype are contiguous")
            sub_starts = starts[lo : hi + 1] - starts[lo]
            k.factor_rows_kernel[(sum(per[lo:hi]),)](
                f_t[lo:hi],
                sub_starts,
                hi - lo,
                ROWS=_FACTOR_ROWS,
                COLS=cols_tile,
                LOG_JOBS=_log_jobs(hi - lo),
                G_DTYPE=_TRITON_DTYPES[gdtype],
                **opts,
            )
            count += 1
        col_starts = _upload([_cumsum([s[4] for s in shapes])], torch.int64, device).view(-1)
        k.factor_cols_kernel[(sum(s[4] for s in shapes),)](
            f_t, hyper_t, col_starts, nf, COLS=cols_tile, LOG_JOBS=log, EXACT=exact, **opts
        )
        rows_tile = _pow2(max(s[0] for s in shapes), 16, 256)
        row_tiles = [math.ceil(s[0] / rows_tile) for s in shapes]
        row_starts = _upload([_cumsum(row_tiles)], torch.int64, device).view(-1)
        k.factor_a_kernel[(sum(row_tiles),)](
            f_t, hyper_t, row_starts, nf, ROWS=rows_tile, LOG_JOBS=log, EXACT=exact, **opts
        )
        count += 2
    lo = 0
    while lo < len(jobs):
        pair = (jobs[lo].param.dtype, jobs[lo].grad.dtype)
        hi = lo
        while hi < len(jobs) and (jobs[hi].param.dtype, jobs[hi].grad.dtype) == pair:
            hi += 1
        longest = max(j_unit * jobs[i].layout[1] for i, j_unit in ((i, table[i][k.J_UNIT]) for i in range(lo, hi)))
        tile = _pow2(min(longest, max(jobs[i].param.numel() for i in range(lo, hi))), 16, _MAX_TILE)
        starts = _upload([_cumsum(units[lo:hi])], torch.int64, device).view(-1)
        k.gefen_step_kernel[(sum(units[lo:hi]),)](
            jobs_t[lo:hi],
            hyper_t[lo:hi],
            starts,
            hi - lo,
            TILE=tile,
            LOG_JOBS=_log_jobs(hi - lo),
            P_DTYPE=_TRITON_DTYPES[pair[0]],
            G_DTYPE=_TRITON_DTYPES[pair[1]],
            EXACT=exact,
            **opts,
        )
        count += 1
        lo = hi
    return count


def _cumsum(values: list[int]) -> list[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out
