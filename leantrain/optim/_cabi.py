"""The C kernel's ABI: ctypes mirrors of its structs, one job per parameter, the launch.

``_kernels/gefen_step.c`` takes an array of ``lt_job`` (one parameter's tensors,
layout and per-step scalars) and steps them all in one parallel region
(``lt_gefen_step_many``). The structs here must match the C ones field for field;
:func:`checked_library` compares their sizes with the library's before the first
call, so a stale or foreign build never receives our pointers.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from ._quant_table import QuantTable, quant_table
from ._state_layout import packed_codes


class _Hyper(ctypes.Structure):
    # Same order and types as lt_hyper in gefen_step.c.
    _fields_ = [
        (name, ctypes.c_float)
        for name in (
            "w1",
            "beta2",
            "omb2",
            "decay",
            "step_size",
            "sqrt_bc2",
            "eps",
            "sign",
            "max_step",
        )
    ]


class _Io(ctypes.Structure):
    # Same order and types as lt_io in gefen_step.c.
    _fields_ = [
        ("param_bf16", ctypes.c_int32),
        ("grad_bf16", ctypes.c_int32),
        ("packed", ctypes.c_int32),
        ("stochastic", ctypes.c_int32),
        ("key", ctypes.c_uint64),
        ("code_sr", ctypes.c_int32),
        ("unused", ctypes.c_int32),
        ("code_key", ctypes.c_uint64),
        ("index0", ctypes.c_int64),
    ]


class _Quantizer(ctypes.Structure):
    # Same order and types as lt_quantizer in gefen_step.c.
    _fields_ = [
        ("codebook", ctypes.c_void_p),
        ("mid", ctypes.c_void_p),
        ("first", ctypes.c_void_p),
        ("lut", ctypes.c_void_p),
        ("entry", ctypes.c_void_p),
        ("sr_entry", ctypes.c_void_p),
        ("upad", ctypes.c_void_p),
        ("ncodes", ctypes.c_int32),
        ("nuniq", ctypes.c_int32),
        ("ncell", ctypes.c_int32),
        ("steps", ctypes.c_int32),
        ("sr_steps", ctypes.c_int32),
        ("unused", ctypes.c_int32),
    ]


class _Job(ctypes.Structure):
    # Same order and types as lt_job in gefen_step.c: one parameter's step.
    _fields_ = [
        ("param", ctypes.c_void_p),
        ("grad", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("absmax", ctypes.c_void_p),
        ("codes", ctypes.c_void_p),
        ("exp_avg", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("period", ctypes.c_int64),
        ("block", ctypes.c_int64),
        ("bits", ctypes.c_int32),
        ("unused", ctypes.c_int32),
        ("q", ctypes.c_void_p),  # lt_quantizer *
        ("h", ctypes.c_void_p),  # lt_hyper *
        ("io", ctypes.c_void_p),  # lt_io *
        ("rows", ctypes.c_int64),  # > 0: a factored state (factored.py)
        ("cbar", ctypes.c_float),  # with advanced: the factors' column mean
        ("advanced", ctypes.c_int32),  # 1: factors advanced here; 0: by the kernel
        ("step", ctypes.c_void_p),  # float *: set, the kernel advances the step
        ("opts", ctypes.c_void_p),  # lt_opts *: the scalars' source, with step
        ("seed", ctypes.c_int64),  # the rounding streams' seed, with step
    ]


class Opts(ctypes.Structure):
    # Same order and types as lt_opts in gefen_job.h: a group's options, from
    # which the kernel derives the per-step scalars of jobs with a step pointer.
    _fields_ = [
        (name, ctypes.c_double)
        for name in ("lr", "beta1", "beta2", "eps", "weight_decay", "max_step")
    ] + [("maximize", ctypes.c_int64)]


# id(library) -> its largest chunk, once its struct layouts were checked
_checked: dict[int, int] = {}
# id(table) -> (table, its ctypes view); the table is held so the id stays its own
_quantizers: dict[int, tuple[QuantTable, _Quantizer]] = {}


def checked_library(lib: ctypes.CDLL) -> int:
    """The library's largest chunk, after checking (once) that its struct layouts
    are ours: a stale or foreign build must never get our pointers."""
    max_chunk = _checked.get(id(lib))
    if max_chunk is None:
        if (
            lib.lt_sizeof_quantizer() != ctypes.sizeof(_Quantizer)
            or lib.lt_sizeof_hyper() != ctypes.sizeof(_Hyper)
            or lib.lt_sizeof_io() != ctypes.sizeof(_Io)
            or lib.lt_sizeof_job() != ctypes.sizeof(_Job)
            or lib.lt_sizeof_opts() != ctypes.sizeof(Opts)
        ):
            raise RuntimeError("the native kernel's struct layouts differ from _cabi's")
        max_chunk = _checked[id(lib)] = lib.lt_max_chunk()
    return max_chunk


def _quantizer(table: QuantTable) -> _Quantizer:
    """The kernel's view of a quantizer table (built once per table)."""
    entry = _quantizers.get(id(table))
    if entry is not None and entry[0] is table:
        return entry[1]
    view = _Quantizer(
        table.codebook.data_ptr(),
        table.mid.data_ptr(),
        table.first.data_ptr(),
        table.lut.data_ptr(),
        table.entry.data_ptr(),
        table.sr_entry.data_ptr(),
        table.upad.data_ptr(),
        table.codebook.numel(),
        table.uniq.numel(),
        table.lut.numel(),
        table.steps,
        table.sr_steps,
        0,
    )
    if len(_quantizers) >= 16:  # tables are per codebook: one or two in practice
        _quantizers.clear()
    _quantizers[id(table)] = (table, view)
    return view


def static_job(
    param: Tensor, state: dict, layout: tuple[int, int, int]
) -> tuple[_Job, tuple]:
    """The fields of one parameter's job that do not change from step to step
    (state pointers, sizes, layout, quantizer), and the objects they point into,
    which the caller keeps alive with the job. :func:`c_job` fills in the rest."""
    period, block, bits = layout
    keep: tuple = ()
    quantizer = None
    if bits:  # held by the caller too: _quantizer's cache may drop it
        table = quant_table(state["codebook"])
        quantizer = _quantizer(table)
        keep = (table, quantizer)
    job = _Job(
        0,
        0,
        state["exp_avg_sq"].data_ptr(),
        state["exp_avg_absmax"].data_ptr() if bits else None,
        state["exp_avg_codes"].data_ptr() if bits else None,
        None if bits else state["exp_avg"].data_ptr(),
        param.numel(),
        period,
        block,
        bits,
        0,
        ctypes.addressof(quantizer) if quantizer is not None else None,
        None,
        None,
        int(state["factored"]) if "factored" in state else 0,
        0.0,
        0,
        None,
        None,
        0,
    )
    return job, keep


def c_job(
    param: Tensor,
    grad: Tensor,
    state: dict,
    hyper: dict[str, float] | tuple[float, ...],
    *,
    layout: tuple[int, int, int],
    stochastic: bool,
    key: int,
    interned: dict,
    code_key: int | None = None,
    index0: int = 0,
    cbar: float | Tensor | None = None,
    static: tuple[_Job, tuple] | None = None,
) -> _Job:
    """The kernel's description of one parameter's step (tensors already checked
    by ``_fused.c_problem`` and ``state_layout``). Its scalars live in ``interned``
    (one object per distinct value: parameters of a group share them), which the
    caller keeps, with the tensors, until :func:`launch` returns. ``hyper``: the
    dict of ``_fused.hyperparameters`` or its values in ``_Hyper``'s field order;
    ``static``: this parameter's :func:`static_job`, when the caller keeps one;
    ``cbar``: a factored state's column mean when the caller already advanced its
    factors (None: the kernel advances them in its first phase; a 0-dim tensor is
    read here, on the CPU, where every tensor of a kernel job lives)."""
    bits = layout[2]
    template, keep = static or static_job(param, state, layout)
    interned["static", id(template)] = (template, keep)
    io_fields = (
        param.dtype == torch.bfloat16,
        grad.dtype == torch.bfloat16,
        bits == 4 and packed_codes(param, state),
        bool(stochastic) and param.dtype == torch.bfloat16,
        key & 0xFFFFFFFFFFFFFFFF,
        code_key is not None and bits in (4, 8),
        0,
        (code_key or 0) & 0xFFFFFFFFFFFFFFFF,
        index0,
    )
    io = interned.get(("io", io_fields))
    if io is None:
        io = interned["io", io_fields] = _Io(*io_fields)
    h_fields = (
        hyper
        if isinstance(hyper, tuple)
        else tuple(hyper[name] for name, _ in _Hyper._fields_)
    )
    h = interned.get(("hyper", h_fields))
    if h is None:
        h = interned["hyper", h_fields] = _Hyper(*h_fields)
    job = _Job.from_buffer_copy(template)
    job.param = param.data_ptr()
    job.grad = grad.data_ptr()
    job.h = ctypes.addressof(h)
    job.io = ctypes.addressof(io)
    if cbar is not None:  # the caller advanced the factors; else the kernel does
        job.cbar, job.advanced = float(cbar), 1
    return job


def launch(
    lib: ctypes.CDLL, jobs, chunk: int, threads: int, check: bool = False
) -> int | None:
    """One kernel call for every job (threads share out blocks of all of them).

    ``jobs``: a list of :class:`_Job` or a ctypes array of them. With ``check`` the
    kernel's first phase also tests every gradient for NaN and infinities.

    Returns:
        None, or (with ``check``) the index of the first job whose gradient is not
        finite: then nothing was changed.

    Raises:
        MemoryError: the kernel's per-thread buffers do not fit (nothing changed).
        ValueError: the kernel rejected a job (nothing changed).
    """
    array = jobs if isinstance(jobs, ctypes.Array) else (_Job * len(jobs))(*jobs)
    rc = lib.lt_gefen_step_many(array, len(array), chunk, threads, int(check))
    if rc > 0:
        return rc - 1
    if rc == -6:  # its scratch buffers; nothing was changed
        raise MemoryError(
            f"the C kernel could not allocate {threads} x {chunk} buffers"
        )
    if rc != 0:
        raise ValueError(f"the C kernel rejected its arguments (code {rc})")
    return None
