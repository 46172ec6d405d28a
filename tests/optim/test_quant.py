"""Block statistics, exact nearest-code lookup, block (de)quantization, nibbles."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leantrain.optim import quant
from leantrain.optim.codebook import histogram, learn_codebook
from leantrain.optim.quant import (
    NearestCode,
    block_absmax,
    block_mean_square,
    dequantize_blockwise,
    pack_nibbles,
    quantize_blockwise,
    unpack_nibbles,
)


def nearest_reference(u: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """argmin_j |u - c_j| in exact rational arithmetic, ties to the lower code.

    float64 distances can round (u = 1e-45 against codes +-1), so they only pick
    the three candidate codes; exact fractions decide among them.
    """
    uc = u.double().clamp(-1, 1)
    c = codebook.double()
    rough = (uc[:, None] - c[None, :]).abs().argmin(1)
    codes = [Fraction(v) for v in c.tolist()]
    out = []
    for value, j in zip(uc.tolist(), rough.tolist(), strict=True):
        exact = Fraction(value)
        cands = range(max(0, j - 1), min(len(codes), j + 2))
        out.append(min(cands, key=lambda i: (abs(exact - codes[i]), i)))
    return torch.tensor(out)


def codebook_with_close_codes(seed: int, k: int, eps: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    inner = torch.sort(torch.rand(k - 2, generator=g) * 2 - 1).values
    inner[1::3] = inner[0::3][: inner[1::3].numel()] + eps  # near-duplicate codes
    codes = torch.unique(torch.cat([torch.tensor([-1.0, 1.0]), inner.clamp(-1, 1)]))
    return codes


def probe_values(codebook: torch.Tensor, seed: int) -> torch.Tensor:
    """Random values plus every midpoint and its fp32 neighbours, -1, 0, +1."""
    c = codebook.double()
    mids = ((c[1:] + c[:-1]) / 2).float()
    up = torch.nextafter(mids, torch.tensor(2.0))
    down = torch.nextafter(mids, torch.tensor(-2.0))
    g = torch.Generator().manual_seed(seed)
    rand = torch.rand(2000, generator=g) * 2 - 1
    special = torch.tensor([-1.0, 0.0, 1.0, -0.0, 1e-30, -1e-30])
    return torch.cat([rand, mids, up, down, codebook, special])


# ------------------------------------------------------------- nearest code
@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    k=st.sampled_from([2, 3, 16, 100, 256]),
    eps=st.sampled_from([1e-7, 1e-5, 1e-3, 0.1]),
)
def test_nearest_code_is_exact(seed, k, eps):
    cb = codebook_with_close_codes(seed, k, eps)
    nearest = NearestCode(cb)
    u = probe_values(cb, seed)
    got = nearest(u)
    assert got.dtype == torch.uint8
    torch.testing.assert_close(got.long(), nearest_reference(u, cb), rtol=0, atol=0)


def test_nearest_code_on_learned_codebooks_uses_one_comparison():
    torch.manual_seed(0)
    g = torch.randn(128, 256) * torch.rand(128, 1)
    for k in (16, 256):
        cb = learn_codebook(histogram(g, 256), k)
        nearest = NearestCode(cb)
        assert nearest.steps == 1 and nearest.grid <= 64 * k
        u = probe_values(cb, k)
        assert torch.equal(nearest(u).long(), nearest_reference(u, cb))


def test_kernel_entry_table_is_exact_on_learned_codebooks():
    """The C kernel's one-load table (count << 32 | bits of mid[count]) of the
    cell gives the exact nearest value with one comparison."""
    from leantrain.optim._quant_table import build_table, cell_index

    torch.manual_seed(1)
    g = torch.randn(64, 512) * torch.rand(64, 1)
    for k in (16, 256):
        cb = learn_codebook(histogram(g, 512), k)
        table = build_table(cb)
        assert table.steps == 1 and table.entry.dtype == torch.int64
        u = probe_values(cb, k).clamp(-1, 1)
        e = table.entry[cell_index(u, table.entry.numel())]
        mid = (e & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
        j = (e >> 32) + (u > mid).long()
        assert torch.equal(table.first.long()[j], nearest_reference(u, cb))


def test_stochastic_interval_table_is_exact_on_learned_codebooks():
    """The AVX-512 kernel's interval table for stochastic 8-bit codes (count << 32
    | bits of the number below the cell's own value) gives the lower end
    #{j >= 1 : x >= u_j} of x's interval with one comparison, and upad pairs each
    value with the next."""
    from leantrain.optim._quant_table import build_table, cell_index

    torch.manual_seed(1)
    g = torch.randn(64, 512) * torch.rand(64, 1)
    for k in (16, 256):
        cb = learn_codebook(histogram(g, 512), k)
        table = build_table(cb)
        assert table.sr_steps == 1 and table.sr_entry.dtype == torch.int64
        u = table.uniq
        x = torch.cat(
            [
                probe_values(cb, k).clamp(-1, 1),
                torch.nextafter(u, torch.tensor(-2.0)),
                torch.nextafter(u, torch.tensor(2.0)),
                torch.tensor([float("nan")]),
            ]
        )
        e = table.sr_entry[cell_index(x, table.sr_entry.numel())]
        thr = (e & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
        i = (e >> 32) + (x > thr).long()
        assert torch.equal(i, (x[:, None] >= u[None, 1:]).sum(1))
        assert torch.equal(table.upad[:-1], u) and table.upad[-1] == float("inf")


def test_nearest_code_exact_ties_go_low():
    cb = torch.tensor([-1.0, -0.5, 0.0, 0.5, 1.0])
    u = torch.tensor([-0.75, -0.25, 0.25, 0.75, 0.2500001, 1.5, -1.5])
    assert NearestCode(cb)(u).tolist() == [0, 1, 2, 3, 3, 4, 0]


def test_nearest_code_attributes_describe_the_grid():
    nearest = NearestCode(torch.linspace(-1, 1, 16))
    assert nearest.lut.dtype == torch.int64 and nearest.lut.numel() == nearest.grid
    u = torch.linspace(-1, 1, 1001)
    cell = (u * nearest.scale + nearest.offset).floor().clamp(0, nearest.grid - 1)
    lut = nearest.lut[cell.long()]
    codes = nearest(u).long()
    assert torch.all((codes == lut) | (codes == lut + 1))


@pytest.mark.parametrize(
    ("codebook", "error"),
    [
        (torch.tensor([-1.0]), ValueError),
        (torch.linspace(-1, 1, 257), ValueError),
        (torch.tensor([-1.0, 0.5, 0.5, 1.0]), ValueError),
        (torch.tensor([-1.0, 2.0]), ValueError),
        (torch.ones(2, 2), TypeError),
    ],
)
def test_nearest_code_rejects_bad_codebooks(codebook, error):
    with pytest.raises(error):
        NearestCode(codebook)


# --------------------------------------------------------------- block stats
def blocks_of(x: torch.Tensor, period: int) -> list[torch.Tensor]:
    return list(x.split(period))


@pytest.mark.parametrize(("n", "period"), [(1000, 100), (1003, 100), (7, 10), (5, 1)])
def test_block_absmax_and_mean_square(n, period):
    torch.manual_seed(n)
    x = torch.randn(n)
    am = block_absmax(x, period)
    ms = block_mean_square(x, period)
    ref_am = torch.stack([b.abs().max() for b in blocks_of(x, period)])
    ref_ms = torch.stack([(b.double() ** 2).mean() for b in blocks_of(x, period)])
    assert am.dtype == torch.float32 and torch.equal(am, ref_am)
    assert ms.dtype == torch.float32
    torch.testing.assert_close(ms.double(), ref_ms, rtol=1e-6, atol=0)


def test_block_stats_in_small_chunks(monkeypatch):
    torch.manual_seed(3)
    x = torch.randn(1001, dtype=torch.bfloat16)
    expected = block_mean_square(x, 37), block_absmax(x, 37)
    monkeypatch.setattr(quant, "CHUNK_ELEMENTS", 16)  # also blocks longer than chunks
    for period in (37, 5):
        ref = torch.stack([(b.double() ** 2).mean() for b in blocks_of(x, period)])
        torch.testing.assert_close(
            block_mean_square(x, period).double(), ref, rtol=1e-6, atol=0
        )
    torch.testing.assert_close(block_mean_square(x, 37), expected[0])
    assert torch.equal(block_absmax(x, 37), expected[1])


# ------------------------------------------------------- (de)quantization
@pytest.mark.parametrize("k", [16, 256])
@pytest.mark.parametrize(("n", "period"), [(5000, 256), (5003, 100), (300, 1000)])
def test_quantize_matches_reference(monkeypatch, k, n, period):
    monkeypatch.setattr(quant, "CHUNK_ELEMENTS", 512)  # several chunks
    torch.manual_seed(k + n)
    x = torch.randn(n) * torch.rand(n)
    x[:period] = 0.0  # one all-zero block
    cb = learn_codebook(histogram(x, period), k)
    nearest = NearestCode(cb)
    codes, absmax = quantize_blockwise(x, period, nearest)
    assert codes.dtype == torch.uint8 and codes.shape == (n,)
    ref_codes = []
    for b in blocks_of(x, period):
        a = b.abs().max()
        u = b / a if a > 0 else b
        ref_codes.append(nearest_reference(u, cb))
    assert torch.equal(codes.long(), torch.cat(ref_codes))
    assert torch.equal(absmax, block_absmax(x, period))
    deq = dequantize_blockwise(codes, absmax, period, cb)
    assert deq.dtype == torch.float32
    ref = torch.cat(
        [
            cb[c] * a
            for c, a in zip(blocks_of(codes.long(), period), absmax, strict=True)
        ]
    )
    assert torch.equal(deq, ref)
    assert torch.all(deq[:period] == 0)  # zero block round-trips to zero
    # The block absmax element round-trips exactly.
    for b, d in zip(blocks_of(x, period), blocks_of(deq, period), strict=True):
        i = int(b.abs().argmax())
        assert d[i] == b[i]


def test_quantize_error_is_bounded_by_half_the_widest_gap():
    torch.manual_seed(5)
    x = torch.randn(4096)
    cb = learn_codebook(histogram(x, 512), 256)
    codes, absmax = quantize_blockwise(x, 512, NearestCode(cb))
    err = (dequantize_blockwise(codes, absmax, 512, cb) - x).abs().view(8, 512)
    half_gap = float((cb[1:] - cb[:-1]).max()) / 2
    assert torch.all(err.max(1).values <= absmax * half_gap * (1 + 1e-6))


def test_quantize_rejects_nan_and_bad_arguments():
    nearest = NearestCode(torch.linspace(-1, 1, 16))
    with pytest.raises(ValueError):
        quantize_blockwise(torch.tensor([1.0, float("nan")]), 2, nearest)
    with pytest.raises(TypeError):
        quantize_blockwise(torch.ones(4), 2, torch.linspace(-1, 1, 16))
    with pytest.raises(ValueError):
        quantize_blockwise(torch.ones(4), 0, nearest)
    with pytest.raises(ValueError):
        quantize_blockwise(torch.ones(2, 2), 2, nearest)
    with pytest.raises(ValueError):
        codes = torch.zeros(10, dtype=torch.uint8)
        dequantize_blockwise(codes, torch.ones(2), 4, torch.linspace(-1, 1, 16))


# --------------------------------------------------------------- nibbles
@pytest.mark.parametrize("n", [0, 1, 2, 7, 1000, 1001])
def test_nibbles_round_trip_and_layout(n):
    torch.manual_seed(n)
    codes = torch.randint(0, 16, (n,), dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.dtype == torch.uint8 and packed.shape == ((n + 1) // 2,)
    assert torch.equal(unpack_nibbles(packed, n), codes)
    p = packed.numpy().astype(np.int64)
    c = codes.numpy().astype(np.int64)
    assert np.array_equal(p & 15, c[0::2])
    assert np.array_equal(p[: n // 2] >> 4, c[1::2])
    if n % 2:
        assert p[-1] >> 4 == 0


def test_nibbles_reject_bad_input():
    with pytest.raises(ValueError):
        pack_nibbles(torch.tensor([16], dtype=torch.uint8))
    with pytest.raises(TypeError):
        pack_nibbles(torch.tensor([1, 2]))
    with pytest.raises(ValueError):
        unpack_nibbles(torch.zeros(3, dtype=torch.uint8), 7)
