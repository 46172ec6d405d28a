"""Automatic block periods: structure kept, alignment, memory floor."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leantrain.optim.partition import (
    candidate_periods,
    choose_period,
    describe_partition,
    period_floor,
    score_periods,
    state_nbytes,
)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def row_scaled(rows: int, cols: int, seed: int, spread: float = 2.0) -> torch.Tensor:
    g = gen(seed)
    scale = torch.exp(spread * torch.randn(rows, 1, generator=g))
    return torch.randn(rows, cols, generator=g) * scale


def group_scaled(rows: int, cols: int, group: int, seed: int) -> torch.Tensor:
    """Rows in consecutive groups of ``group`` share one scale (heads, q/k/v)."""
    g = gen(seed)
    scale = torch.exp(1.5 * torch.randn(rows // group, 1, generator=g))
    return torch.randn(rows, cols, generator=g) * scale.repeat_interleave(group, 0)


def max_overhead(n: int) -> float:
    """Per-parameter bytes the floor allows on top of the codes (8-bit)."""
    return 8 * math.ceil(n / period_floor(n, 256, 16384)) / n


def assert_floor(g: torch.Tensor, p: int) -> None:
    n = g.numel()
    assert 1 < p <= n or n == 1
    assert state_nbytes(n, p) / n <= 1 + max_overhead(n) + 1e-12


# ------------------------------------------------- the synthetic structures
def test_row_scales_give_one_block_per_row():
    g = row_scaled(64, 256, 0)
    p = choose_period(g)
    assert 256 % p == 0  # every block within one row
    assert p == 256  # ... and not split further
    assert_floor(g, p)


def test_column_scales_give_large_row_aligned_blocks():
    r = gen(1)
    g = torch.randn(64, 256, generator=r) * torch.exp(
        2 * torch.randn(1, 256, generator=r)
    )
    p = choose_period(g)
    assert p % 256 == 0 and p >= 4096  # whole rows; no contiguous split helps


def test_iid_gives_large_blocks():
    g = torch.randn(64, 256, generator=gen(2))
    assert choose_period(g) == g.numel()
    big = torch.randn(1024, 1024, generator=gen(2))
    assert choose_period(big) == 16384  # capped at max_block


@pytest.mark.parametrize("shape", [(256, 1024), (1000, 64)])
def test_embedding_with_zero_rows(shape):
    g = torch.randn(*shape, generator=gen(3))
    g[torch.rand(shape[0], generator=gen(4)) < 0.7] = 0.0
    p = choose_period(g)
    cands = candidate_periods(shape)
    if shape[1] >= period_floor(g.numel(), 256, 16384):
        assert shape[1] % p == 0  # rows fit the floor: blocks within one row
    else:
        assert p % shape[1] == 0 and p <= 2 * cands[0]  # fine row-aligned blocks
    assert_floor(g, p)


@pytest.mark.parametrize("n", [30, 128, 4096, 10007])
def test_one_dimensional_and_prime_sizes_are_never_per_element(n):
    g = torch.randn(n, generator=gen(n))
    p = choose_period(g)
    assert p >= min(n, 256)
    assert p == n  # unstructured: one block (n <= max_block)
    assert_floor(g, p)


def test_large_prime_one_dimensional_tensor_gets_large_blocks():
    n = 100003
    p = choose_period(torch.randn(n, generator=gen(5)))
    assert 8192 <= p <= 16384


def test_large_row_scaled_matrix_keeps_rows():
    g = row_scaled(1024, 4096, 6, spread=1.0)
    p = choose_period(g)
    assert 4096 % p == 0 and p >= 2048
    assert_floor(g, p)


@pytest.mark.parametrize(("rows", "cols"), [(64, 64), (512, 128)])
def test_eight_row_heads(rows, cols):
    g = group_scaled(rows, cols, 8, 7)
    p = choose_period(g)
    assert p == 8 * cols  # one block per head: never straddles one, not split
    assert p >= period_floor(g.numel(), 256, 16384)


@pytest.mark.parametrize("d", [64, 128])
def test_fused_qkv_blocks_never_straddle(d):
    r = gen(8)
    scale = torch.tensor([1.0, 10.0, 0.1]).repeat_interleave(d)[:, None]
    g = torch.randn(3 * d, d, generator=r) * scale
    p = choose_period(g)
    third = d * d
    assert third % p == 0  # no block crosses the q/k or k/v boundary
    assert p == min(third, 16384)  # and the three thirds are found
    assert_floor(g, p)


def test_fused_qkv_with_row_scales_keeps_finer_structure():
    d = 128
    g = (
        row_scaled(3 * d, d, 9)
        * torch.tensor([1.0, 10.0, 0.1]).repeat_interleave(d)[:, None]
    )
    p = choose_period(g)
    assert (d * d) % p == 0 and p % d == 0  # rows, never straddling q/k/v
    assert p <= 8 * d  # the row structure is kept, not just the thirds


def test_head_of_ten_rows_is_row_aligned():
    """The authors' rule cut a 10x512 head at p = 40."""
    g = row_scaled(10, 512, 10)
    p = choose_period(g)
    assert 512 % p == 0 or p % 512 == 0


# ------------------------------------------------------------------ general
@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 300),
    cols=st.integers(1, 300),
    structure=st.sampled_from(["iid", "rows", "zeros"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_aligned_and_above_the_floor(rows, cols, structure, seed):
    g = torch.randn(rows, cols, generator=gen(seed))
    if structure == "rows":
        g = row_scaled(rows, cols, seed)
    elif structure == "zeros":
        g[torch.rand(rows, generator=gen(seed)) < 0.5] = 0.0
    n = g.numel()
    p = choose_period(g)
    assert period_floor(n, 256, 16384) <= p <= n
    if cols > 1:
        assert p % cols == 0 or cols % p == 0
    assert_floor(g, p)
    assert choose_period(g) == p  # deterministic
    assert choose_period(g * 1e-6) == p  # scale-free


def test_scores_are_nested():
    """Blocks of p refine those of its multiples: finer explains at least as much."""
    g = row_scaled(96, 64, 11)
    s = score_periods(g, [256, 512, 1024, 2048, 6144])
    assert s[256] >= s[512] - 1e-3 >= s[1024] - 2e-3 >= s[2048] - 3e-3
    assert s[6144] == 0.0


def test_all_zero_gradient_is_one_large_block():
    assert choose_period(torch.zeros(64, 256)) == 16384


# ------------------------------------------------------------------- memory
def gpt_shapes(d: int, layers: int, vocab: int, ctx: int) -> dict[str, tuple]:
    shapes = {"wte": (vocab, d), "wpe": (ctx, d), "head": (vocab, d), "ln_f": (d,)}
    for i in range(layers):
        shapes |= {
            f"{i}.ln1.w": (d,),
            f"{i}.ln1.b": (d,),
            f"{i}.qkv.w": (3 * d, d),
            f"{i}.qkv.b": (3 * d,),
            f"{i}.proj.w": (d, d),
            f"{i}.proj.b": (d,),
            f"{i}.ln2.w": (d,),
            f"{i}.ln2.b": (d,),
            f"{i}.fc.w": (4 * d, d),
            f"{i}.fc.b": (4 * d,),
            f"{i}.out.w": (d, 4 * d),
            f"{i}.out.b": (d,),
        }
    return shapes


MODELS = {
    "mlp": {
        "w1": (512, 64),
        "b1": (512,),
        "w2": (512, 512),
        "b2": (512,),
        "w3": (10, 512),
        "b3": (10,),
    },
    "gpt128": gpt_shapes(128, 3, 65, 64),
    "gpt256": gpt_shapes(256, 4, 256, 128),
}


@pytest.mark.parametrize("model", sorted(MODELS))
def test_memory_floor_on_small_models(model):
    """Worst case: every tensor row-structured, so each takes its finest period."""
    grads = {
        name: row_scaled(*shape, seed=i)
        if len(shape) == 2
        else torch.randn(shape, generator=gen(i)) * torch.linspace(0.01, 1, shape[0])
        for i, (name, shape) in enumerate(MODELS[model].items())
    }
    n = sum(g.numel() for g in grads.values())
    assert 1e5 <= n <= 3.5e6
    for bits, limit in ((8, 1.02), (4, 0.56)):
        rows = describe_partition(grads, momentum_bits=bits)
        total = sum(r["bytes_per_param"] * r["numel"] for r in rows) + 4 * 2**bits
        assert total / n <= limit, (bits, total / n)


def test_describe_partition_rows():
    grads = [("w", row_scaled(64, 256, 0)), ("b", torch.randn(64, generator=gen(0)))]
    rows = describe_partition(grads)
    assert [r["name"] for r in rows] == ["w", "b"]
    w, b = rows
    assert w["shape"] == (64, 256) and w["period"] == 256 and w["n_blocks"] == 64
    assert w["bytes_per_param"] == pytest.approx(1 + 8 * 64 / 16384)
    assert b["period"] == 64 and b["n_blocks"] == 1
    assert describe_partition(dict(grads))[0] == w


def test_state_nbytes():
    assert state_nbytes(1000, 100) == 1000 + 80
    assert state_nbytes(1001, 100, 4) == 501 + 88
    assert state_nbytes(1000, 1) == 1000 + 4 * 4 + 4000  # qblock 256 when p == 1
    assert state_nbytes(10, 5, None) == 40 + 8
    with pytest.raises(ValueError):
        state_nbytes(10, 5, 3)


@pytest.mark.parametrize(
    ("args", "kwargs", "error"),
    [
        ((torch.arange(10),), {}, TypeError),
        (([1.0, 2.0],), {}, TypeError),
        ((torch.randn(10),), {"min_block": 0}, ValueError),
        ((torch.randn(10),), {"min_block": 64, "max_block": 32}, ValueError),
        ((torch.randn(10),), {"max_block": 2.5}, TypeError),
        ((torch.tensor([1.0, float("nan")] * 300),), {}, ValueError),
    ],
)
def test_bad_input(args, kwargs, error):
    with pytest.raises(error):
        choose_period(*args, **kwargs)
