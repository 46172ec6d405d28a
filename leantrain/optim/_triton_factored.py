r"""The factored second moment's factors on the GPU: three small Triton kernels.

A factored state (``factored.py``) needs the column means of the whole
:math:`g^2` before any element's update, so these run before the step kernel
(``_triton_kernels.gefen_step_kernel``), each over all factored jobs of a step:

1. ``factor_rows_kernel``: one program per (chunk of rows, tile of columns):
   float64 sums of :math:`g^2` along the rows of the tile and down the columns of
   the chunk, into scratch;
2. ``factor_cols_kernel``: one program per tile of columns: the column means
   from the chunks' sums, ``c = fma(1 - beta2, mean, c * beta2)``,
   ``b = sqrt(c)``, and the tile's float64 sum of ``c``;
3. ``factor_a_kernel``: one program per tile of rows: the row means,
   ``r = fma(1 - beta2, mean, r * beta2)``, ``cbar`` (the tiles' sums of ``c``
   over C, rounded once to fp32, as ``factored.mean_column``) and
   ``a = sqrt(r / cbar) / sqrt(1 - beta2^t)`` (0 while ``cbar`` is 0).

Deterministic (no atomics: every sum has a fixed order), and the same roundings
as ``factored.denominator_factors``. The step kernel then reads
``a[i] * b[j] + eps`` per element.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._triton_kernels import N_HYPER, _c, _find_job, _fma

# Columns of the factored jobs' table.
F_GRAD = _c(0)
F_V = _c(1)
F_ROWS = _c(2)
F_COLS = _c(3)
F_A = _c(4)
F_B = _c(5)
F_COLPART = _c(6)
F_ROWPART = _c(7)
F_CPART = _c(8)
F_CHUNK_ROWS = _c(9)
F_NCHUNK = _c(10)
F_NCT = _c(11)
F_JOB = _c(12)
FACTOR_FIELDS = _c(13)


@triton.jit
def factor_rows_kernel(
    fjobs,
    starts,
    njobs,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    LOG_JOBS: tl.constexpr,
    G_DTYPE: tl.constexpr,
):
    """Sums of g^2 (float64) over one chunk of rows x one tile of columns of one
    factored gradient: the chunk's column sums and the tile's row sums, into
    scratch (colpart[chunk, col], rowpart[tile, row])."""
    pid = tl.program_id(0).to(tl.int64)
    j = _find_job(starts, pid, njobs, LOG_JOBS)
    fj = fjobs + j * FACTOR_FIELDS
    rows = tl.load(fj + F_ROWS)
    cols = tl.load(fj + F_COLS)
    nct = tl.load(fj + F_NCT)
    local = pid - tl.load(starts + j)
    chunk = local // nct
    tile = local % nct
    chunk_rows = tl.load(fj + F_CHUNK_ROWS)
    r0 = chunk * chunk_rows
    r1 = tl.minimum(r0 + chunk_rows, rows)
    c = tile * COLS + tl.arange(0, COLS).to(tl.int64)
    cok = c < cols
    grad = tl.load(fj + F_GRAD).to(tl.pointer_type(G_DTYPE), bitcast=True)
    rowpart = tl.load(fj + F_ROWPART).to(tl.pointer_type(tl.float64), bitcast=True)
    col_sum = tl.zeros((COLS,), dtype=tl.float64)
    start = r0
    while start < r1:
        r = start + tl.arange(0, ROWS).to(tl.int64)
        rok = r < r1
        ok = rok[:, None] & cok[None, :]
        g = tl.load(grad + r[:, None] * cols + c[None, :], mask=ok, other=0.0)
        g = g.to(tl.float32)
        sq = (g * g).to(tl.float64)
        col_sum += tl.sum(sq, axis=0)
        tl.store(rowpart + tile * rows + r, tl.sum(sq, axis=1), mask=rok)
        start += ROWS
    colpart = tl.load(fj + F_COLPART).to(tl.pointer_type(tl.float64), bitcast=True)
    tl.store(colpart + chunk * cols + c, col_sum, mask=cok)


@triton.jit
def factor_cols_kernel(
    fjobs,
    hypers,
    starts,
    njobs,
    COLS: tl.constexpr,
    LOG_JOBS: tl.constexpr,
    EXACT: tl.constexpr,
):
    """One tile of columns of one factored job: c = fma(1 - beta2, mean, c * beta2),
    b = sqrt(c), and the tile's float64 sum of c (for cbar)."""
    pid = tl.program_id(0).to(tl.int64)
    j = _find_job(starts, pid, njobs, LOG_JOBS)
    fj = fjobs + j * FACTOR_FIELDS
    hyp = hypers + tl.load(fj + F_JOB) * N_HYPER
    rows = tl.load(fj + F_ROWS)
    cols = tl.load(fj + F_COLS)
    tile = pid - tl.load(starts + j)
    c = tile * COLS + tl.arange(0, COLS).to(tl.int64)
    cok = c < cols
    colpart = tl.load(fj + F_COLPART).to(tl.pointer_type(tl.float64), bitcast=True)
    total = tl.zeros((COLS,), dtype=tl.float64)
    nchunk = tl.load(fj + F_NCHUNK)
    chunk = nchunk * 0
    while chunk < nchunk:
        total += tl.load(colpart + chunk * cols + c, mask=cok, other=0.0)
        chunk += 1
    mean = (total / rows.to(tl.float64)).to(tl.float32)
    v = tl.load(fj + F_V).to(tl.pointer_type(tl.float32), bitcast=True)
    factor = tl.load(v + rows + c, mask=cok, other=0.0)
    factor = _fma(tl.load(hyp + 2), mean, factor * tl.load(hyp + 1), EXACT)
    tl.store(v + rows + c, factor, mask=cok)
    b = tl.load(fj + F_B).to(tl.pointer_type(tl.float32), bitcast=True)
    tl.store(b + c, tl.sqrt_rn(factor), mask=cok)
    cpart = tl.load(fj + F_CPART).to(tl.pointer_type(tl.float64), bitcast=True)
    tl.store(cpart + tile, tl.sum(tl.where(cok, factor, 0.0).to(tl.float64)))


@triton.jit
def factor_a_kernel(
    fjobs,
    hypers,
    starts,
    njobs,
    ROWS: tl.constexpr,
    LOG_JOBS: tl.constexpr,
    EXACT: tl.constexpr,
):
    """One tile of rows of one factored job: r = fma(1 - beta2, mean, r * beta2)
    and a = sqrt(r / cbar) / sqrt(bc2) (0 while cbar is 0), with cbar the mean of
    the new column factor summed in float64 and rounded once (factored.py)."""
    pid = tl.program_id(0).to(tl.int64)
    j = _find_job(starts, pid, njobs, LOG_JOBS)
    fj = fjobs + j * FACTOR_FIELDS
    hyp = hypers + tl.load(fj + F_JOB) * N_HYPER
    rows = tl.load(fj + F_ROWS)
    cols = tl.load(fj + F_COLS)
    tile = pid - tl.load(starts + j)
    cpart = tl.load(fj + F_CPART).to(tl.pointer_type(tl.float64), bitcast=True)
    csum = tl.zeros((), dtype=tl.float64)
    nct = tl.load(fj + F_NCT)
    t = nct * 0
    while t < nct:
        csum += tl.load(cpart + t)
        t += 1
    cbar = (csum / cols.to(tl.float64)).to(tl.float32)
    r = tile * ROWS + tl.arange(0, ROWS).to(tl.int64)
    rok = r < rows
    rowpart = tl.load(fj + F_ROWPART).to(tl.pointer_type(tl.float64), bitcast=True)
    total = tl.zeros((ROWS,), dtype=tl.float64)
    t = nct * 0
    while t < nct:
        total += tl.load(rowpart + t * rows + r, mask=rok, other=0.0)
        t += 1
    mean = (total / cols.to(tl.float64)).to(tl.float32)
    v = tl.load(fj + F_V).to(tl.pointer_type(tl.float32), bitcast=True)
    factor = tl.load(v + r, mask=rok, other=0.0)
    factor = _fma(tl.load(hyp + 2), mean, factor * tl.load(hyp + 1), EXACT)
    tl.store(v + r, factor, mask=rok)
    live = cbar != 0.0
    a = tl.math.div_rn(
        tl.sqrt_rn(tl.math.div_rn(factor, tl.where(live, cbar, 1.0))), tl.load(hyp + 5)
    )
    a_ptr = tl.load(fj + F_A).to(tl.pointer_type(tl.float32), bitcast=True)
    tl.store(a_ptr + r, tl.where(live, a, 0.0), mask=rok)
