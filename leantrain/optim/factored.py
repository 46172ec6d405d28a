r"""Gefen's factored second moment (``second_moment="factored"``): pure math.

A parameter with ``ndim >= 2`` is viewed as a matrix of ``R = shape[0]`` rows and
``C = numel / R`` columns (a conv weight: output channels x the rest). Instead of one
second moment per contiguous block, it keeps Adafactor's two factors: the EMAs of
the row means and of the column means of :math:`g^2`,

.. math::
    r_i \leftarrow \beta_2 r_i + (1-\beta_2)\,\mathrm{mean}_j\, g_{ij}^2, \qquad
    c_j \leftarrow \beta_2 c_j + (1-\beta_2)\,\mathrm{mean}_i\, g_{ij}^2,

and uses :math:`v_{ij} = r_i c_j / \bar c` (:math:`\bar c` the mean of ``c``; 0 while
it is 0) in AdamW's update. Why: Gefen's automatic blocks are runs of whole rows, so
a block mixes the inputs of a layer whatever their scale; the column factor follows
each input's scale and the row factor each output's (docs/gefen.md, "Factored second
moment"). The factors cost :math:`4(R+C)` bytes against :math:`4\lceil n/p\rceil` for
blocks: more on small matrices, less on large ones.

The update's denominator :math:`\sqrt{v_{ij}} / \sqrt{1-\beta_2^t} + \epsilon` is
computed as :math:`a_i b_j + \epsilon` with :math:`b_j = \sqrt{c_j}` and
:math:`a_i = \sqrt{r_i / \bar c} / \sqrt{1-\beta_2^t}` (:func:`denominator_factors`):
equal up to rounding, and one multiply per element where the direct form costs a
division, a square root and another division (about a sixth of the 8-bit default
step on a 29 M-parameter stack).

State: ``exp_avg_sq`` holds ``[r, c]`` (fp32, ``R + C``) and ``factored`` (0-dim
int64) holds ``R``. The momentum's absmax keeps its blocks of ``qblock`` elements.
Every step path updates the factors before its element loop (the column means need
the whole gradient), derives ``a`` and ``b`` from them once per step, and computes
each element's denominator as ``a[i] * b[j] + eps`` in fp32, two separate
roundings. The C kernel does both inside its one call per step: a first phase sums
``g^2`` by rows and columns (in double, over row chunks fixed by the shape) and
checks the gradients for NaN and infinities in the same read
(``_kernels/gefen_prepass.h``). The PyTorch fallback uses :func:`update_factors`,
whose means come from the same C sums where a compiled library exists, else from
torch over bounded chunks of rows.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "column_mean",
    "denominator_factors",
    "factor_means",
    "factor_shape",
    "factored_denominator",
    "mean_column",
    "torch_factor_means",
    "update_factors",
]

SECOND_MOMENTS = ("auto", "blocks", "factored")
# Rows per chunk of the factor update: temporaries stay near 2**20 elements.
_CHUNK_ELEMENTS = 1 << 20


def factor_shape(shape: tuple[int, ...]) -> tuple[int, int] | None:
    """``(R, C)`` of a parameter that is factored, or None: fewer than 2 dims, or a
    side shorter than 2 (a single row or column: factors would say nothing a block
    does not, at the cost of a per-element statistic)."""
    if len(shape) < 2:
        return None
    rows = int(shape[0])
    cols = math.prod(shape[1:])
    if rows < 2 or cols < 2:
        return None
    return rows, cols


def check_second_moment(value: object) -> None:
    """Raises ValueError unless ``value`` is "auto", "blocks" or "factored"."""
    if value not in SECOND_MOMENTS:
        raise ValueError(
            f"Invalid second_moment: {value!r}; allowed: 'auto', 'blocks' or 'factored'"
        )


def update_factors(grad: Tensor, factors: Tensor, rows: int, beta2: float) -> None:
    """One EMA step of the row and column factors (``factors = [r, c]``, in place)
    from ``grad`` (any float dtype, ``rows * cols`` elements; its sign is irrelevant).

    The means of ``g^2`` come from :func:`factor_means`; the EMA is fp32 torch math.
    """
    row_means, col_means = factor_means(grad, rows)
    factors[:rows].mul_(beta2).add_(row_means, alpha=1 - beta2)
    factors[rows:].mul_(beta2).add_(col_means, alpha=1 - beta2)


def factor_means(grad: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """The row means ``[rows]`` and column means ``[cols]`` of ``grad**2`` (fp32).

    A contiguous fp32 or bf16 CPU gradient goes to the C pass
    (``_kernels/factor_sums.c``: one read, double sums, deterministic whatever the
    thread count); anything else (CUDA, fp16, no compiler) to torch.
    """
    native = _native_means(grad, rows)
    if native is not None:
        return native
    return torch_factor_means(grad, rows)


def torch_factor_means(grad: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """:func:`factor_means` in torch: fp32 math (float64 was 8x slower on a 512 x 512
    matrix for no difference that matters to a second moment), over chunks of whole
    rows so temporaries stay bounded; a tensor of one chunk gets exactly
    ``sq.mean(1)`` and ``sq.mean(0)``."""
    cols = grad.numel() // rows
    g = grad.reshape(rows, cols)
    step = max(1, _CHUNK_ELEMENTS // cols)
    if step >= rows:
        sq = g.float().square()
        return sq.mean(1), sq.mean(0)
    col_sums = torch.zeros(cols, dtype=torch.float32, device=grad.device)
    row_means = torch.empty(rows, dtype=torch.float32, device=grad.device)
    for start in range(0, rows, step):
        sq = g[start : start + step].float().square()
        row_means[start : start + step] = sq.mean(1)
        col_sums += sq.sum(0)
    return row_means, col_sums / rows


def _native_means(grad: Tensor, rows: int) -> tuple[Tensor, Tensor] | None:
    """The C pass of :func:`factor_means`; None where it cannot run."""
    if (
        grad.device.type != "cpu"
        or grad.dtype not in (torch.float32, torch.bfloat16)
        or not grad.is_contiguous()
    ):
        return None
    from . import _native

    lib = _native.load()
    if lib is None:
        return None
    cols = grad.numel() // rows
    # Fixed row chunks from the shape alone (so the sums do not depend on the
    # threads): enough to share among threads, at most 64, and scratch (chunks x
    # cols doubles) of at most 4 MiB unless a single row is longer.
    chunks = min(
        rows, 64, max(1, grad.numel() // (1 << 16)), max(1, (1 << 19) // max(cols, 1))
    )
    scratch = torch.empty(chunks * cols, dtype=torch.float64)
    row_means = torch.empty(rows, dtype=torch.float32)
    col_means = torch.empty(cols, dtype=torch.float32)
    rc = lib.lt_factor_means(
        grad.data_ptr(),
        int(grad.dtype == torch.bfloat16),
        rows,
        cols,
        chunks,
        scratch.data_ptr(),
        row_means.data_ptr(),
        col_means.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(
            f"the native factor means rejected a {tuple(grad.shape)} tensor"
        )
    return row_means, col_means


def mean_column(factors: Tensor, rows: int) -> float:
    """:math:`\\bar c`, the mean of the column factor, as the fp32 value every path
    divides by: summed in double and rounded once (the C kernel sums in double
    too, in another order, so the two agree but for a tie at fp32's rounding)."""
    return float(column_mean(factors, rows))


def column_mean(factors: Tensor, rows: int) -> Tensor:
    """:func:`mean_column` as a 0-dim fp32 tensor on the factors' device: the
    PyTorch step divides by it there, so a CUDA step need not wait for the device
    to hand the value to the host."""
    return factors[rows:].double().mean().float()


def denominator_factors(
    factors: Tensor, rows: int, cbar: float | Tensor, sqrt_bc2: float
) -> tuple[Tensor, Tensor]:
    r"""``(a, b)``: ``a = sqrt(r / cbar) / sqrt_bc2`` (zeros while ``cbar`` is 0) and
    ``b = sqrt(c)``, in fp32, so that :math:`\sqrt{v_{ij}} / \sqrt{1-\beta_2^t}`
    is ``a[i] * b[j]`` for ``v_ij = r[i] c[j] / cbar`` (``sqrt_bc2``: the step's
    :math:`\sqrt{1-\beta_2^t}`). ``cbar`` is a float or, from
    :func:`column_mean`, a 0-dim fp32 tensor; then its zero test is a
    ``torch.where`` on the device, not a read on the host."""
    r, c = factors[:rows], factors[rows:]
    if isinstance(cbar, Tensor):
        a = torch.where(cbar == 0, 0.0, (r / cbar).sqrt() / sqrt_bc2)
    elif cbar == 0.0:
        a = torch.zeros_like(r)
    else:
        divisor = torch.tensor(cbar, dtype=torch.float32, device=factors.device)
        a = (r / divisor).sqrt() / sqrt_bc2
    return a, c.sqrt()


def factored_denominator(
    a: Tensor, b: Tensor, eps: float, start: int, end: int
) -> Tensor:
    """The update's denominators of flat elements ``[start, end)``:
    ``a[i] * b[j] + eps`` in fp32 (``a``, ``b`` from :func:`denominator_factors`)."""
    cols = b.numel()
    index = torch.arange(start, end, device=a.device)
    return (a[index // cols] * b[index % cols]).add_(eps)
