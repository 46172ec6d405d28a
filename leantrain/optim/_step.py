r"""The reference Gefen step: one parameter, plain PyTorch, readable.

This is the definition of Gefen's update (docs/CONTRACTS.md, "One step for one
parameter"); a fast path must take the same arguments and match it in a parity test.
Why it exists: it is the oracle. ``step()`` never runs it; it is written for reading,
not speed.
It is AdamW (decoupled weight decay, bias correction, eps outside the sqrt) with

* a second moment per block of p contiguous elements,
  :math:`v \leftarrow \beta_2 v + (1-\beta_2)\,\mathrm{mean}_{block}(g^2)` (or, in a
  factored state, Adafactor's row and column factors: ``factored.py``), and
* a momentum stored as codes into a shared codebook times a per-block absmax; the
  update uses the *de-quantized re-quantized* momentum, so what is stored is exactly
  what was applied.

The tensor is processed in chunks of whole blocks, so temporaries (fp32 copies,
codes, whatever index tensors the quantizer makes) stay bounded by the chunk size,
not the parameter size. A single block longer than a chunk is processed whole.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import code_rounding, factored
from ._options import StepOptions, max_step
from .quant import (
    NearestCode,
    block_absmax,
    block_mean_square,
    dequantize_blockwise,
    pack_nibbles,
    quantize_blockwise,
    unpack_nibbles,
)

# Elements per chunk: ~4 MiB per fp32 temporary, large enough to amortize the
# per-chunk Python overhead, small enough that temporaries stay a few MiB.
CHUNK_ELEMENTS = 1 << 20


def chunk_length(block: int) -> int:
    """Chunk length: a multiple of ``2 * block`` so chunks start on a block and a byte.

    An even start keeps 4-bit code pairs (two codes per byte) inside one chunk.
    """
    unit = 2 * block
    return max(1, CHUNK_ELEMENTS // unit) * unit


# NearestCode builds a lookup table (host work per build); codebooks are frozen, so
# the few live ones are kept, keyed by identity (the entry holds the tensor, so its
# id cannot be reused while cached).
_NEAREST: dict[int, tuple[Tensor, NearestCode]] = {}


def nearest_code(codebook: Tensor) -> NearestCode:
    """The (cached) nearest-code lookup of a frozen codebook tensor."""
    entry = _NEAREST.get(id(codebook))
    if entry is None or entry[0] is not codebook:
        if len(_NEAREST) >= 8:
            _NEAREST.clear()
        entry = _NEAREST[id(codebook)] = (codebook, NearestCode(codebook))
    return entry[1]


def per_element(block_values: Tensor, block: int, length: int) -> Tensor:
    """Repeats each block's value over its ``block`` elements (last block shorter)."""
    if block == 1:
        return block_values
    return block_values[:, None].expand(-1, block).reshape(-1)[:length]


def apply_update(
    w32: Tensor,
    m: Tensor,
    denom: Tensor,
    step_size: float,
    lr: float,
    update_clip: float | None,
) -> None:
    """``w32 += -step_size * m / denom``, each element's step clipped to
    ``lr * update_clip`` (``Gefen``'s ``update_clip``; None: not clipped).

    Unclipped it is AdamW's own op, addcdiv, whose rounding is
    ``w + (value * m) / denom``; the clipped step rounds the same way before its
    clamp, so a clip that never binds changes no bit.
    """
    if update_clip is None:
        w32.addcdiv_(m, denom, value=-step_size)
        return
    bound = max_step(lr, update_clip)
    w32.add_((m * -step_size).div_(denom).clamp_(-bound, bound))


def _load_momentum(
    state: dict, start: int, end: int, qblock: int, codebook: Tensor
) -> Tensor:
    """De-quantizes the stored momentum of elements [start, end) to fp32."""
    codes = state["exp_avg_codes"]
    if codebook.numel() == 16:
        codes = unpack_nibbles(codes[start // 2 : math.ceil(end / 2)], end - start)
    else:
        codes = codes[start:end]
    absmax = state["exp_avg_absmax"][start // qblock : math.ceil(end / qblock)]
    return dequantize_blockwise(codes, absmax, qblock, codebook)


def _store_momentum(
    state: dict,
    m: Tensor,
    start: int,
    end: int,
    qblock: int,
    codebook: Tensor,
    nearest: NearestCode,
    key: int | None = None,
) -> None:
    """Quantizes ``m`` into the state for elements [start, end): to the nearest
    code, or stochastically with the uniforms of ``key`` (``code_rounding``)."""
    codes, absmax = quantize_blockwise(m, qblock, nearest)
    if key is not None:
        amax = per_element(block_absmax(m, qblock), qblock, end - start)
        codes = code_rounding.round_blocks(m, amax, codebook, key, start, codes)
    state["exp_avg_absmax"][start // qblock : math.ceil(end / qblock)] = absmax
    if codebook.numel() == 16:
        state["exp_avg_codes"][start // 2 : math.ceil(end / 2)] = pack_nibbles(codes)
    else:
        state["exp_avg_codes"][start:end] = codes


@torch.no_grad()
def reference_step(
    param: Tensor,
    grad: Tensor,
    state: dict,
    options: StepOptions | None = None,
    *,
    seed: int = 0,
    **fields: object,
) -> None:
    r"""Applies one Gefen step to ``param`` in place and advances ``state``.

    Args:
        param: the parameter (any floating dtype; math is fp32, the result is cast
            back once per chunk).
        grad: its gradient, same shape; dense, finite.
        state: the parameter's state (see ``_state.new_state``), updated in place.
        options: the step's hyper-parameters (:class:`~._options.StepOptions`);
            or give its fields as keywords (``lr=..., beta1=..., ...``). Its
            ``stochastic_rounding`` is not used: the reference rounds to nearest.
        seed: the parameter's random stream (its index in the optimizer), keying
            ``code_key(seed, step)``.

    Example:
        >>> import torch
        >>> from leantrain.optim._state import new_state
        >>> p, g = torch.ones(6), torch.full((6,), 0.5)
        >>> state = new_state(p, period=3, bits=None, codebook=None)
        >>> reference_step(p, g, state, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8,
        ...                weight_decay=0.0, maximize=False)
        >>> torch.allclose(p, torch.full((6,), 0.9))
        True
    """
    o = options if options is not None else StepOptions(**fields)
    lr, beta1, beta2, eps = o.lr, o.beta1, o.beta2, o.eps
    weight_decay, maximize, update_clip = o.weight_decay, o.maximize, o.update_clip
    n = param.numel()
    if n == 0:
        return
    state["step"] += 1
    step = float(state["step"])
    step_size = lr / (1 - beta1**step)
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    period = int(state["period"])
    codebook = state.get("codebook")
    if codebook is not None:
        codebook = codebook.to(param.device)
        qblock = int(state["qblock"])
        nearest = nearest_code(codebook)
    else:
        qblock = period
    key = None
    if o.stochastic_codes and codebook is not None:
        key = code_rounding.code_key(seed, int(state["step"]))
    rows = state.get("factored")
    if rows is not None:  # factored.py: row and column factors, then denominators
        rows = int(rows)
        sq = grad.reshape(rows, n // rows).float().square()
        factors = state["exp_avg_sq"]
        factors[:rows].mul_(beta2).add_(sq.mean(1), alpha=1 - beta2)
        factors[rows:].mul_(beta2).add_(sq.mean(0), alpha=1 - beta2)
        cbar = factored.mean_column(factors, rows)
        a, b = factored.denominator_factors(factors, rows, cbar, bias_correction2_sqrt)
    # Row-major flattening of the logical layout; a non-contiguous parameter is
    # updated in a contiguous copy and written back once at the end.
    flat_param = param.view(-1) if param.is_contiguous() else param.reshape(-1).clone()
    flat_grad = grad.reshape(-1)
    chunk = chunk_length(qblock)
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        g = flat_grad[start:end].float()
        if maximize:
            g = -g
        if rows is None:  # (B,) v per block of this chunk; chunks start on a block
            v = state["exp_avg_sq"][start // period : math.ceil(end / period)]
            if period == 1:  # the same ops as torch's AdamW: "element" matches it
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            else:
                v.mul_(beta2).add_(block_mean_square(g, period), alpha=1 - beta2)
        w = flat_param[start:end]
        w32 = w if w.dtype == torch.float32 else w.float()
        w32.mul_(1 - lr * weight_decay)
        if codebook is None:
            m = state["exp_avg"].view(-1)[start:end]
            m.lerp_(g, 1 - beta1)
        else:
            m = _load_momentum(state, start, end, qblock, codebook)
            m.lerp_(g, 1 - beta1)
            # Only what is stored is quantized: this step uses the exact new m
            # (docs/gefen.md, "The update uses the exact momentum").
            _store_momentum(state, m, start, end, qblock, codebook, nearest, key)
        if rows is None:
            denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
            denom = per_element(denom, period, end - start)
        else:  # a[i] * b[j] + eps: sqrt(v_ij) / sqrt(bc2) + eps, factored.py
            denom = factored.factored_denominator(a, b, eps, start, end)
        apply_update(w32, m, denom, step_size, lr, update_clip)
        if w32 is not w:
            w.copy_(w32)
    if not param.is_contiguous():
        param.copy_(flat_param.view(param.shape))
