r"""Gefen's CUDA step: Triton kernels over tables of parameters (the host side).

The dispatch (``_fused.implementation``, for ``_dispatch.step_many`` and
``_fused.fused_step``) sends CUDA tensors here when :func:`problem` finds nothing
the kernels do not cover; the kernels (``_triton_kernels.py``) compute
``_step.reference_step``'s update with the C kernel's roundings and the same
counter-based random bits, so a run moved between CPU and GPU continues on the
same stream. Like the C kernel's ``_cabi``, this module turns each parameter into
a *job* (:func:`job`: pointers, sizes, per-step scalars and keys) and steps a list
of jobs at once (:func:`launch`). What a steady step runs is here; what is built
once per set of jobs is in ``_triton_layout`` (the kept job tables, segments and
factored scratch) and ``_triton_tables`` (the kernels' columns, the codebooks'
device tables, the search tables). GefenMuon's momentum takes its own kernel
through ``_triton_momentum`` (one launch per gradient dtype).

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

import warnings

import torch
from torch import Tensor

from ._triton_layout import FACTOR_ROWS, Job, Layout, Tables, build_layout
from ._triton_tables import COLUMNS, factored_kernels, kernels, triton

__all__ = [
    "Job",
    "Tables",
    "available",
    "grad_fits",
    "job",
    "launch",
    "problem",
    "serves",
    "upload",
    "warn_fallback",
]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def available() -> bool:
    """Whether ``triton`` is importable (the kernels can run)."""
    return kernels is not None


def serves(device: torch.device) -> bool:
    """Whether Gefen's step sends tensors on ``device`` here (CUDA; the CPU has
    the C kernel)."""
    return device.type == "cuda"


def interpreting() -> bool:
    """Whether Triton runs kernels through its interpreter (``TRITON_INTERPRET=1``
    before triton was first imported): then they take CPU tensors."""
    return kernels is not None and bool(triton.knobs.runtime.interpret)


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
    if kernels is None:
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


def upload(rows: list | Tensor, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A table built on the host, on ``device`` without waiting for it (pinned:
    the copy is asynchronous, and the pinned block is not reused before it ran)."""
    table = rows if isinstance(rows, Tensor) else torch.tensor(rows, dtype=dtype)
    if device.type == "cuda":
        return table.pin_memory().to(device, non_blocking=True)
    return table


def signed(key: int) -> int:
    """A 64-bit key as the int64 with its bits."""
    return key - (1 << 64) if key >= 1 << 63 else key


def fill(table: Tensor, column: int, values: list[int]) -> None:
    table[:, column] = torch.tensor(values, dtype=torch.int64)


def log_jobs(count: int) -> int:
    """Probes of the kernels' binary search over ``count`` jobs."""
    return max(1, (count - 1).bit_length())


def tl_dtype(dtype: torch.dtype):
    """Triton's name of a parameter or gradient dtype (fp32, bf16, fp16)."""
    import triton.language as tl

    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16}.get(
        dtype, tl.float16
    )


def launch(jobs: list[Job], tables: Tables | None = None) -> int:
    """One Gefen step of every job, on the device of its tensors (CPU tensors run
    through the interpreter). Returns the number of kernel launches: per device,
    one per (gradient dtype, parameter dtype) pair, plus three with factored jobs.
    ``tables``: the tables of the previous launch of the same jobs (filled here
    on first use); None builds them for this launch only.

    Raises:
        RuntimeError: triton is not installed.
    """
    if jobs and kernels is None:
        raise RuntimeError("Gefen's Triton step needs triton: pip install triton")
    by_device: dict[torch.device, list[Job]] = {}
    for j in jobs:
        by_device.setdefault(j.param.device, []).append(j)
    count = 0
    for device, group in by_device.items():
        layout = tables.layouts.get(device) if tables is not None else None
        if layout is None:
            layout = build_layout(group, device)
            if tables is not None:
                tables.layouts[device] = layout
        if device.type == "cuda":
            with torch.cuda.device(device):  # triton launches on the current one
                count += _launch(group, layout, device, {"enable_fp_fusion": False})
        else:
            count += _launch(group, layout, device, {})
    return count


def _launch(jobs: list[Job], layout: Layout, device: torch.device, opts: dict) -> int:
    """:func:`launch`'s work on one device: this step's columns of the kept
    tables, the uploads, the kernels (``opts``: their compile options)."""
    k, q = kernels, COLUMNS
    exact = device.type == "cpu"  # the interpreter's tl.fma rounds twice
    jobs = [jobs[i] for i in layout.order]
    table = layout.table.clone()
    fill(table, q.J_GRAD, [j.grad.data_ptr() for j in jobs])
    fill(table, q.J_CODE_KEY, [signed(j.code_key or 0) for j in jobs])
    fill(table, q.J_ROUND_KEY, [signed(j.key) for j in jobs])
    hypers = [[j.hyper[f] for f in k.HYPER_FIELDS] for j in jobs]
    jobs_t = upload(table, torch.int64, device)
    hyper_t = upload(hypers, torch.float32, device)
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
            LOG_JOBS=log_jobs(seg.hi - seg.lo),
            P_DTYPE=tl_dtype(seg.pair[1]),
            G_DTYPE=tl_dtype(seg.pair[0]),
            EXACT=exact,
            **opts,
        )
        count += 1
    return count


def _launch_factored(jobs, layout: Layout, hyper_t, device, opts) -> int:
    """The three launches that advance the factored jobs' factors and leave this
    step's ``a`` and ``b`` in scratch; returns 3 (the row sums go once per
    gradient dtype, so more with mixed gradient dtypes)."""
    k = COLUMNS
    factored, cols_tile = layout.factored, layout.cols_tile
    rows_segments, (col_programs, col_starts), rows_tile, a_grid = (
        layout.factor_launches
    )
    f_table = layout.factor_table.clone()
    fill(f_table, k.F_GRAD, [jobs[f.slot].grad.data_ptr() for f in factored])
    f_t = upload(f_table, torch.int64, device)
    count = 0
    for lo, hi, gdtype, programs, starts in rows_segments:
        factored_kernels.factor_rows_kernel[(programs,)](
            f_t[lo:hi],
            starts,
            hi - lo,
            ROWS=FACTOR_ROWS,
            COLS=cols_tile,
            LOG_JOBS=log_jobs(hi - lo),
            G_DTYPE=tl_dtype(gdtype),
            **opts,
        )
        count += 1
    nf, log = len(factored), log_jobs(len(factored))
    factored_kernels.factor_cols_kernel[(col_programs,)](
        f_t,
        hyper_t,
        col_starts,
        nf,
        COLS=cols_tile,
        LOG_JOBS=log,
        EXACT=device.type == "cpu",
        **opts,
    )
    factored_kernels.factor_a_kernel[(a_grid[0],)](
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
