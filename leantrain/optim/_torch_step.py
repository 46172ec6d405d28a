"""Gefen's step in plain PyTorch over bounded chunks (the fused path's fallback).

Used where neither the C kernel nor the Triton step (``_triton_step``, CUDA) is:
fp16 on the CPU, non-contiguous tensors, no compiler, ``LEANTRAIN_NO_NATIVE=1``, CUDA
tensors where triton is missing or the Triton step does not cover a case (then
``_triton_step.warn_fallback`` says why, once). Same math and
roundings as the kernel (``_kernels/gefen_step.c``) and the reference
(``_step.reference_step``); temporaries are ~120 bytes per element of one chunk of
``TORCH_CHUNK`` elements, whatever the parameter's size. A chunk is a run of
whole blocks starting on an even element (so 4-bit code pairs never straddle two
chunks); a block longer than a chunk is done in two passes over sub-chunks (stats,
then quantize and update), recomputing the momentum rather than storing it.

It runs eagerly on every device, ``torch.compile`` included nowhere: a chunk is a
dozen batched tensor ops over up to ``TORCH_CHUNK`` elements, so the launches per
step grow with the parameter count divided by the chunk, not with its elements.

Why it exists: machines without a C compiler, tensors the kernel does not take
(fp16, non-contiguous), and CUDA without triton.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import code_rounding
from ._quant_table import QuantTable, nearest_index, quant_table
from ._state_layout import packed_codes, state_layout
from .factored import denominator_factors, factored_denominator
from .precision import round_to

# Elements per chunk: temporaries are ~120 B per element of a chunk (fp32, fp64 and
# int64 vectors), so 2**17 keeps them near 16 MiB whatever the tensor.
TORCH_CHUNK = 1 << 17


def read_codes(codes: Tensor, start: int, end: int, bits: int) -> Tensor:
    """Codes of elements [start, end) as int64 from flat codes; ``bits`` is the
    storage: 4 = two codes per byte (element 2i in the low nibble), 8 = one per byte.
    """
    if bits == 8:
        return codes[start:end].long()
    raw = codes[start // 2 : (end + 1) // 2].long()
    pairs = torch.stack([raw & 15, raw >> 4], dim=1).reshape(-1)
    return pairs[start % 2 : start % 2 + end - start]


def write_codes(codes: Tensor, start: int, end: int, values: Tensor, bits: int) -> None:
    """Stores codes of elements [start, end) into flat codes (``bits``: the storage,
    as in :func:`read_codes`); nibbles of neighbours are kept, and the unused high
    nibble after an odd tensor's last element is zero."""
    values = values.to(torch.uint8)
    if bits == 8:
        codes[start:end] = values
        return
    n_bytes = codes.numel()
    lo, hi = start // 2, (end + 1) // 2
    old = read_codes(codes, 2 * lo, min(2 * hi, 2 * n_bytes), 4).to(torch.uint8)
    if old.numel() < 2 * (hi - lo):  # odd numel: the padding nibble reads as 0
        old = torch.cat([old, old.new_zeros(1)])
    old[start - 2 * lo : end - 2 * lo] = values
    if end == 2 * n_bytes - 1:  # tensor's last element in a low nibble
        old[-1] = 0
    codes[lo:hi] = old[0::2] | (old[1::2] << 4)


def _per_element(values: Tensor, block: int, length: int) -> Tensor:
    return values.repeat_interleave(block)[:length] if block > 1 else values


def _momentum(
    g: Tensor,
    state: dict,
    start: int,
    end: int,
    block: int,
    bits: int,
    table: QuantTable | None,
    w1: float,
) -> Tensor:
    """New momentum of elements [start, end) (a range of whole blocks or a part of
    one block): lerp(old m, g, 1 - beta1)."""
    if not bits:
        return torch.lerp(state["exp_avg"].view(-1)[start:end], g, w1)
    absmax = state["exp_avg_absmax"][start // block : (end - 1) // block + 1]
    old = table.codebook[read_codes(state["exp_avg_codes"], start, end, bits)]
    offset = start % block  # a sub-chunk of a long block starts inside it
    old = old * absmax.repeat_interleave(block)[offset : offset + end - start]
    return torch.lerp(old, g, w1)


def _quantize(
    m: Tensor, amax: Tensor, table: QuantTable, r: Tensor | None = None
) -> Tensor:
    """Codes of m, one absmax per element (0: the code of 0); nearest, or rounded
    stochastically with the uniforms ``r`` (:mod:`.code_rounding`)."""
    x = torch.where(amax > 0, m / amax, torch.zeros_like(m))
    index = nearest_index(x, table)
    if r is not None:
        above = code_rounding.stochastic_index(x, table.uniq, r)
        index = torch.where(amax > 0, above, index)
    return table.first[index]


def _ema(v: Tensor, x: Tensor, h: dict) -> None:
    """v = beta2 * v + (1 - beta2) * x, rounded like the reference's
    ``add_(x, alpha=...)`` (a fused multiply-add)."""
    v.mul_(h["beta2"]).add_(x, alpha=h["omb2"])


def _clipped(step: Tensor, h: dict) -> Tensor:
    """Each element's step clipped to ``h["max_step"]`` (fp32; inf without a clip:
    no pass at all). NaN goes through, as in the reference."""
    bound = h["max_step"]
    if math.isinf(bound):
        return step
    return step.clamp_(-bound, bound)


def _chunk(
    param32: Tensor,
    g: Tensor,
    state: dict,
    start: int,
    end: int,
    period: int,
    block: int,
    bits: int,
    table: QuantTable | None,
    h: dict[str, float],
    r: Tensor | None = None,
    den: Tensor | None = None,
) -> None:
    """One chunk of whole blocks: the full update in one pass (``r``: the code
    rounding's uniforms of the chunk, or None for nearest codes; ``den``: a
    factored state's per-element denominators, from the updated factors)."""
    length = end - start
    sq = g * g
    if den is not None:
        denom = den
    elif period == 1:
        v = state["exp_avg_sq"][start:end]
        _ema(v, sq, h)
        denom = (v.sqrt() / h["sqrt_bc2"]).add_(h["eps"])
    else:
        nb = math.ceil(length / block)
        padded = torch.zeros(nb * block, dtype=torch.float64, device=g.device)
        padded[:length] = sq
        sizes = torch.full((nb,), float(block), dtype=torch.float64, device=g.device)
        sizes[-1] = length - (nb - 1) * block
        mean = (padded.view(nb, block).sum(1) / sizes).float()
        v = state["exp_avg_sq"][start // block : start // block + nb]
        _ema(v, mean, h)
        denom = _per_element((v.sqrt() / h["sqrt_bc2"]).add_(h["eps"]), block, length)
    m = _momentum(g, state, start, end, block, bits, table, h["w1"])
    if bits:
        nb = math.ceil(length / block)
        padded = torch.zeros(nb * block, dtype=m.dtype, device=m.device)
        padded[:length] = m.abs()
        amax = padded.view(nb, block).amax(1)
        state["exp_avg_absmax"][start // block : start // block + nb] = amax
        codes = _quantize(m, _per_element(amax, block, length), table, r)
        write_codes(state["exp_avg_codes"], start, end, codes, bits)
    else:
        state["exp_avg"].view(-1)[start:end] = m
    # The exact new m, not its stored quantization (as the reference);
    # addcdiv's rounding, p + (-step_size * m) / denom, in ops that take a tensor
    param32.mul_(h["decay"]).add_(_clipped(m * -h["step_size"] / denom, h))


def _big_block(
    param32: Tensor,
    grad: Tensor,
    state: dict,
    start: int,
    end: int,
    period: int,
    block: int,
    bits: int,
    table: QuantTable | None,
    h: dict[str, float],
    chunk: int,
    sign: float,
    uniforms=None,
    factors=None,
) -> None:
    """One block longer than a chunk: stats over sub-chunks, then the update
    (``uniforms(s, e)``: the code rounding's uniforms of elements [s, e), or None
    for nearest codes; ``factors(s, e)``: a factored state's denominators of those
    elements)."""
    b = start // block
    # The block's sum of g^2 (in double) and its momentum's absmax stay 0-dim
    # tensors on the device: as host floats every sub-chunk would wait for it.
    total = torch.zeros((), dtype=torch.float64, device=grad.device)
    amax_t = torch.zeros((), dtype=torch.float32, device=grad.device)
    for s in range(start, end, chunk):
        e = min(s + chunk, end)
        g = grad[s:e].float() * sign
        total += (g * g).double().sum()
        if bits:
            m = _momentum(g, state, s, e, block, bits, table, h["w1"])
            # fmax: a NaN is passed over, as the host max(amax, nan) did
            amax_t = torch.fmax(amax_t, m.abs().amax())
    if factors is None:
        mean = (total / (end - start)).float().reshape(1)
        v = state["exp_avg_sq"][b : b + 1]
        v.mul_(h["beta2"]).add_(mean, alpha=h["omb2"])
        denom = (v.sqrt() / h["sqrt_bc2"]).add_(h["eps"])
    for s in range(start, end, chunk):
        e = min(s + chunk, end)
        g = grad[s:e].float() * sign
        m = _momentum(g, state, s, e, block, bits, table, h["w1"])
        if bits:
            r = uniforms(s, e) if uniforms is not None else None
            codes = _quantize(m, amax_t.expand_as(m), table, r)
            write_codes(state["exp_avg_codes"], s, e, codes, bits)
        else:
            state["exp_avg"].view(-1)[s:e] = m
        w = param32[s - start : e - start]
        if factors is not None:
            denom = factors(s, e)
        w.mul_(h["decay"]).add_(_clipped(m * -h["step_size"] / denom, h))
    if bits:
        state["exp_avg_absmax"][b] = amax_t


def torch_step(
    param: Tensor,
    grad: Tensor,
    state: dict,
    h: dict[str, float],
    *,
    stochastic: bool = False,
    key: int = 0,
    code_key: int | None = None,
    index0: int = 0,
    cbar: float | None = None,
) -> None:
    """The chunked PyTorch step (``state['step']`` already advanced; a factored
    state's factors too, ``cbar`` their column mean: ``factored.py``).

    A bf16/fp16 parameter is updated in fp32 per chunk and written back rounded to
    nearest, or with ``stochastic`` rounding keyed by ``key``
    (:mod:`leantrain.optim.precision`; element i draws the bits of its flat index
    ``index0 + i``: a shard's offset in the global parameter). With ``code_key``
    the codes are rounded stochastically (:mod:`.code_rounding`), drawing the
    same way.
    """
    period, block, bits = state_layout(param, state)
    table = quant_table(state["codebook"], param.device) if bits else None
    if bits:
        # Codes may take the parameter's shape; the work is on the flat view (the
        # same storage), and "bits" below is the storage: 4 only when packed.
        bits = 4 if packed_codes(param, state) else 8
        state = {**state, "exp_avg_codes": state["exp_avg_codes"].view(-1)}
    n = param.numel()
    flat = param.view(-1) if param.is_contiguous() else param.reshape(-1).clone()
    flat_grad = grad.reshape(-1)
    sign = -1.0 if h["sign"] < 0 else 1.0

    def write_back(w: Tensor, w32: Tensor, start: int) -> None:
        if w32 is not w:
            w.copy_(
                round_to(
                    w32, w.dtype, stochastic=stochastic, seed=key, offset=index0 + start
                )
            )

    rows = int(state["factored"]) if "factored" in state else None
    if rows is not None:
        a, b = denominator_factors(state["exp_avg_sq"], rows, cbar, h["sqrt_bc2"])

    def factors(start: int, end: int) -> Tensor | None:
        if rows is None:
            return None
        return factored_denominator(a, b, h["eps"], start, end)

    def uniforms(start: int, end: int) -> Tensor | None:
        if code_key is None:
            return None
        return code_rounding.uniform(
            code_key, index0 + start, end - start, device=param.device
        )

    if block > TORCH_CHUNK:
        for start in range(0, n, block):
            end = min(start + block, n)
            w = flat[start:end]
            w32 = w if w.dtype == torch.float32 else w.float()
            _big_block(
                w32,
                flat_grad,
                state,
                start,
                end,
                period,
                block,
                bits,
                table,
                h,
                TORCH_CHUNK,
                sign,
                uniforms if code_key is not None else None,
                factors if rows is not None else None,
            )
            write_back(w, w32, start)
    else:
        step = max(1, TORCH_CHUNK // (2 * block)) * 2 * block
        for start in range(0, n, step):
            end = min(start + step, n)
            g = flat_grad[start:end].float() * sign
            w = flat[start:end]
            w32 = w if w.dtype == torch.float32 else w.float()
            r = uniforms(start, end)
            den = factors(start, end)
            _chunk(w32, g, state, start, end, period, block, bits, table, h, r, den)
            write_back(w, w32, start)
    if not param.is_contiguous():
        param.copy_(flat.view(param.shape))
