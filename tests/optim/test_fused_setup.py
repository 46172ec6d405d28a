"""Gefen's fused step: the quantization lookup table, input checks, empty
parameters and the native build's cache (the step itself: test_fused.py)."""

from __future__ import annotations

import os
import re

import pytest
import torch

from leantrain.optim import _fused, _native, _quant_table
from leantrain.optim._options import StepOptions
from leantrain.optim._state import new_state
from tests._helpers.fused_states import (
    HYPER,
    codebook,
    copy_state,
    exact_nearest,
    random_state,
)


def test_quant_table_is_exact_for_any_sorted_codebook():
    """Emulates the kernel's lookup (table + midpoints of the cell) against brute force,
    including repeated codes (ties go to the lowest code) and crowded codes."""
    rng = torch.Generator().manual_seed(0)
    books = [
        codebook(8),
        torch.tensor([-1.0, -0.5, -0.5, 0.0, 0.0, 0.0, 1e-7, 1.0]),
        torch.sort(torch.rand(254, generator=rng) * 2e-3 - 1e-3).values,  # crowded
    ]
    books[2] = torch.cat([torch.tensor([-1.0]), books[2], torch.tensor([1.0])])
    for cb in books:
        table = _quant_table.build_table(cb)
        mids = table.mid[:-1]
        x = torch.cat(
            [mids, mids.nextafter(torch.tensor(1.0)), torch.rand(3000) * 2 - 1]
        )
        x = torch.cat([x, x.nextafter(torch.tensor(-1.0)), cb]).clamp(-1, 1)
        j = table.lut.long()[_quant_table.cell_index(x, table.lut.numel())]
        k = torch.where(j < 0, ~j, j)
        inside = j < 0
        while True:  # the kernel's loop over the cell's midpoints
            step = inside & (x > table.mid[k])
            if not step.any():
                break
            k = k + step.long()
        assert torch.equal(table.first[k].long(), exact_nearest(x, cb))
        assert torch.equal(k, _quant_table.nearest_index(x, table))


def test_quant_table_needs_one_comparison_for_learned_codebooks():
    """Codes at least one histogram bin (2/4096) apart: <= 1 midpoint per cell."""
    bins = torch.randperm(4096, generator=torch.Generator().manual_seed(1))[:254]
    cb = torch.cat([torch.tensor([-1.0]), -1 + (torch.sort(bins).values + 0.5) / 2048])
    cb = torch.cat([cb, torch.tensor([1.0])])
    table = _quant_table.build_table(cb)
    cells = _quant_table.cell_index(table.mid[:-1], table.lut.numel())
    assert int(torch.bincount(cells).max()) == 1


def test_quant_table_cache_follows_the_tensor():
    cb = codebook(4)
    first = _quant_table.quant_table(cb)
    assert _quant_table.quant_table(cb) is first
    cb.mul_(0.5)  # an in-place change bumps the version: rebuilt
    assert torch.equal(_quant_table.quant_table(cb).codebook, cb)


def test_bad_inputs_raise_and_change_nothing():
    n = 100
    param = torch.randn(n)
    state = random_state(n, 10, 8, seed=0)
    before = copy_state(state)
    with pytest.raises(ValueError, match="grad has 99 elements"):
        _fused.fused_step(param, torch.randn(99), state, **HYPER)
    bad = copy_state(state)
    bad["exp_avg_codes"] = bad["exp_avg_codes"][:-1]
    with pytest.raises(ValueError, match="exp_avg_codes"):
        _fused.fused_step(param, torch.randn(n), bad, **HYPER)
    bad = copy_state(state)
    bad["period"] = torch.tensor(101)
    with pytest.raises(ValueError, match="period"):
        _fused.fused_step(param, torch.randn(n), bad, **HYPER)
    with pytest.raises(ValueError, match="sorted"):
        _quant_table.build_table(torch.tensor([1.0, -1.0]))
    for key in state:
        assert torch.equal(state[key], before[key])
    if _native.load() is not None:
        h = StepOptions(**HYPER).scalars(1.0)
        with pytest.raises(ValueError, match="param: the C kernel needs"):
            _fused.c_step(param.double(), torch.randn(n), state, h)
        bad = copy_state(state)
        bad["exp_avg_codes"] = bad["exp_avg_codes"].long()
        with pytest.raises(ValueError, match="exp_avg_codes"):
            _fused.c_step(param, torch.randn(n), bad, h)
        with pytest.raises(ValueError, match="chunk"):
            _fused.c_step(param, torch.randn(n), state, h, chunk=1 << 20)


def test_empty_parameter_is_a_no_op():
    state = new_state(torch.empty(0), 1, 8, codebook(8))
    _fused.fused_step(torch.empty(0), torch.empty(0), state, **HYPER)
    assert float(state["step"]) == 0


def test_native_build_is_cached_and_optional(tmp_path, monkeypatch):
    """Builds into $LEANTRAIN_CACHE under a content hash, reuses it, and falls back
    to PyTorch without a compiler or with LEANTRAIN_NO_NATIVE=1."""
    if _native.compiler() is None:
        pytest.skip("no C compiler on this machine")
    monkeypatch.setenv("LEANTRAIN_CACHE", str(tmp_path))
    monkeypatch.setattr(_native, "_tried", False)
    monkeypatch.setattr(_native, "_library", None)
    assert _native.load() is not None, _native.status()
    built = list(tmp_path.glob(f"{_native.LIBRARY}-*.so"))
    assert len(built) == 1 and str(built[0]) in _native.status()
    assert not list(tmp_path.glob("*.tmp"))  # the temporary file was renamed
    stamp = os.stat(built[0]).st_mtime_ns
    monkeypatch.setattr(_native, "_tried", False)
    assert _native.load() is not None
    assert os.stat(built[0]).st_mtime_ns == stamp  # not rebuilt
    monkeypatch.setenv("LEANTRAIN_NO_NATIVE", "1")
    assert _fused.backend() == "torch" and "LEANTRAIN_NO_NATIVE" in _native.status()
    monkeypatch.delenv("LEANTRAIN_NO_NATIVE")
    monkeypatch.setattr(_native, "_tried", False)
    monkeypatch.setattr(_native, "compiler", lambda: None)
    assert _fused.backend() == "torch" and "no C compiler" in _native.status()


def test_every_included_kernel_header_is_in_the_cache_key():
    """A header a source includes but HEADERS forgets would not be hashed: editing
    it would load a stale library."""
    included = set()
    for name in _native.SOURCES + _native.HEADERS:
        text = (_native.KERNEL_DIR / name).read_text()
        included |= set(re.findall(r'#include "([^"]+)"', text))
    assert included == set(_native.HEADERS)


def test_native_cache_key_covers_every_source_and_header(tmp_path, monkeypatch):
    """An edit to any kernel file, headers included, gives another library path,
    so a stale build is never loaded."""
    for name in _native.SOURCES + _native.HEADERS:
        assert (_native.KERNEL_DIR / name).is_file(), name
    copy = tmp_path / "kernels"
    copy.mkdir()
    for name in _native.SOURCES + _native.HEADERS:
        (copy / name).write_bytes((_native.KERNEL_DIR / name).read_bytes())
    monkeypatch.setattr(_native, "KERNEL_DIR", copy)
    flags = ("-O3",)
    before = _native.library_path("cc", flags)
    for name in _native.HEADERS:
        (copy / name).write_bytes((copy / name).read_bytes() + b"\n")
        after = _native.library_path("cc", flags)
        assert after != before, name
        before = after
