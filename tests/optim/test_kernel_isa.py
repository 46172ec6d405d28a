"""The kernel's instruction-set paths: the AVX-512 build gives the bits of the
build without AVX-512 (the scalar and AVX2 code), for every state layout."""

from __future__ import annotations

import itertools

import pytest
import torch

from leantrain.optim import _fused, _native, _quant_table
from leantrain.optim._options import StepOptions
from leantrain.optim._state import new_state
from leantrain.optim.factored import factor_shape
from tests._helpers.fused_states import HYPER, copy_state, random_state, spaced_codebook


def _cpu_has(flag: str) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and flag in line.split() for line in f)
    except OSError:
        return False


def _wide_and_narrow_builds(tmp_path, monkeypatch):
    """The kernel as built here (AVX-512) and a second build without AVX-512 (the
    scalar and AVX2 code) in a cache of its own; skips without a compiler."""
    if _native.compiler() is None:
        pytest.skip("no C compiler on this machine")
    if _native.load() is None:
        pytest.skip(f"native kernel unavailable: {_native.status()}")
    wide = _native.load()
    monkeypatch.setenv("LEANTRAIN_CACHE", str(tmp_path))
    monkeypatch.setattr(_native, "FLAGS", _native.FLAGS + ("-mno-avx512f",))
    monkeypatch.setattr(_native, "_tried", False)
    monkeypatch.setattr(_native, "_library", None)
    narrow = _native.load()
    assert narrow is not None and narrow is not wide, _native.status()
    return wide, narrow


@pytest.mark.skipif(not _cpu_has("avx512f"), reason="the AVX-512 path needs AVX-512F")
def test_avx512_path_gives_the_scalar_paths_bits(tmp_path, monkeypatch):
    """The AVX-512 paths (8-bit gathers in gefen_avx512.h, 4-bit permutes in
    gefen_codes.h) against the same kernel built without AVX-512: every parameter
    bit, code, absmax and v equal, for 8-bit and packed 4-bit codes, block and
    per-element second moments, odd blocks, tails shorter than a vector, one and
    two threads, gradients with exact zeros and a wide range of magnitudes, and
    stochastic 4-bit codes whose element indices cross 2**32 (the hash's high word)."""
    wide, narrow = _wide_and_narrow_builds(tmp_path, monkeypatch)
    cb8 = spaced_codebook(8)
    assert _quant_table.build_table(cb8).steps <= 1  # the vectorized lookup's case
    h = StepOptions(**HYPER).scalars(5.0)
    cases = [(4099, 61, 1), (4099, 1, 2), (333, 333, 1), (40000, 5000, 2)]
    # 4-bit codes rounded to nearest and stochastically (code key 123)
    kinds = [(8, None), (4, None), (4, 123)]
    for (n, period, threads), (bits, code_key) in itertools.product(cases, kinds):
        state = random_state(n, period, bits, seed=n + period)
        if bits == 8:
            state["codebook"] = cb8
        g = torch.Generator().manual_seed(n)
        grad = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 4
        grad[::97] = 0.0
        param = torch.randn(n, generator=g)
        results = []
        for lib in (wide, narrow):
            monkeypatch.setattr(_native, "_library", lib)
            s, p = copy_state(state), param.clone()
            for _ in range(3):  # later steps read codes the kernel wrote
                _fused.c_step(
                    p, grad, s, h, threads=threads, code_key=code_key, index0=2**32 - 7
                )
            results.append((p, s))
        (p_w, s_w), (p_n, s_n) = results
        assert torch.equal(p_w, p_n), (n, period, bits)
        for key in state:
            assert torch.equal(s_w[key], s_n[key]), (n, period, bits, key)
    # factored second moments (factored.py): the v tile, rows crossing sub-chunks
    for (rows, cols, period, threads), bits in itertools.product(
        [(61, 67, 61, 1), (300, 70, 5000, 2)], (8, 4)
    ):
        n = rows * cols
        g = torch.Generator().manual_seed(rows)
        cb = cb8 if bits == 8 else random_state(2, 2, 4, seed=1)["codebook"]
        state = new_state(torch.zeros(n), period, bits, cb, factor_shape((rows, cols)))
        grad = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 4
        param = torch.randn(n, generator=g)
        results = []
        for lib in (wide, narrow):
            monkeypatch.setattr(_native, "_library", lib)
            s, p = copy_state(state), param.clone()
            for _ in range(3):
                s["step"] += 1
                cbar = _fused.advance_factors(grad, s, 0.99)
                _fused.c_step(p, grad, s, h, threads=threads, chunk=1000, cbar=cbar)
            results.append((p, s))
        (p_w, s_w), (p_n, s_n) = results
        assert torch.equal(p_w, p_n), (rows, cols, bits)
        for key in state:
            assert torch.equal(s_w[key], s_n[key]), (rows, cols, bits, key)


@pytest.mark.skipif(not _cpu_has("avx512f"), reason="the AVX-512 path needs AVX-512F")
def test_avx512_stochastic_eight_bit_codes_give_the_scalar_paths_bits(
    tmp_path, monkeypatch
):
    """Stochastic 8-bit codes on a learned codebook (gefen_avx512.h's interval-table
    pass) against the build without AVX-512 (the nearest lookup, then
    lt_sr8_tile): every bit equal, with block, per-element and factored second
    moments, tails shorter than a vector, element indices crossing 2**32."""
    wide, narrow = _wide_and_narrow_builds(tmp_path, monkeypatch)
    cb8 = spaced_codebook(8)
    assert _quant_table.build_table(cb8).sr_steps <= 1  # the interval-table case
    h = StepOptions(**HYPER).scalars(5.0)
    # (rows, cols, period, threads); rows 0: a flat state with blocks
    for rows, cols, period, threads in [
        (0, 4099, 61, 1),
        (0, 4099, 1, 2),
        (0, 40000, 5000, 2),
        (61, 67, 61, 1),
        (300, 70, 5000, 2),
    ]:
        n = max(rows, 1) * cols
        g = torch.Generator().manual_seed(n + period)
        if rows:
            shape = factor_shape((rows, cols))
            state = new_state(torch.zeros(n), period, 8, cb8, shape)
        else:
            state = random_state(n, period, 8, seed=n + period)
            state["codebook"] = cb8
        grad = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 4
        grad[::97] = 0.0
        param = torch.randn(n, generator=g)
        results = []
        for lib in (wide, narrow):
            monkeypatch.setattr(_native, "_library", lib)
            s, p = copy_state(state), param.clone()
            for _ in range(3):  # later steps read codes the kernel wrote
                cbar = None
                if rows:
                    s["step"] += 1
                    cbar = _fused.advance_factors(grad, s, 0.99)
                _fused.c_step(
                    p,
                    grad,
                    s,
                    h,
                    threads=threads,
                    code_key=77,
                    index0=2**32 - 7,
                    cbar=cbar,
                )
            results.append((p, s))
        (p_w, s_w), (p_n, s_n) = results
        assert torch.equal(p_w, p_n), (rows, cols, period)
        for key in state:
            assert torch.equal(s_w[key], s_n[key]), (rows, cols, period, key)
