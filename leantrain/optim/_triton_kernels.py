r"""Gefen's step as Triton kernels (imported only where ``triton`` is installed).

The host side, which builds the job tables and launches these, is
``_triton_step.py``; the update they compute is ``_step.reference_step``'s, op by
op as the C kernel (``_kernels/gefen_step.c``) rounds it: fp32 math, torch's lerp
and ``add_(x, alpha)`` as fused multiply-adds, ``p * decay - (step_size * m) /
denom`` without any other fused multiply-add (launched with
``enable_fp_fusion=False``), IEEE division and square root (``div_rn``,
``sqrt_rn``: Triton's plain ``/`` and ``sqrt`` are approximate on the GPU), block
sums of :math:`g^2` in float64.

**Work.** A parameter is a *job* (one row of an int64 table of pointers and sizes
and one row of fp32 per-step scalars). A program takes one *unit* of a job: one
absmax block, or two when 4-bit codes packed two per byte have an odd block
length (the byte between them is then written by one program). Programs find
their job by a binary search over the jobs' first unit indices, so one launch
covers every parameter of a (parameter dtype, gradient dtype) pair. A unit no
longer than ``TILE`` is done in one pass in registers; a longer one in two (the
statistics, then the codes and the update, recomputing the momentum).

**Factored second moments** need the whole gradient's column means before any
element's update: three small launches before this one advance the factors and
leave each row's ``a`` and each column's ``b`` in scratch
(``_triton_factored.py``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._triton_rounding import _hash, _to_bf16, _to_fp16

# Kernels may read module globals only as constexpr (ints to the host side).
_c = tl.constexpr

# Columns of the job tables (_triton_step builds them in this order).
J_PARAM = _c(0)
J_GRAD = _c(1)
J_V = _c(2)
J_M = _c(3)
J_ABSMAX = _c(4)
J_QTAB = _c(5)
J_N = _c(6)
J_BLOCK = _c(7)
J_UNIT = _c(8)
J_BITS = _c(9)
J_PACKED = _c(10)
J_VKIND = _c(11)
J_COLS = _c(12)
J_A = _c(13)
J_B = _c(14)
J_INDEX0 = _c(15)
J_CODE_KEY = _c(16)
J_ROUND_KEY = _c(17)
J_CODE_SR = _c(18)
J_PARAM_SR = _c(19)
J_NUNIQ = _c(20)
J_ZERO = _c(21)
JOB_FIELDS = _c(22)
# The per-step fp32 scalars of a job, as _fused.hyperparameters names them
# (N_HYPER of them).
HYPER_FIELDS = (
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
N_HYPER = _c(len(HYPER_FIELDS))
# Second-moment kinds (J_VKIND).
V_BLOCKS = _c(0)
V_ELEMENT = _c(1)
V_FACTORED = _c(2)
# The quantizer table of one codebook, fp32, every part padded to 256 entries:
# codebook | midpoints (+inf) | u_1.. (+inf) | u_0.. (+inf, 257) | first code of u_k.
Q_CB = _c(0)
Q_MID = _c(256)
Q_UP = _c(512)
Q_UNIQ = _c(768)
Q_FIRST = _c(1025)
Q_SIZE = _c(1281)


@triton.jit
def _fma(a, b, c, EXACT: tl.constexpr):
    """fl(a * b + c), one rounding. The interpreter's tl.fma rounds twice (numpy's
    fp32 a * b + c), so there it is done in float64, where the fp32 product is
    exact (then a second rounding differs from fma's only at a double-rounding
    tie, ~2^-29 of the time)."""
    if EXACT:
        out = (a.to(tl.float64) * b.to(tl.float64) + c.to(tl.float64)).to(tl.float32)
    else:
        out = tl.fma(a, b, c)
    return out


@triton.jit
def _count(table, x, skip, OR_EQUAL: tl.constexpr):
    """#{j : table[j] < x} (``<=`` with OR_EQUAL) over 256 ascending fp32 entries
    whose last is +inf: a branch-free binary search of 8 probes, the first
    ``skip`` left out (4 for a 4-bit table: its entries past 15 are +inf, so
    those probes never hit)."""
    pos = tl.zeros(x.shape, dtype=tl.int32)
    for j in tl.static_range(8):
        if j >= skip:
            probe = tl.load(table + pos + ((128 >> j) - 1))
            if OR_EQUAL:
                hit = probe <= x
            else:
                hit = probe < x
            pos = tl.where(hit, pos + (128 >> j), pos)
    return pos


@triton.jit
def _find_job(starts, pid, njobs, LOG_JOBS: tl.constexpr):
    """The job j with starts[j] <= pid < starts[j + 1] (a scalar binary search)."""
    lo = 0
    for j in tl.static_range(LOG_JOBS):
        probe = lo + (1 << (LOG_JOBS - 1 - j))
        ok = probe < njobs
        start = tl.load(starts + tl.where(ok, probe, 0))
        lo = tl.where(ok & (start <= pid), probe, lo)
    return lo


@triton.jit
def _momentum(job, hyp, e, ok, amax_old, EXACT: tl.constexpr, G_DTYPE: tl.constexpr):
    """(g, m) of elements ``e`` (lanes ``ok``): the gradient in fp32 and the new
    momentum lerp(old m, sign * g, 1 - beta1) as torch's lerp rounds it."""
    grad = tl.load(job + J_GRAD).to(tl.pointer_type(G_DTYPE), bitcast=True)
    g = tl.load(grad + e, mask=ok, other=0.0).to(tl.float32)
    bits = tl.load(job + J_BITS)
    mptr = tl.load(job + J_M)
    if bits == 0:
        old = tl.load(
            mptr.to(tl.pointer_type(tl.float32), bitcast=True) + e, mask=ok, other=0.0
        )
    else:
        codes = mptr.to(tl.pointer_type(tl.uint8), bitcast=True)
        if tl.load(job + J_PACKED) != 0:
            byte = tl.load(codes + (e >> 1), mask=ok, other=0).to(tl.int32)
            code = (byte >> ((e & 1) * 4).to(tl.int32)) & 15
        else:
            code = tl.load(codes + e, mask=ok, other=0).to(tl.int32)
        qtab = tl.load(job + J_QTAB).to(tl.pointer_type(tl.float32), bitcast=True)
        old = tl.load(qtab + Q_CB + code, mask=ok, other=0.0) * amax_old
    w1 = tl.load(hyp + 0)
    gk = g * tl.load(hyp + 7)
    # torch's lerp: fma(w, b - a, a) for w < 0.5, else fma(w - 1, b - a, b)
    small = w1 < 0.5
    wc = tl.where(small, w1, w1 - 1.0)
    m = _fma(wc, gk - old, tl.where(small, old, gk), EXACT)
    return g, m


@triton.jit
def _store_momentum(job, e, ok, m, amax, origin, TILE: tl.constexpr):
    """Stores the codes of the new momentum ``m`` of elements ``e`` in blocks of
    absmax ``amax`` (nearest or stochastic codes), or ``m`` itself in fp32."""
    bits = tl.load(job + J_BITS)
    mptr = tl.load(job + J_M)
    if bits == 0:
        tl.store(mptr.to(tl.pointer_type(tl.float32), bitcast=True) + e, m, mask=ok)
    else:
        qtab = tl.load(job + J_QTAB).to(tl.pointer_type(tl.float32), bitcast=True)
        live = amax > 0.0
        x = tl.where(live, tl.math.div_rn(m, tl.where(live, amax, 1.0)), 0.0)
        skip = tl.where(bits == 4, 4, 0)
        if tl.load(job + J_CODE_SR) == 0:
            k = _count(qtab + Q_MID, x, skip, False)  # nearest: #{mid_j < x}
        else:
            # code_rounding.searched_index: x's interval i, then up with
            # probability (x - u_i) / d_i, decided by 24 bits of the code hash
            key = tl.load(job + J_CODE_KEY)
            bits24 = _hash(e + tl.load(job + J_INDEX0), key) >> 8
            r = bits24.to(tl.float32) * 5.9604644775390625e-08  # 2**-24
            nuniq = tl.load(job + J_NUNIQ).to(tl.int32)
            below = _count(qtab + Q_UP, x, skip, True)
            i = tl.minimum(below, nuniq - 2)
            u_i = tl.load(qtab + Q_UNIQ + i, mask=ok, other=0.0)
            u_up = tl.load(qtab + Q_UNIQ + i + 1, mask=ok, other=0.0)
            up = (below < nuniq - 1) & ((x - u_i) > (r * (u_up - u_i)))
            # an all-zero block keeps the code nearest 0, as nearest rounding does
            zero = tl.load(job + J_ZERO).to(tl.int32)
            k = tl.where(live, below + up.to(tl.int32), zero)
        code = tl.load(qtab + Q_FIRST + k, mask=ok, other=0.0).to(tl.int32)
        codes = mptr.to(tl.pointer_type(tl.uint8), bitcast=True)
        if tl.load(job + J_PACKED) != 0:
            # two codes a byte, element 2i low: the tile starts on an even element
            # and ends on one or the tensor's end (whose high nibble stays 0)
            code = tl.where(ok, code, 0)
            pairs = tl.reshape(code, (TILE // 2, 2))
            byte = tl.sum(pairs << (tl.arange(0, 2) * 4)[None, :], axis=1)
            first = tl.reshape(ok.to(tl.int32), (TILE // 2, 2))
            written = tl.max(first, axis=1) > 0
            where = (origin >> 1) + tl.arange(0, TILE // 2)
            tl.store(codes + where, byte.to(tl.uint8), mask=written)
        else:
            tl.store(codes + e, code.to(tl.uint8), mask=ok)


@triton.jit
def _finish(
    job, hyp, e, ok, m, amax, den, origin, TILE: tl.constexpr, P_DTYPE: tl.constexpr
):
    """Stores the codes (or the fp32 momentum) of elements ``e`` and updates
    the parameter with the exact new ``m`` over ``den``."""
    _store_momentum(job, e, ok, m, amax, origin, TILE)
    param = tl.load(job + J_PARAM).to(tl.pointer_type(P_DTYPE), bitcast=True)
    p = tl.load(param + e, mask=ok, other=0.0).to(tl.float32)
    w = p * tl.load(hyp + 3)
    step = tl.math.div_rn(tl.load(hyp + 4) * m, den)
    bound = tl.load(hyp + 8)  # inf without update_clip; NaN goes through
    step = tl.where(bound < step, bound, step)
    step = tl.where(-bound > step, -bound, step)
    p = w - step
    if P_DTYPE == tl.float32:
        tl.store(param + e, p, mask=ok)
    else:  # rounded to nearest, or stochastically (precision.py's bits)
        sr = tl.load(job + J_PARAM_SR) != 0
        rbits = tl.zeros(e.shape, dtype=tl.uint32)
        if sr:
            rbits = _hash(e + tl.load(job + J_INDEX0), tl.load(job + J_ROUND_KEY))
        if P_DTYPE == tl.bfloat16:
            tl.store(param + e, _to_bf16(p, sr, rbits), mask=ok)
        else:
            tl.store(param + e, _to_fp16(p, sr, rbits), mask=ok)


@triton.jit
def _den(job, hyp, e, ok, origin, in_a, den_a, den_b):
    """The update's denominators of elements ``e``: their block's, their own
    ``sqrt(v) / sqrt(bc2) + eps``, or a factored ``a[i] * b[j] + eps``."""
    vkind = tl.load(job + J_VKIND)
    sqrt_bc2 = tl.load(hyp + 5)
    eps = tl.load(hyp + 6)
    den = tl.where(in_a, den_a, den_b)
    if vkind == V_ELEMENT:
        vptr = tl.load(job + J_V).to(tl.pointer_type(tl.float32), bitcast=True)
        v = tl.load(vptr + e, mask=ok, other=1.0)
        den = tl.math.div_rn(tl.sqrt_rn(v), sqrt_bc2) + eps
    elif vkind == V_FACTORED:
        # row and column of each element, in int32 from the tile's first one
        # (a 64-bit division per element costs more than the rest of the den)
        cols = tl.load(job + J_COLS)
        row0 = origin // cols
        col = (origin % cols).to(tl.int32) + (e - origin).to(tl.int32)
        cols32 = cols.to(tl.int32)
        a = tl.load(job + J_A).to(tl.pointer_type(tl.float32), bitcast=True)
        b = tl.load(job + J_B).to(tl.pointer_type(tl.float32), bitcast=True)
        ai = tl.load(a + row0 + col // cols32, mask=ok, other=1.0)
        bj = tl.load(b + col % cols32, mask=ok, other=1.0)
        den = ai * bj + eps
    return den


@triton.jit
def _element_v(job, hyp, e, ok, g, EXACT: tl.constexpr):
    """A per-element second moment: v = fma(1 - beta2, g * g, v * beta2)."""
    if tl.load(job + J_VKIND) == V_ELEMENT:
        vptr = tl.load(job + J_V).to(tl.pointer_type(tl.float32), bitcast=True)
        v = tl.load(vptr + e, mask=ok, other=0.0)
        v = _fma(tl.load(hyp + 2), g * g, v * tl.load(hyp + 1), EXACT)
        tl.store(vptr + e, v, mask=ok)


@triton.jit
def _block_den(job, hyp, block_index, old, total, length, EXACT: tl.constexpr):
    """Advances a block's v (``old``, read before the program's first barrier)
    from its sum of g^2 (float64) and returns its denominator
    sqrt(v) / sqrt(bc2) + eps (1.0 for other kinds)."""
    blocks = tl.load(job + J_VKIND) == V_BLOCKS
    vptr = tl.load(job + J_V).to(tl.pointer_type(tl.float32), bitcast=True)
    mean = (total / length.to(tl.float64)).to(tl.float32)
    v = _fma(tl.load(hyp + 2), mean, old * tl.load(hyp + 1), EXACT)
    tl.store(vptr + block_index, v, mask=blocks)
    den = tl.math.div_rn(tl.sqrt_rn(v), tl.load(hyp + 5)) + tl.load(hyp + 6)
    return tl.where(blocks, den, 1.0)


@triton.jit
def _stats(g, m, ok, in_a):
    """A tile's float64 sums of g^2 and max |m| over the unit's blocks a and b."""
    g2 = tl.where(ok, g * g, 0.0).to(tl.float64)
    am = tl.where(ok, tl.abs(m), 0.0)
    return (
        tl.sum(tl.where(in_a, g2, 0.0)),
        tl.sum(tl.where(in_a, 0.0, g2)),
        tl.max(tl.where(in_a, am, 0.0)),
        tl.max(tl.where(in_a, 0.0, am)),
    )


@triton.jit
def _close_blocks(
    job,
    hyp,
    b_a,
    b_b,
    has_b,
    v_a,
    v_b,
    sum_a,
    sum_b,
    amax_a,
    amax_b,
    len_a,
    len_b,
    EXACT: tl.constexpr,
):
    """After a unit's statistics: its blocks' v and absmax stored (after a barrier:
    every warp has read the old ones) and their denominators returned."""
    tl.debug_barrier()
    den_a = _block_den(job, hyp, b_a, v_a, sum_a, len_a, EXACT)
    den_b = den_a
    if has_b:
        den_b = _block_den(job, hyp, b_b, v_b, sum_b, len_b, EXACT)
    if tl.load(job + J_BITS) != 0:
        absmax = tl.load(job + J_ABSMAX).to(tl.pointer_type(tl.float32), bitcast=True)
        tl.store(absmax + b_a, amax_a)
        if has_b:
            tl.store(absmax + b_b, amax_b)
    return den_a, den_b


@triton.jit
def gefen_step_kernel(
    jobs,
    hypers,
    starts,
    njobs,
    TILE: tl.constexpr,
    LOG_JOBS: tl.constexpr,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    EXACT: tl.constexpr,
):
    """One Gefen step of one unit (one or two absmax blocks) of one job."""
    pid = tl.program_id(0).to(tl.int64)
    j = _find_job(starts, pid, njobs, LOG_JOBS)
    job = jobs + j * JOB_FIELDS
    hyp = hypers + j * N_HYPER
    n = tl.load(job + J_N)
    block = tl.load(job + J_BLOCK)
    unit = tl.load(job + J_UNIT)
    bits = tl.load(job + J_BITS)
    u = pid - tl.load(starts + j)
    b_a = u * unit  # the unit's first block; b_b the second (if any)
    ustart = b_a * block
    uend = tl.minimum(ustart + unit * block, n)
    split = tl.minimum(ustart + block, uend)  # where block b_b begins
    has_b = split < uend
    b_b = tl.where(has_b, b_a + 1, b_a)
    absmax = tl.load(job + J_ABSMAX).to(tl.pointer_type(tl.float32), bitcast=True)
    # Every warp reads the unit's scalars of state (old absmax, a block's v)
    # here, before the barrier that precedes their stores: no warp may read a
    # value another has already replaced.
    quantized = bits != 0
    old_a = tl.load(absmax + b_a, mask=quantized, other=0.0)
    old_b = tl.load(absmax + b_b, mask=quantized, other=0.0)
    blocks = tl.load(job + J_VKIND) == V_BLOCKS
    vptr = tl.load(job + J_V).to(tl.pointer_type(tl.float32), bitcast=True)
    v_a = tl.load(vptr + b_a, mask=blocks, other=0.0)
    v_b = tl.load(vptr + b_b, mask=blocks, other=0.0)
    lanes = tl.arange(0, TILE).to(tl.int64)
    if uend - ustart <= TILE:  # one pass, the momentum in registers
        e = ustart + lanes
        ok = e < uend
        in_a = e < split
        g, m = _momentum(job, hyp, e, ok, tl.where(in_a, old_a, old_b), EXACT, G_DTYPE)
        _element_v(job, hyp, e, ok, g, EXACT)
        sum_a, sum_b, amax_a, amax_b = _stats(g, m, ok, in_a)
        den_a, den_b = _close_blocks(
            job,
            hyp,
            b_a,
            b_b,
            has_b,
            v_a,
            v_b,
            sum_a,
            sum_b,
            amax_a,
            amax_b,
            split - ustart,
            uend - split,
            EXACT,
        )
        den = _den(job, hyp, e, ok, ustart, in_a, den_a, den_b)
        amax = tl.where(in_a, amax_a, amax_b)
        _finish(job, hyp, e, ok, m, amax, den, ustart, TILE, P_DTYPE)
    else:  # pass 1: statistics; pass 2: codes and update, m recomputed
        sum_a = tl.zeros((), dtype=tl.float64)
        sum_b = tl.zeros((), dtype=tl.float64)
        amax_a = tl.zeros((), dtype=tl.float32)
        amax_b = tl.zeros((), dtype=tl.float32)
        origin = ustart
        while origin < uend:
            e = origin + lanes
            ok = e < uend
            in_a = e < split
            old = tl.where(in_a, old_a, old_b)
            g, m = _momentum(job, hyp, e, ok, old, EXACT, G_DTYPE)
            _element_v(job, hyp, e, ok, g, EXACT)
            s_a, s_b, m_a, m_b = _stats(g, m, ok, in_a)
            sum_a += s_a
            sum_b += s_b
            amax_a = tl.maximum(amax_a, m_a)
            amax_b = tl.maximum(amax_b, m_b)
            origin += TILE
        den_a, den_b = _close_blocks(
            job,
            hyp,
            b_a,
            b_b,
            has_b,
            v_a,
            v_b,
            sum_a,
            sum_b,
            amax_a,
            amax_b,
            split - ustart,
            uend - split,
            EXACT,
        )
        origin = ustart
        while origin < uend:
            e = origin + lanes
            ok = e < uend
            in_a = e < split
            old = tl.where(in_a, old_a, old_b)
            g, m = _momentum(job, hyp, e, ok, old, EXACT, G_DTYPE)
            den = _den(job, hyp, e, ok, origin, in_a, den_a, den_b)
            amax = tl.where(in_a, amax_a, amax_b)
            _finish(job, hyp, e, ok, m, amax, den, origin, TILE, P_DTYPE)
            origin += TILE
