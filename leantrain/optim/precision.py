r"""Writing an fp32 result back to a bf16 or fp16 parameter: nearest or stochastic.

Gefen does all its math in fp32, whatever the parameter's dtype; only the final
write of the updated parameter rounds. Round-to-nearest loses every update smaller
than half a unit in the last place (ulp): a bf16 weight near 1 has an ulp of
:math:`2^{-7}`, so AdamW steps of ``lr = 1e-4`` vanish. **Stochastic rounding** rounds
to one of the two neighbouring representable values with the probabilities that
make the result unbiased, :math:`E[\mathrm{sr}(x)] = x`, so small updates survive on
average.

**The rule.** For a finite fp32 ``x`` let ``a`` be the value of ``dtype`` nearest
``x`` toward zero and ``b`` the next one away from zero (``a == x`` when ``x`` is
representable). The result is ``b`` with probability
:math:`f = (|x| - |a|) / (|b| - |a|)` and ``a`` otherwise, decided by 32 random bits
``r``: ``b`` iff :math:`r < \lfloor f \cdot 2^{32} \rfloor`. ``f`` is computed exactly
(the differences are exact in float64 and ``|b| - |a|`` is a power of two), so the C
kernel and this module give the same bits. When ``b`` would be infinite the result is
``a`` (the largest finite value: stochastic rounding saturates rather than
overflows). NaN and infinities are converted as by ``Tensor.to``.

**The random bits** come from a counter-based hash, not a stateful generator: the
bits of element ``i`` (the row-major flat index in the parameter) are
``hash32(i, key)``, MurmurHash3's 32-bit finalizer of the low words, mixed with
the same finalizer of the high words (:func:`random_bits`), with a 64-bit ``key``
that :func:`rounding_key` derives from a per-parameter ``seed`` and the optimizer
step. They depend on nothing else: not on
threads, chunking, device or what ran before, so a run resumed from a checkpoint
(which holds ``step``) draws the same bits and continues bit-exactly.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "default_stochastic",
    "random_bits",
    "round_to",
    "rounding_key",
    "stochastic_round",
]

_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF
# magnitude bits of the largest finite value, per dtype (the sign bit is separate)
_MAX_FINITE_BITS = {torch.bfloat16: 0x7F7F, torch.float16: 0x7BFF}
LOW_PRECISION = (torch.bfloat16, torch.float16)


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def rounding_key(seed: int, step: int) -> int:
    """The 64-bit key of one parameter's rounding at one step.

    Args:
        seed: any int identifying the parameter (and the run), e.g. a base seed plus
            the parameter's index in the optimizer.
        step: the optimizer step (the state's ``step`` after its increment).
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int, got {type(step).__name__} {step!r}")
    return _splitmix64(_splitmix64(seed & _M64) ^ (step & _M64))


def _mul32(x: Tensor, c: int) -> Tensor:
    """x * c mod 2**32 for int64 tensors holding uint32 values, without overflow:
    the constant is split into 16-bit halves so every product stays below 2**48."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _fmix32(x: Tensor) -> Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def random_bits(key: int, start: int, count: int, device=None) -> Tensor:
    """32 random bits (as int64 in [0, 2**32)) for elements start .. start+count-1.

    ``hash32(i, key) = fmix32(lo32(i) ^ lo32(key) ^ fmix32(hi32(i) ^ hi32(key)))``
    with MurmurHash3's finalizer ``fmix32``; the C kernel computes the same. Why
    this shape: the inner round is the same for all elements of a tensor below
    2**32 elements, so the kernel pays one round per element, not two.
    """
    i = torch.arange(start, start + count, dtype=torch.int64, device=device)
    k_lo, k_hi = key & _M32, (key >> 32) & _M32
    return _fmix32((i & _M32) ^ k_lo ^ _fmix32((i >> 32) ^ k_hi))


def _magnitude_bits(t: Tensor) -> Tensor:
    """The 15 magnitude bits of a bf16/fp16 tensor, as int64."""
    return t.view(torch.int16).to(torch.int64) & 0x7FFF


def _from_bits(magnitude: Tensor, negative: Tensor, dtype: torch.dtype) -> Tensor:
    bits = magnitude | (negative.to(torch.int64) << 15)
    bits = torch.where(bits >= 0x8000, bits - 0x10000, bits)  # as signed int16
    return bits.to(torch.int16).view(dtype)


def stochastic_round(
    x: Tensor, dtype: torch.dtype, seed: int, *, offset: int = 0
) -> Tensor:
    """Rounds fp32 ``x`` to ``dtype`` (bf16 or fp16) stochastically and unbiasedly.

    The slow, obvious reference of the rule in the module docstring.

    Args:
        x: fp32 values (any shape; element i of ``x.reshape(-1)`` is element
            ``offset + i`` of the parameter).
        dtype: ``torch.bfloat16`` or ``torch.float16``.
        seed: the 64-bit key (see :func:`rounding_key`).
        offset: flat index of ``x``'s first element in the parameter.

    Returns:
        A tensor of ``dtype`` with ``x``'s shape.

    Raises:
        TypeError: ``x`` is not fp32 or ``dtype`` is not bf16/fp16.

    Example:
        >>> import torch
        >>> x = torch.full((10000,), 1.0 + 2**-10)  # 1/8 of a bf16 ulp above 1
        >>> y = stochastic_round(x, torch.bfloat16, rounding_key(0, 1))
        >>> sorted(set(y.float().tolist()))
        [1.0, 1.0078125]
        >>> abs(float(y.float().mean()) - (1 + 2**-10)) < 3e-4
        True
    """
    if not isinstance(x, Tensor) or x.dtype != torch.float32:
        kind = x.dtype if isinstance(x, Tensor) else type(x).__name__
        raise TypeError(f"x must be an fp32 tensor, got {kind}")
    if dtype not in LOW_PRECISION:
        raise TypeError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype}")
    flat = x.reshape(-1)
    nearest = flat.to(dtype)
    negative = flat < 0
    mag = _magnitude_bits(nearest)
    ax = flat.double().abs()
    above = nearest.double().abs() > ax  # nearest rounded away from zero
    a_bits = torch.where(above, mag - 1, mag)
    b_bits = a_bits + 1
    a = _from_bits(a_bits, torch.zeros_like(negative), dtype).double()
    b = _from_bits(b_bits, torch.zeros_like(negative), dtype).double()
    # Both differences are exact in float64 and (b - a) is a power of two: f is exact.
    frac = (ax - a) / (b - a)
    frac = torch.where(a_bits >= _MAX_FINITE_BITS[dtype], 0.0, frac)  # saturate
    threshold = torch.floor(frac * 2.0**32).to(torch.int64)
    r = random_bits(seed, offset, flat.numel(), device=x.device)
    away = r < threshold
    out = _from_bits(torch.where(away, b_bits, a_bits), negative, dtype)
    out = torch.where(torch.isfinite(flat), out, nearest)  # NaN, inf: as .to
    return out.view(x.shape)


def round_to(
    x: Tensor,
    dtype: torch.dtype,
    *,
    stochastic: bool,
    seed: int = 0,
    offset: int = 0,
) -> Tensor:
    """``x`` in ``dtype``: stochastically rounded (bf16/fp16, when asked) or
    rounded to nearest."""
    if stochastic and dtype in LOW_PRECISION:
        return stochastic_round(x.float(), dtype, seed, offset=offset)
    return x.to(dtype)


def default_stochastic(dtype: torch.dtype, option: bool | None) -> bool:
    """Whether to round stochastically: ``option``, or when None, on for bf16 only.

    Raises:
        TypeError: ``option`` is not a bool or None.
    """
    if option is None:
        return dtype == torch.bfloat16
    if not isinstance(option, bool):
        raise TypeError(
            f"stochastic_rounding must be True, False or None, got {option!r}"
        )
    return option and dtype in LOW_PRECISION
