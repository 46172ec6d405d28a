r"""GefenMuon's momentum as a Triton kernel: Gefen's first-moment update alone.

Muon keeps no second moment and orthogonalizes the whole momentum matrix before
any element of the parameter moves (Newton–Schulz, in torch), so its kernel is
Gefen's step (``_triton_kernels.gefen_step_kernel``) cut after the momentum: per
unit of one or two absmax blocks, de-quantize the old codes, ``m = lerp(m, g, 1 -
momentum)`` as torch's lerp rounds it, the blocks' new absmax, the new codes
(nearest, or stochastic on the same counter-based bits as the C kernel and
``code_rounding.round_blocks``), and the exact new fp32 ``m`` written to an output
buffer, or with Nesterov the blend ``lerp(g, m, momentum)``
(``_muon_math.muon_momentum`` is the reference). No second moment, no parameter
update. The job rows are Gefen's (``J_*``), but for :data:`J_OUT`; the host side is
``_triton_momentum.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._triton_kernels import (
    J_ABSMAX,
    J_BITS,
    J_BLOCK,
    J_N,
    J_PARAM,
    J_UNIT,
    JOB_FIELDS,
    N_HYPER,
    _c,
    _find_job,
    _fma,
    _momentum,
    _store_momentum,
)

# A momentum job has no parameter: the parameter's column holds the address of
# its fp32 output (the new momentum, or the Nesterov blend).
J_OUT = _c(J_PARAM.value)
# Its per-step scalars sit where _momentum reads Gefen's (w1 = 1 - momentum at 0,
# the gradient's sign at 7); the Nesterov weight takes the unused beta2 slot.
H_W1 = _c(0)
H_BLEND = _c(1)
H_SIGN = _c(7)


@triton.jit
def _store_out(job, hyp, e, ok, g, m, EXACT: tl.constexpr):
    """Writes lerp(g, m, blend) (torch's lerp rounding) to the job's output: the
    Nesterov blend, or with blend 1 exactly ``m`` (fma(0, m - g, m))."""
    blend = tl.load(hyp + H_BLEND)
    small = blend < 0.5
    wc = tl.where(small, blend, blend - 1.0)
    out = _fma(wc, m - g, tl.where(small, g, m), EXACT)
    ptr = tl.load(job + J_OUT).to(tl.pointer_type(tl.float32), bitcast=True)
    tl.store(ptr + e, out, mask=ok)


@triton.jit
def _block_max(m, ok, in_a):
    """max |m| of a tile over the unit's blocks a and b."""
    am = tl.where(ok, tl.abs(m), 0.0)
    return tl.max(tl.where(in_a, am, 0.0)), tl.max(tl.where(in_a, 0.0, am))


@triton.jit
def _store_absmax(job, b_a, b_b, has_b, amax_a, amax_b):
    """The unit's new absmax, after a barrier: every warp has read the old ones."""
    tl.debug_barrier()
    if tl.load(job + J_BITS) != 0:
        absmax = tl.load(job + J_ABSMAX).to(tl.pointer_type(tl.float32), bitcast=True)
        tl.store(absmax + b_a, amax_a)
        if has_b:
            tl.store(absmax + b_b, amax_b)


@triton.jit
def momentum_kernel(
    jobs,
    hypers,
    starts,
    njobs,
    TILE: tl.constexpr,
    LOG_JOBS: tl.constexpr,
    G_DTYPE: tl.constexpr,
    EXACT: tl.constexpr,
):
    """One momentum step of one unit (one or two absmax blocks) of one job."""
    pid = tl.program_id(0).to(tl.int64)
    j = _find_job(starts, pid, njobs, LOG_JOBS)
    job = jobs + j * JOB_FIELDS
    hyp = hypers + j * N_HYPER
    n = tl.load(job + J_N)
    block = tl.load(job + J_BLOCK)
    unit = tl.load(job + J_UNIT)
    b_a = (pid - tl.load(starts + j)) * unit  # the unit's first block
    ustart = b_a * block
    uend = tl.minimum(ustart + unit * block, n)
    split = tl.minimum(ustart + block, uend)  # where block b_b begins
    has_b = split < uend
    b_b = tl.where(has_b, b_a + 1, b_a)
    absmax = tl.load(job + J_ABSMAX).to(tl.pointer_type(tl.float32), bitcast=True)
    quantized = tl.load(job + J_BITS) != 0
    old_a = tl.load(absmax + b_a, mask=quantized, other=0.0)
    old_b = tl.load(absmax + b_b, mask=quantized, other=0.0)
    lanes = tl.arange(0, TILE).to(tl.int64)
    if uend - ustart <= TILE:  # one pass, the momentum in registers
        e = ustart + lanes
        ok = e < uend
        in_a = e < split
        g, m = _momentum(job, hyp, e, ok, tl.where(in_a, old_a, old_b), EXACT, G_DTYPE)
        amax_a, amax_b = _block_max(m, ok, in_a)
        _store_absmax(job, b_a, b_b, has_b, amax_a, amax_b)
        amax = tl.where(in_a, amax_a, amax_b)
        _store_momentum(job, e, ok, m, amax, ustart, TILE)
        _store_out(job, hyp, e, ok, g, m, EXACT)
    else:  # pass 1: the absmax; pass 2: codes and output, m recomputed
        amax_a = tl.zeros((), dtype=tl.float32)
        amax_b = tl.zeros((), dtype=tl.float32)
        origin = ustart
        while origin < uend:
            e = origin + lanes
            ok = e < uend
            in_a = e < split
            old = tl.where(in_a, old_a, old_b)
            g, m = _momentum(job, hyp, e, ok, old, EXACT, G_DTYPE)
            m_a, m_b = _block_max(m, ok, in_a)
            amax_a = tl.maximum(amax_a, m_a)
            amax_b = tl.maximum(amax_b, m_b)
            origin += TILE
        _store_absmax(job, b_a, b_b, has_b, amax_a, amax_b)
        origin = ustart
        while origin < uend:
            e = origin + lanes
            ok = e < uend
            in_a = e < split
            old = tl.where(in_a, old_a, old_b)
            g, m = _momentum(job, hyp, e, ok, old, EXACT, G_DTYPE)
            amax = tl.where(in_a, amax_a, amax_b)
            _store_momentum(job, e, ok, m, amax, origin, TILE)
            _store_out(job, hyp, e, ok, g, m, EXACT)
            origin += TILE
