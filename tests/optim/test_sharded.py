"""The sharded step and the reducible period rule, with ranks simulated in-process.

Every rank's range of the flattened tensor is processed on its own; the "collective"
is a plain sum / max over the simulated ranks. Independent references: the
single-process ``reference_step`` and ``partition.choose_period``.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leantrain.optim import _reducible_partition as rp
from leantrain.optim._sharded import (
    Span,
    begin_step,
    block_window,
    finish_step,
    local_histogram,
    new_local_state,
    partial_absmax,
    shared_blocks,
)
from leantrain.optim._state import new_state, qblock_for
from leantrain.optim._step import reference_step
from leantrain.optim.codebook import histogram, learn_codebook, with_exact_zero
from leantrain.optim.partition import choose_period
from leantrain.optim.quant import block_absmax, unpack_nibbles

HYPER = {"lr": 0.01, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.1}


def spans_of(cuts: list[int], n: int) -> list[Span]:
    return [Span(a, b, n) for a, b in zip(cuts, cuts[1:], strict=False)]


def simulated_step(flat, grad, states, spans, period, qblock, **rounding):
    """One step on every simulated rank around a global SUM / MAX of partials
    (``rounding``: finish_step's stochastic_codes and seed)."""
    begun = [
        begin_step(grad[s.start : s.stop], state, s, beta1=0.9, maximize=False)
        for s, state in zip(spans, states, strict=True)
    ]
    n = flat.numel()
    sums = torch.zeros(-(-n // period))
    maxes = torch.zeros(-(-n // qblock))
    for s, (_, sq, _, amax) in zip(spans, begun, strict=True):
        b0, b1 = block_window(s, period)
        sums[b0:b1] += sq
        if amax is not None:
            q0, q1 = block_window(s, qblock)
            maxes[q0:q1] = torch.maximum(maxes[q0:q1], amax)
    for s, state, (g, _, m, amax) in zip(spans, states, begun, strict=True):
        b0, b1 = block_window(s, period)
        q0, q1 = block_window(s, qblock)
        reduced = None if amax is None else maxes[q0:q1].clone()
        finish_step(
            flat[s.start : s.stop],
            state,
            s,
            g,
            sums[b0:b1].clone(),
            m,
            reduced,
            **HYPER,
            **rounding,
        )


@pytest.mark.parametrize("bits", [8, 4, None])
@pytest.mark.parametrize("period", [1, 7, 20, 130])
def test_sharded_step_matches_reference(bits, period):
    torch.manual_seed(period)
    shape, n = (13, 10), 130
    spans = spans_of([0, 40, 41, 90, 90, 130], n)  # odd cuts, an empty rank
    qblock = qblock_for(period)
    g0 = torch.randn(shape)
    codebook = None
    if bits:
        codebook = with_exact_zero(
            learn_codebook(histogram(g0, qblock), 2**bits).float()
        )
    ref = torch.randn(shape)
    flat = ref.clone().reshape(-1)
    ref_state = new_state(ref, period, bits, codebook)
    states = [
        new_local_state(flat[s.start : s.stop], s, period, bits, codebook)
        for s in spans
    ]
    for it in range(6):
        grad = g0 if it == 0 else torch.randn(shape)
        reference_step(ref, grad, ref_state, maximize=False, **HYPER)
        simulated_step(flat, grad.reshape(-1), states, spans, period, qblock)
        # shared blocks hold the same value on every rank that holds them
        for s, state in zip(spans, states, strict=True):
            b0, b1 = block_window(s, period)
            torch.testing.assert_close(
                state["exp_avg_sq"], ref_state["exp_avg_sq"][b0:b1], rtol=1e-6, atol=0
            )
    torch.testing.assert_close(flat.view(shape), ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("period", [1, 7, 130])
def test_sharded_stochastic_codes_match_reference(period, bits):
    """Codes rounded stochastically (4-bit, and 8-bit with momentum_rounding=
    "stochastic"): every rank draws its elements' global bits, so the concatenated
    shards hold the reference's codes."""
    torch.manual_seed(period)
    shape, n = (13, 10), 130
    spans = spans_of([0, 40, 41, 90, 90, 130], n)
    qblock = qblock_for(period)
    g0 = torch.randn(shape)
    codebook = learn_codebook(histogram(g0, qblock), 2**bits).float()
    ref = torch.randn(shape)
    flat = ref.clone().reshape(-1)
    ref_state = new_state(ref, period, bits, codebook)
    states = [
        new_local_state(flat[s.start : s.stop], s, period, bits, codebook)
        for s in spans
    ]
    rounding = {"stochastic_codes": True, "seed": 3}
    for it in range(6):
        grad = g0 if it == 0 else torch.randn(shape)
        reference_step(ref, grad, ref_state, maximize=False, **HYPER, **rounding)
        simulated_step(
            flat, grad.reshape(-1), states, spans, period, qblock, **rounding
        )

        def unpack(codes, count):
            return unpack_nibbles(codes, count) if bits == 4 else codes

        codes = torch.cat(
            [
                unpack(st["exp_avg_codes"], s.stop - s.start)
                for s, st in zip(spans, states, strict=True)
            ]
        )
        assert torch.equal(codes, unpack(ref_state["exp_avg_codes"], n))
    torch.testing.assert_close(flat.view(shape), ref, rtol=1e-6, atol=1e-7)


def test_shared_blocks_are_the_straddling_ones():
    spans = spans_of([0, 40, 41, 90, 90, 130], 130)
    # block 2 = [40, 60) holds the cut at 41, block 4 = [80, 100) the cut at 90
    assert shared_blocks(spans, 20) == [2, 4]
    assert shared_blocks(spans, 130) == [0]
    assert shared_blocks(spans, 1) == []


def test_local_histograms_add_up_to_the_global_one():
    torch.manual_seed(0)
    x = torch.randn(1000) * torch.rand(1000)
    spans = spans_of([0, 333, 334, 1000], 1000)
    for q in (7, 256, 1000):
        absmax = block_absmax(x, q)
        total = torch.zeros(4096, dtype=torch.float64)
        for s in spans:
            b0, b1 = block_window(s, q)
            part = partial_absmax(x[s.start : s.stop], s, q)
            assert bool((part <= absmax[b0:b1]).all())
            total += local_histogram(x[s.start : s.stop], s, q, absmax[b0:b1], 4096)
        assert torch.equal(total, histogram(x, q))


def structured(kind: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == 0:  # row scales
        return torch.randn(64, 256, generator=g) * torch.exp(
            2 * torch.randn(64, 1, generator=g)
        )
    if kind == 1:  # 8-row heads
        scale = torch.exp(1.5 * torch.randn(12, 1, generator=g)).repeat_interleave(8, 0)
        return torch.randn(96, 64, generator=g) * scale
    if kind == 2:  # embedding with zero rows
        x = torch.randn(300, 40, generator=g)
        x[torch.rand(300, generator=g) < 0.7] = 0.0
        return x
    if kind == 3:  # fused qkv thirds
        scale = torch.tensor([1.0, 30.0, 0.05]).repeat_interleave(32)[:, None]
        return torch.randn(96, 48, generator=g) * scale
    return torch.randn(1000 + seed, generator=g)  # 1-D, any size


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 4), st.integers(0, 10_000))
def test_reducible_rule_picks_partitions_period(kind, seed):
    g = structured(kind, seed)
    assert rp.choose_period(g, tuple(g.shape)) == choose_period(g)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 4), st.integers(0, 10_000), st.integers(2, 5))
def test_reducible_rule_is_exactly_sharding_invariant(kind, seed, world):
    g = structured(kind, seed)
    flat = g.reshape(-1)
    n = flat.numel()
    gen = torch.Generator().manual_seed(seed)
    cuts = sorted({0, n, *torch.randint(0, n, (world - 1,), generator=gen).tolist()})
    spans = spans_of(cuts, n)
    whole = rp.square_sum_parts(flat)
    parts = sum(rp.square_sum_parts(flat[s.start : s.stop]) for s in spans)
    assert torch.equal(parts, whole)
    unit, tiny, centre = 37, 1e-9, 0.5
    pieces = sum(
        rp.unit_sums(flat[s.start : s.stop], s.start, n, unit, tiny, centre)
        for s in spans
    )
    assert torch.equal(pieces, rp.unit_sums(flat, 0, n, unit, tiny, centre))
    # the period itself: one thread per simulated rank, all_reduce by a barrier
    results = simulate_ranks(
        lambda s, reduce_sum: rp.choose_period(
            flat[s.start : s.stop], tuple(g.shape), s.start, reduce_sum
        ),
        spans,
    )
    assert set(results) == {rp.choose_period(g, tuple(g.shape))}


def simulate_ranks(fn, spans):
    """Runs ``fn(span, reduce_sum)`` in one thread per span; ``reduce_sum`` sums a
    tensor over all threads (an in-process all_reduce)."""
    world = len(spans)
    barrier = threading.Barrier(world)
    slots: list = [None] * world
    results: list = [None] * world

    def run(rank):
        def reduce_sum(x):
            slots[rank] = x
            barrier.wait()
            total = sum(slots[1:], slots[0].clone())
            barrier.wait()
            return total

        results[rank] = fn(spans[rank], reduce_sum)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_exact_square_sum_is_correctly_rounded():
    x = torch.randn(5000) * torch.exp(10 * torch.randn(5000))
    exact = math.fsum(float(v) ** 2 for v in x.double())
    assert rp.exact_square_sum(rp.square_sum_parts(x)) == exact
