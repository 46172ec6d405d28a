r"""The random bits and the low-precision roundings of Gefen's Triton step.

Bit for bit the C kernel's (``_kernels/gefen_io.h``) and ``precision.py``'s: the
counter-based hash of an element's global index on a 64-bit key (so a run moved
between CPU and GPU draws the same bits), and the write of an fp32 result to a
bf16 or fp16 parameter, to nearest even or stochastically (unbiased, saturating
at the largest finite value).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _fmix32(x):
    """MurmurHash3's 32-bit finalizer (precision.py, gefen_io.h)."""
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit
def _hash(i, key):
    """32 random bits of global element indices ``i`` (int64) on the 64-bit
    ``key`` (int64 bits): precision.random_bits, bit for bit."""
    k_lo = (key & 0xFFFFFFFF).to(tl.uint32)
    k_hi = ((key >> 32) & 0xFFFFFFFF).to(tl.uint32)
    lo = (i & 0xFFFFFFFF).to(tl.uint32)
    hi = ((i >> 32) & 0xFFFFFFFF).to(tl.uint32)
    return _fmix32(lo ^ k_lo ^ _fmix32(hi ^ k_hi))


@triton.jit
def _to_bf16(p, stochastic, rbits):
    """fp32 ``p`` as bf16, on the bits as gefen_io.h: nearest even (NaN stays a
    quiet NaN) or, with ``stochastic``, away from zero iff the top 16 random bits
    are below the low 16 bits of ``p`` (never to infinity)."""
    u = p.to(tl.uint32, bitcast=True)
    mag = u & 0x7FFFFFFF
    nearest = tl.where(
        mag > 0x7F800000, (u >> 16) | 0x40, (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    )
    out = nearest
    if stochastic:
        a = mag >> 16
        away = (a < 0x7F7F) & ((rbits >> 16) < (mag & 0xFFFF))
        sr = ((u >> 16) & 0x8000) | (a + away.to(tl.uint32))
        out = tl.where(mag >= 0x7F800000, nearest, sr)
    return out.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _to_fp16(p, stochastic, rbits):
    """fp32 ``p`` as fp16: nearest even, or with ``stochastic`` as below."""
    out = p.to(tl.float16)
    if stochastic:
        out = _fp16_stochastic(p, out, rbits)
    return out


@triton.jit
def _fp16_stochastic(p, nearest, rbits):
    """precision.stochastic_round to fp16, bit for bit: a = the fp16 value
    nearest ``p`` toward zero, b the next; b iff the 32 random bits are below
    floor((|p| - a) / (b - a) * 2^32), exact in fp32 (|p| - a by Sterbenz's lemma,
    b - a a power of two); saturating at the largest finite value."""
    mag = nearest.to(tl.uint16, bitcast=True).to(tl.uint32) & 0x7FFF
    ax = tl.abs(p)
    above = tl.abs(nearest.to(tl.float32)) > ax
    # at or past the largest finite value (65504, bits 0x7BFF) the result is a:
    # clamped, so no lane computes inf - inf
    a_bits = tl.minimum(tl.where(above, mag - 1, mag), 0x7BFF)
    top = a_bits >= 0x7BFF
    a = a_bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    b_bits = tl.minimum(a_bits + 1, 0x7BFF)
    b = b_bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    frac = tl.math.div_rn(ax - a, tl.where(top, 1.0, b - a))
    threshold = tl.where(top, 0.0, frac * 4294967296.0).to(tl.int64)
    away = rbits.to(tl.int64) < threshold
    bits = tl.where(away, a_bits + 1, a_bits) | ((p < 0).to(tl.uint32) << 15)
    out = bits.to(tl.uint16).to(tl.float16, bitcast=True)
    return tl.where(ax < float("inf"), out, nearest)  # NaN, inf: as nearest
