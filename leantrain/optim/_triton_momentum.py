r"""GefenMuon's momentum on the GPU: the host side of ``_triton_momentum_kernel``.

GefenMuon's Muon side (``muon.py``) sends the parameters with quantized momentum
whose tensors ``_triton_step.serves`` (CUDA) to :func:`step_on_triton` when
:func:`problem` finds nothing the kernel does not cover (the others, and fp32
momentum, step through the reference ``_muon_math.muon_step``, one at a time).
Each becomes a *job* (:func:`job`); :func:`launch` steps every job's momentum at
once and returns each one's
Newton–Schulz input (the exact new fp32 momentum, or the Nesterov blend), which
``_muon_math.muon_update`` then orthogonalizes and applies in torch, per
parameter, as Muon's always are. ``_muon_math.muon_momentum`` is the
reference: codes equal but for ties, the returned tensor to fp32 rounding,
stochastic codes on the same keyed bits.

**Launches per step:** one per gradient dtype among the jobs on a device (one
for a model of one dtype), whatever the number of parameters; the Newton–Schulz
iterations that follow are per parameter, as Muon's always are. The job table
is kept from step to step in :class:`MomentumTables` while the same states step:
a steady step writes only the gradient pointers and code keys, and uploads the
table and the scalars without waiting for the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ._muon_math import default_ns_dtype, muon_update
from ._options import stochastic_codes_of
from ._state_layout import packed_codes
from ._triton_layout import MAX_TILE
from ._triton_step import fill, log_jobs, signed, tl_dtype, upload
from ._triton_tables import (
    COLUMNS,
    DeviceCodebook,
    columns,
    device_codebook,
    momentum_kernels,
    pow2,
    starts,
)
from .code_rounding import code_key

__all__ = [
    "MomentumJob",
    "MomentumTables",
    "MuonEntry",
    "job",
    "launch",
    "problem",
    "step_on_triton",
]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def problem(param: Tensor, grad: Tensor, state: dict) -> str | None:
    """Why the momentum kernel cannot take this Muon parameter (None: it can)."""
    if momentum_kernels is None:
        return "an environment without triton"
    if grad.dtype not in _DTYPES or grad.layout != torch.strided:
        return f"grad of dtype {grad.dtype} and layout {grad.layout}"
    if not grad.is_contiguous() or grad.numel() != param.numel():
        return "a non-contiguous grad (or one of another size)"
    if grad.device != param.device:
        return f"grad on {grad.device} beside param on {param.device}"
    names = ("exp_avg_codes", "exp_avg_absmax") if "codebook" in state else ("exp_avg",)
    for name in names:
        t = state[name]
        want = torch.uint8 if name == "exp_avg_codes" else torch.float32
        if t.dtype != want or t.device != param.device or not t.is_contiguous():
            return (
                f"state '{name}' of dtype {t.dtype} on {t.device} "
                f"(contiguous={t.is_contiguous()})"
            )
    return None


@dataclass
class MomentumJob:
    """One Muon parameter's momentum step (what :func:`launch` reads)."""

    param: Tensor  # read for its shape, size and device only
    grad: Tensor
    state: dict
    momentum: float
    nesterov: bool
    code_key: int | None  # the codes' key (code_rounding.code_key), None: nearest


def job(
    param: Tensor,
    grad: Tensor,
    state: dict,
    *,
    momentum: float,
    nesterov: bool,
    code_key: int | None = None,
) -> MomentumJob:
    """One parameter's job (``state['step']`` already advanced by the caller; the
    caller checked :func:`problem`)."""
    return MomentumJob(param, grad, state, momentum, nesterov, code_key)


def _row(j: MomentumJob, out: Tensor, codebook: DeviceCodebook | None) -> list[int]:
    """One job's row of the int64 table (the kernels' J_* columns), but for the
    columns :func:`_launch` writes each step (gradient pointer, code rounding)."""
    q = COLUMNS
    row = [0] * q.JOB_FIELDS
    row[q.J_OUT], row[q.J_N] = out.data_ptr(), j.param.numel()
    if codebook is None:  # fp32 momentum: a block is only a unit of work
        row[q.J_M] = j.state["exp_avg"].data_ptr()
        row[q.J_BLOCK], row[q.J_UNIT] = MAX_TILE, 1
        return row
    bits = 4 if j.state["codebook"].numel() == 16 else 8
    block = int(j.state["qblock"])
    packed = bits == 4 and packed_codes(j.param, j.state)
    row[q.J_BLOCK], row[q.J_BITS], row[q.J_PACKED] = block, bits, int(packed)
    # 4-bit codes of an odd block share a byte with the next block: a program
    # takes both, so one program writes that byte
    row[q.J_UNIT] = 2 if packed and block % 2 else 1
    row[q.J_M] = j.state["exp_avg_codes"].data_ptr()
    row[q.J_ABSMAX] = j.state["exp_avg_absmax"].data_ptr()
    row[q.J_QTAB] = codebook.table.data_ptr()
    row[q.J_NUNIQ], row[q.J_ZERO] = codebook.nuniq, codebook.zero
    return row


def _hyper(j: MomentumJob) -> list[float]:
    """One job's fp32 scalars: 1 - momentum, the Nesterov weight (1: the output
    is m itself), the gradient's sign."""
    q = COLUMNS
    row = [0.0] * q.N_HYPER
    row[q.H_W1] = 1 - j.momentum
    row[q.H_BLEND] = j.momentum if j.nesterov else 1.0
    row[q.H_SIGN] = 1.0
    return row


def _key(j: MomentumJob) -> tuple:
    """What a job's kept row depends on: its size and shape, gradient dtype, the
    state tensors it points at, the block, the codebook (and its version)."""
    st = j.state
    if "codebook" not in st:
        return (j.param.shape, j.grad.dtype, st["exp_avg"].data_ptr())
    cb = st["codebook"]
    return (
        j.param.shape,
        j.grad.dtype,
        st["exp_avg_codes"].data_ptr(),
        st["exp_avg_codes"].numel(),
        st["exp_avg_absmax"].data_ptr(),
        int(st["qblock"]),
        id(cb),
        cb._version,
    )


@dataclass
class _Kept:
    """One device's job table and launch grids, kept while its jobs' keys hold."""

    key: tuple  # per job (in the caller's order): _key
    order: list[int]  # the jobs sorted by gradient dtype: one launch each
    rows: Tensor  # int64 [jobs, JOB_FIELDS] on the host, per-step columns 0
    outs: list[Tensor]  # per job (in order): its output, a view of one buffer
    segments: list[tuple]  # (lo, hi, programs, starts on the device, constexprs)
    codebooks: list  # the device tables the rows point into, kept alive
    sources: list  # the codebooks keyed by id: kept alive, so no id is reused


class MomentumTables:
    """The job tables of :func:`launch`, kept from step to step per device while
    the same states step (GefenMuon holds one): a steady step writes only each
    job's gradient pointer and code rounding, and the scalars."""

    def __init__(self) -> None:
        self.kept: dict[torch.device, _Kept] = {}


def launch(
    jobs: list[MomentumJob], tables: MomentumTables | None = None
) -> tuple[list[Tensor], int]:
    """One momentum step of every job, on the device of its tensors (CPU tensors
    run through the interpreter). Returns each job's Newton–Schulz input (fp32,
    its parameter's shape; overwritten by the next launch on the same tables) and
    the number of launches: per device, one per gradient dtype. ``tables``: kept
    from the previous launch (None: built for this one only).

    Raises:
        RuntimeError: triton is not installed.
    """
    if jobs and momentum_kernels is None:
        raise RuntimeError(
            "GefenMuon's Triton momentum needs triton: pip install triton"
        )
    tables = MomentumTables() if tables is None else tables
    outs: list[Tensor | None] = [None] * len(jobs)
    by_device: dict[torch.device, list[int]] = {}
    for i, j in enumerate(jobs):
        by_device.setdefault(j.param.device, []).append(i)
    count = 0
    for device, indices in by_device.items():
        group = [jobs[i] for i in indices]
        key = tuple(_key(j) for j in group)
        kept = tables.kept.get(device)
        if kept is None or kept.key != key:
            kept = tables.kept[device] = _build(group, key, device)
        for i, position in enumerate(kept.order):
            outs[indices[position]] = kept.outs[i]
        if device.type == "cuda":
            with torch.cuda.device(device):  # triton launches on the current one
                count += _launch(group, kept, device, {"enable_fp_fusion": False})
        else:
            count += _launch(group, kept, device, {})
    return outs, count


def _build(jobs: list[MomentumJob], key: tuple, device: torch.device) -> _Kept:
    """The tables of ``jobs`` on ``device`` that stay while their key holds."""
    q = columns()
    # rows of one gradient dtype are contiguous: one launch each
    order = sorted(range(len(jobs)), key=lambda i: str(jobs[i].grad.dtype))
    jobs = [jobs[i] for i in order]
    sizes = [j.param.numel() for j in jobs]
    buffer = torch.empty(sum(sizes), dtype=torch.float32, device=device)
    outs = [
        chunk.view(j.param.shape)
        for chunk, j in zip(buffer.split(sizes), jobs, strict=True)
    ]
    # one device table per job, kept with the rows that hold only its address
    codebooks = [
        device_codebook(j.state["codebook"], device) if "codebook" in j.state else None
        for j in jobs
    ]
    rows = [_row(j, o, cb) for j, o, cb in zip(jobs, outs, codebooks, strict=True)]
    units = [math.ceil(r[q.J_N] / (r[q.J_UNIT] * r[q.J_BLOCK])) for r in rows]
    segments, lo = [], 0
    while lo < len(jobs):
        gdtype = jobs[lo].grad.dtype
        hi = lo
        while hi < len(jobs) and jobs[hi].grad.dtype == gdtype:
            hi += 1
        longest = max(min(r[q.J_UNIT] * r[q.J_BLOCK], r[q.J_N]) for r in rows[lo:hi])
        constexprs = {
            "TILE": pow2(longest, 16, MAX_TILE),
            "LOG_JOBS": log_jobs(hi - lo),
            "G_DTYPE": tl_dtype(gdtype),
            "EXACT": device.type == "cpu",  # the interpreter's tl.fma rounds twice
        }
        programs = sum(units[lo:hi])
        segments.append((lo, hi, programs, starts(units[lo:hi], device), constexprs))
        lo = hi
    table = torch.tensor(rows, dtype=torch.int64)
    sources = [j.state.get("codebook") for j in jobs]
    return _Kept(key, order, table, outs, segments, codebooks, sources)


def _launch(jobs, kept: _Kept, device: torch.device, opts: dict) -> int:
    """:func:`launch`'s work on one device: this step's columns of the kept
    table, the uploads, one launch per gradient dtype (``opts``: compile
    options)."""
    q = COLUMNS
    jobs = [jobs[i] for i in kept.order]
    table = kept.rows.clone()
    fill(table, q.J_GRAD, [j.grad.data_ptr() for j in jobs])
    codes_sr = [int(j.code_key is not None and "codebook" in j.state) for j in jobs]
    fill(table, q.J_CODE_SR, codes_sr)
    fill(table, q.J_CODE_KEY, [signed(j.code_key or 0) for j in jobs])
    jobs_t = upload(table, torch.int64, device)
    hyper_t = upload([_hyper(j) for j in jobs], torch.float32, device)
    for lo, hi, programs, first, constexprs in kept.segments:
        momentum_kernels.momentum_kernel[(programs,)](
            jobs_t[lo:hi], hyper_t[lo:hi], first, hi - lo, **constexprs, **opts
        )
    return len(kept.segments)


@dataclass
class MuonEntry:
    """One Muon parameter of this step: its group, state and rounding seed."""

    group: dict
    param: Tensor
    state: dict
    seed: int  # its position in the optimizer (code_rounding.code_key)


def step_on_triton(entries: list[MuonEntry], tables: MomentumTables) -> int:
    """One Muon step of every entry, in place (the caller checked
    :func:`problem`), on the caller's kept ``tables``. Returns the number of
    Triton launches."""
    jobs = []
    for e in entries:
        e.state["step"] += 1
        stochastic = stochastic_codes_of(e.group) and "codebook" in e.state
        key = code_key(e.seed, int(e.state["step"])) if stochastic else None
        jobs.append(
            job(
                e.param,
                e.param.grad,
                e.state,
                momentum=float(e.group["momentum"]),
                nesterov=e.group["nesterov"],
                code_key=key,
            )
        )
    updates, launches = launch(jobs, tables)
    for e, update in zip(entries, updates, strict=True):
        group = e.group
        muon_update(
            e.param,
            update,
            lr=float(group["lr"]),
            weight_decay=float(group["weight_decay"]),
            ns_coefficients=group["ns_coefficients"],
            ns_steps=group["ns_steps"],
            eps=float(group["eps"]),
            adjust_lr_fn=group["adjust_lr_fn"],
            ns_dtype=group["ns_dtype"] or default_ns_dtype(e.param.device),
        )
    return launches
