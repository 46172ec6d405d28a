r"""Stochastic rounding of momentum codes: the stored momentum stays unbiased.

Nearest-code quantization of the momentum is biased towards the codes: a value
between two codes always lands on the nearer one, and with 16 codes the distance is
large, so small components of m are stored as 0 step after step and the stored
momentum drifts from the exact one. With 256 codes the distance is small, but a
momentum near 0 whose gradient stops is stored back unchanged (``0.9 c`` rounds to
``c``) and never decays (docs/gefen.md). **Stochastic rounding** stores the lower
or the upper neighbour with the probabilities that make the stored value exact on
average: :math:`E[\mathrm{code}(x)] = x` (docs/gefen.md, "4-bit momentum: stochastic
code rounding"). 4-bit codes are rounded so by default, 8-bit ones with
``momentum_rounding="stochastic"``.

**The rule.** Let :math:`u_0 < \dots < u_{U-1}` be the codebook's distinct values and
:math:`d_j = u_{j+1} - u_j` (fp32). An fp32 value ``x`` in [-1, 1] (a momentum
component divided by its block's absmax) with a uniform ``r`` in [0, 1) gets the value
index

.. math:: k = \#\{\, j < U-1 : \mathrm{fl}(x - u_j) > \mathrm{fl}(r \cdot d_j) \,\}

and the stored code is the lowest code holding :math:`u_k`. Every :math:`u_j` below
x's interval counts (``fl(r d) < d`` for ``r < 1``), none above it does, and the
interval's own lower value counts with probability :math:`(x - u_i)/d_i` (up to fp32
rounding). A value equal to a code keeps that code exactly (``x - u_i = 0`` is never
``> r d_i``), so the block's absmax element stays :math:`\pm 1`. The two products
are separate fp32 operations with no multiply-add to fuse, so this module, the
PyTorch fallback (compiled or not) and the C kernel give the same bits.

**The random bits.** ``r`` is the top 24 bits of the same counter-based hash as the
bf16 parameter rounding (:func:`leantrain.optim.precision.random_bits`) of the
element's flat index in the (global) parameter, on a key of its own,
:func:`code_key` (so the two streams are independent): deterministic given the
parameter's seed and the step, so a resumed run continues bit-exactly, whatever the
thread count, chunking, device or sharding.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._quant_table import quant_table
from .precision import _splitmix64, random_bits, rounding_key

__all__ = [
    "code_key",
    "round_blocks",
    "searched_index",
    "stochastic_codes",
    "stochastic_index",
    "uniform",
]

# More distinct values than this (8-bit codebooks) are searched, not counted.
SEARCH_ABOVE = 16
# Separates the code stream from the parameter-rounding stream of the same key.
_CODE_STREAM = 0xC0DE5EED5A17ED01


def code_key(seed: int, step: int) -> int:
    """The 64-bit key of one parameter's code rounding at one step (``seed`` and
    ``step`` as for :func:`~leantrain.optim.precision.rounding_key`)."""
    return _splitmix64(rounding_key(seed, step) ^ _CODE_STREAM)


def uniform(key: int, start: int, count: int, device=None) -> Tensor:
    """fp32 ``r`` in [0, 1) of elements ``start .. start + count - 1``: the top 24
    bits of their hash, times :math:`2^{-24}` (exact in fp32)."""
    bits = random_bits(key, start, count, device=device)
    return (bits >> 8).to(torch.float32).mul_(2.0**-24)


def stochastic_codes(x: Tensor, codebook: Tensor, r: Tensor) -> Tensor:
    """Codes (uint8, x's shape) of fp32 values ``x`` in [-1, 1] rounded
    stochastically with uniforms ``r`` (same shape), by the rule in the module
    docstring. The slow, obvious reference: one comparison per distinct code.

    Example:
        >>> cb = torch.tensor([-1.0, 0.0, 1.0])
        >>> x = torch.full((4,), 0.25)
        >>> stochastic_codes(x, cb, torch.tensor([0.0, 0.2, 0.3, 0.9])).tolist()
        [2, 2, 1, 1]
    """
    if x.shape != r.shape:
        raise ValueError(f"x {tuple(x.shape)} and r {tuple(r.shape)} differ in shape")
    cb = codebook.to(device=x.device, dtype=torch.float32)
    uniq, counts = torch.unique_consecutive(cb, return_counts=True)
    first = torch.cumsum(counts, 0) - counts
    return first[stochastic_index(x.float(), uniq, r.float())].to(torch.uint8)


def stochastic_index(x: Tensor, uniq: Tensor, r: Tensor) -> Tensor:
    """The rule's value index (int64) of fp32 ``x`` into the distinct, ascending
    fp32 values ``uniq``, with uniforms ``r``: one comparison per gap (4-bit
    codebooks), or for more values :func:`searched_index`, the same index."""
    if uniq.numel() - 1 > SEARCH_ABOVE:
        return searched_index(x, uniq, r)
    gaps = uniq[1:] - uniq[:-1]
    index = torch.zeros(x.shape, dtype=torch.int64, device=x.device)
    for j in range(gaps.numel()):
        index += (x - uniq[j]) > (r * gaps[j])
    return index


def searched_index(x: Tensor, uniq: Tensor, r: Tensor) -> Tensor:
    """:func:`stochastic_index` by search: ``i = #{j >= 1 : x >= u_j}`` (x's
    interval), then ``i + [fl(x - u_i) > fl(r * d_i)]``. The module docstring's
    argument (every value below x's interval counts, none above it does) makes this
    the count, bit for bit; the C kernel's 8-bit rule computes it the same way."""
    gaps = uniq[1:] - uniq[:-1]
    below = torch.searchsorted(uniq[1:].contiguous(), x.contiguous(), right=True)
    below = torch.where(torch.isnan(x), torch.zeros_like(below), below)
    inside = below < gaps.numel()  # x's interval has an upper value
    i = below.clamp(max=max(gaps.numel() - 1, 0))
    up = inside & ((x - uniq[i]) > (r * gaps[i]))
    return below + up.long()


def round_blocks(
    m: Tensor, amax: Tensor, codebook: Tensor, key: int, start: int, nearest: Tensor
) -> Tensor:
    """Codes of flat momentum ``m`` (elements ``start ..`` of the parameter) whose
    block absmax, per element, is ``amax``: stochastic where ``amax > 0``; an
    all-zero block keeps ``nearest`` (the code nearest 0), as nearest rounding does.

    The codes are :func:`stochastic_codes`'s; the codebook's distinct values and
    their first codes come from its cached quantizer table, on ``m``'s device:
    finding them afresh (``unique_consecutive``) would make the host wait for a
    CUDA device every step.
    """
    u = m / torch.where(amax > 0, amax, torch.ones_like(amax))
    r = uniform(key, start, m.numel(), device=m.device)
    table = quant_table(codebook, m.device)
    codes = table.first[stochastic_index(u.float(), table.uniq, r.float())]
    return torch.where(amax > 0, codes, nearest)
