r"""GefenMuon's momentum on the GPU: the host side of ``_triton_momentum_kernel``.

GefenMuon's Muon side (``muon.py``) sends the parameters whose tensors
``_triton_step.serves`` (CUDA) to :func:`step_on_triton` when :func:`problem` finds
nothing the kernel does not cover (the others step through the reference
``_muon_math.muon_step``, one at a time). Each becomes a *job* (:func:`job`);
:func:`launch` steps every job's momentum at once and returns each one's
Newton–Schulz input (the exact new fp32 momentum, or the Nesterov blend), which
``_muon_math.muon_update`` then orthogonalizes and applies in torch, per
parameter, as Muon's always are. ``_muon_math.muon_momentum`` is the
reference: codes equal but for ties, the returned tensor to fp32 rounding,
stochastic codes on the same keyed bits.

**Launches per step:** one per gradient dtype among the jobs on a device (one
for a model of one dtype), whatever the number of parameters; the Newton–Schulz
iterations that follow are per parameter, as Muon's always are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import Tensor

from ._muon_math import default_ns_dtype, muon_update
from ._options import stochastic_codes_of
from ._state_layout import packed_codes
from ._triton_layout import MAX_TILE
from ._triton_step import log_jobs, signed, tl_dtype, upload
from ._triton_tables import (
    DeviceCodebook,
    columns,
    device_codebook,
    momentum_kernels,
    pow2,
)
from .code_rounding import code_key

__all__ = ["MomentumJob", "MuonEntry", "job", "launch", "problem", "step_on_triton"]

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
    """One job's row of the int64 table (the kernels' J_* columns)."""
    q = columns()
    row = [0] * q.JOB_FIELDS
    row[q.J_OUT], row[q.J_GRAD] = out.data_ptr(), j.grad.data_ptr()
    row[q.J_N] = j.param.numel()
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
    row[q.J_CODE_SR] = int(j.code_key is not None)
    row[q.J_CODE_KEY] = signed(j.code_key or 0)
    return row


def _hyper(j: MomentumJob) -> list[float]:
    """One job's fp32 scalars: 1 - momentum, the Nesterov weight (1: the output
    is m itself), the gradient's sign."""
    q = columns()
    row = [0.0] * q.N_HYPER
    row[q.H_W1] = 1 - j.momentum
    row[q.H_BLEND] = j.momentum if j.nesterov else 1.0
    row[q.H_SIGN] = 1.0
    return row


def launch(jobs: list[MomentumJob]) -> tuple[list[Tensor], int]:
    """One momentum step of every job, on the device of its tensors (CPU tensors
    run through the interpreter). Returns each job's Newton–Schulz input (fp32,
    its parameter's shape) and the number of launches: per device, one per
    gradient dtype.

    Raises:
        RuntimeError: triton is not installed.
    """
    if jobs and momentum_kernels is None:
        raise RuntimeError(
            "GefenMuon's Triton momentum needs triton: pip install triton"
        )
    outs: list[Tensor | None] = [None] * len(jobs)
    by_device: dict[torch.device, list[int]] = {}
    for i, j in enumerate(jobs):
        by_device.setdefault(j.param.device, []).append(i)
    count = 0
    for device, indices in by_device.items():
        if device.type == "cuda":
            with torch.cuda.device(device):  # triton launches on the current one
                count += _launch(
                    jobs, indices, outs, device, {"enable_fp_fusion": False}
                )
        else:
            count += _launch(jobs, indices, outs, device, {})
    return outs, count


def _launch(jobs, indices, outs, device: torch.device, opts: dict) -> int:
    """:func:`launch`'s work on one device: one buffer for every output, the
    tables, one launch per gradient dtype (``opts``: the compile options)."""
    q = columns()
    # rows of one gradient dtype are contiguous: one launch each
    indices = sorted(indices, key=lambda i: str(jobs[i].grad.dtype))
    total = sum(jobs[i].param.numel() for i in indices)
    buffer = torch.empty(total, dtype=torch.float32, device=device)
    rows, hypers, units, codebooks, offset = [], [], [], [], 0
    for i in indices:
        j, n = jobs[i], jobs[i].param.numel()
        outs[i] = buffer[offset : offset + n].view(j.param.shape)
        # kept until the launch is queued: the rows hold only the table's address
        cb = (
            device_codebook(j.state["codebook"], device)
            if "codebook" in j.state
            else None
        )
        codebooks.append(cb)
        rows.append(_row(j, outs[i], cb))
        hypers.append(_hyper(j))
        units.append(math.ceil(n / (rows[-1][q.J_UNIT] * rows[-1][q.J_BLOCK])))
        offset += n
    jobs_t = upload(rows, torch.int64, device)
    hyper_t = upload(hypers, torch.float32, device)
    count, lo = 0, 0
    while lo < len(indices):
        gdtype = jobs[indices[lo]].grad.dtype
        hi = lo
        while hi < len(indices) and jobs[indices[hi]].grad.dtype == gdtype:
            hi += 1
        longest = max(min(r[q.J_UNIT] * r[q.J_BLOCK], r[q.J_N]) for r in rows[lo:hi])
        momentum_kernels.momentum_kernel[(sum(units[lo:hi]),)](
            jobs_t[lo:hi],
            hyper_t[lo:hi],
            # each job's first program, then the total (the kernel's search table)
            upload(list(accumulate(units[lo:hi], initial=0)), torch.int64, device),
            hi - lo,
            TILE=pow2(longest, 16, MAX_TILE),
            LOG_JOBS=log_jobs(hi - lo),
            G_DTYPE=tl_dtype(gdtype),
            EXACT=device.type == "cpu",  # the interpreter's tl.fma rounds twice
            **opts,
        )
        count += 1
        lo = hi
    return count


@dataclass
class MuonEntry:
    """One Muon parameter of this step: its group, state and rounding seed."""

    group: dict
    param: Tensor
    state: dict
    seed: int  # its position in the optimizer (code_rounding.code_key)


def step_on_triton(entries: list[MuonEntry]) -> int:
    """One Muon step of every entry, in place (the caller checked
    :func:`problem`). Returns the number of Triton launches."""
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
    updates, launches = launch(jobs)
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
