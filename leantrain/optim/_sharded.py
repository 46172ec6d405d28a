r"""Gefen's step on one rank's range of a sharded parameter (pure math, no comms).

Under FSDP2 a rank holds the contiguous element range ``[start, stop)`` of the
row-major flattened parameter (whole rows of a dim-0 shard). Gefen's blocks are laid
on the *global* flattened tensor, so a block may straddle two (or more) ranks.

**How straddling blocks are handled.** Each rank keeps the statistics of every block
that intersects its range (the first and last may be shared with its neighbours:
at most one duplicated block per end, the "one block's overhead per tensor"). A step
runs in two halves:

1. :func:`begin_step` computes, from the local elements only, each local block's
   *partial* :math:`\sum g^2` and the new momentum's *partial* absmax;
2. the caller sums the partial :math:`\sum g^2` and takes the max of the partial
   absmax of the shared blocks across ranks (``_dist`` batches this into one SUM and
   one MAX ``all_reduce`` for all parameters), after which every rank holds the
   global value of every block it touches;
3. :func:`finish_step` updates the second moment with the global block mean,
   quantizes the momentum with the global block absmax and updates the parameter.

Shared blocks therefore hold identical values on every rank that holds them, exactly
as in a single process; the only difference from ``_step.reference_step`` is the fp32
summation order of a straddling block's :math:`\sum g^2` (last-bit differences).
Blocks are padded with zeros to whole rows (``[blocks, block]`` views), which adds
nothing to a sum or an absmax; a histogram subtracts its padding from the zero bin.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from . import code_rounding
from ._options import StepOptions
from ._step import apply_update, nearest_code
from .quant import pack_nibbles, unpack_nibbles


class Span(NamedTuple):
    """Elements ``[start, stop)`` of a flattened tensor of ``numel`` elements."""

    start: int
    stop: int
    numel: int


def block_window(span: Span, block: int) -> tuple[int, int]:
    """Global indices ``[b0, b1)`` of the length-``block`` blocks meeting the span."""
    b0 = span.start // block
    if span.stop <= span.start:
        return b0, b0
    return b0, -(-span.stop // block)


def shared_blocks(spans: list[Span], block: int) -> list[int]:
    """Global indices of the blocks that meet more than one non-empty span, sorted."""
    seen: dict[int, int] = {}
    for span in spans:
        b0, b1 = block_window(span, block)
        for b in {b0, b1 - 1} if b1 > b0 else ():
            seen[b] = seen.get(b, 0) + 1
    return sorted(b for b, count in seen.items() if count > 1)


def padded_rows(x: Tensor, span: Span, block: int) -> Tensor:
    """``x`` (the span's elements) zero-padded to whole blocks, ``[blocks, block]``."""
    head = span.start % block
    tail = (-(head + x.numel())) % block
    return F.pad(x.reshape(-1), (head, tail)).view(-1, block)


def block_lengths(span: Span, block: int) -> Tensor:
    """Global length of every block in the span's window (the last may be shorter)."""
    b0, b1 = block_window(span, block)
    starts = torch.arange(b0, b1, dtype=torch.float64) * block
    return (torch.clamp(span.numel - starts, max=block)).to(torch.float32)


def partial_absmax(x: Tensor, span: Span, block: int) -> Tensor:
    """Max of |x| over the span's part of each block of its window, fp32."""
    if x.numel() == 0:
        return torch.zeros(0, dtype=torch.float32, device=x.device)
    return padded_rows(x.float(), span, block).abs().amax(1)


def local_histogram(g: Tensor, span: Span, qblock: int, absmax: Tensor, bins: int):
    """``codebook.histogram`` counts of the span's elements divided by their (global)
    block absmax; histograms of a cover of the tensor add up to the global one."""
    counts = torch.zeros(bins, dtype=torch.float64, device=g.device)
    if g.numel() == 0:
        return counts
    scale = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    rows = padded_rows(g.float(), span, qblock)
    u = rows / scale[:, None]
    idx = u.add_(1.0).mul_(bins / 2.0).floor_().clamp_(0, bins - 1).long()
    counts += torch.bincount(idx.view(-1), minlength=bins).to(torch.float64)
    pad = rows.numel() - g.numel()  # padded zeros land in the bin of 0
    counts[min(bins // 2, bins - 1)] -= pad
    return counts


def _codes(state: dict, n_local: int) -> Tensor:
    codes = state["exp_avg_codes"]
    return unpack_nibbles(codes, n_local) if state["codebook"].numel() == 16 else codes


def begin_step(grad: Tensor, state: dict, span: Span, *, beta1: float, maximize: bool):
    """First half of a step: local partial statistics (see the module docstring).

    Returns:
        ``(g, sq, m, amax)``: the fp32 gradient (sign applied), the partial
        :math:`\\sum g^2` per block ``[nb_local]``, the new unquantized momentum
        (fp32, flat) and its partial absmax per quantization block (None for fp32
        momentum). ``sq`` and ``amax`` are to be reduced across ranks in place.
    """
    g = grad.reshape(-1).float()
    if maximize:
        g = -g
    period = int(state["period"])
    sq = padded_rows(g.square(), span, period).sum(1) if g.numel() else g.new_zeros(0)
    if "exp_avg" in state:
        return g, sq, None, None
    qblock, codebook = int(state["qblock"]), state["codebook"]
    absmax = state["exp_avg_absmax"]
    codes = padded_rows(_codes(state, g.numel()).long(), span, qblock)
    m = (codebook.to(g.device)[codes] * absmax[:, None]).view(-1)
    head = span.start % qblock
    m = m[head : head + g.numel()].lerp_(g, 1 - beta1)
    return g, sq, m, partial_absmax(m, span, qblock)


def finish_step(
    param: Tensor,
    state: dict,
    span: Span,
    g: Tensor,
    sq: Tensor,
    m: Tensor | None,
    amax: Tensor | None,
    options: StepOptions | None = None,
    *,
    seed: int = 0,
    **fields: object,
) -> None:
    """Second half of a step, with ``sq`` and ``amax`` reduced over the ranks
    (``options`` or its fields as keywords, and ``seed``: as for
    ``_step.reference_step``; a span's elements draw the bits of their global
    indices)."""
    o = options if options is not None else StepOptions(**fields)
    lr, beta1, beta2, eps = o.lr, o.beta1, o.beta2, o.eps
    state["step"] += 1
    n = g.numel()
    if n == 0:
        return
    step = float(state["step"])
    step_size = lr / (1 - beta1**step)
    bc2_sqrt = (1 - beta2**step) ** 0.5
    period = int(state["period"])
    v = state["exp_avg_sq"]
    if period == 1:
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    else:
        v.mul_(beta2).add_(
            sq / block_lengths(span, period).to(sq.device), alpha=1 - beta2
        )
    flat = param.view(-1) if param.is_contiguous() else param.reshape(-1).clone()
    w32 = flat if flat.dtype == torch.float32 else flat.float()
    w32.mul_(1 - lr * o.weight_decay)
    if m is None:
        m = state["exp_avg"].view(-1)
        m.lerp_(g, 1 - beta1)
    else:
        qblock, codebook = int(state["qblock"]), state["codebook"].to(g.device)
        state["exp_avg_absmax"].copy_(amax)
        scale = torch.where(amax > 0, amax, torch.ones_like(amax))
        head = span.start % qblock
        u = (padded_rows(m, span, qblock) / scale[:, None]).view(-1)
        codes = nearest_code(codebook)(u[head : head + n])
        if o.stochastic_codes:
            key = code_rounding.code_key(seed, int(state["step"]))
            each = padded_rows(
                torch.zeros(n, dtype=torch.float32, device=m.device), span, qblock
            )
            each = (each + amax[:, None]).view(-1)[head : head + n]
            codes = code_rounding.round_blocks(
                m, each, codebook, key, span.start, codes
            )
        packed = pack_nibbles(codes) if codebook.numel() == 16 else codes
        state["exp_avg_codes"].copy_(packed)  # the update uses the exact m
    denom = (v.sqrt() / bc2_sqrt).add_(eps)
    per = padded_rows(
        torch.zeros(n, dtype=torch.float32, device=g.device), span, period
    )
    per = (per + denom[:, None]).view(-1)[span.start % period :][:n]
    apply_update(w32, m, per, step_size, lr, o.update_clip)
    if w32 is not flat:
        flat.copy_(w32)
    if flat.data_ptr() != param.data_ptr():
        param.copy_(flat.view(param.shape))


def new_local_state(
    param: Tensor, span: Span, period: int, bits: int | None, codebook: Tensor | None
) -> dict[str, Tensor]:
    """``_state.new_state`` for the span's elements: block statistics of every block
    meeting the span, codes of the span's elements (4-bit packed from the span's
    first element)."""
    from ._state import new_state, qblock_for

    state = new_state(param.reshape(-1), period, bits, codebook)
    b0, b1 = block_window(span, period)
    state["exp_avg_sq"] = param.new_zeros(b1 - b0, dtype=torch.float32)
    if bits is not None:
        q0, q1 = block_window(span, qblock_for(period))
        state["exp_avg_absmax"] = param.new_zeros(q1 - q0, dtype=torch.float32)
    return state
