"""The means of g^2 behind the factored second moment: the C pass (one read,
double sums) and torch's chunked fp32 path, both against float64."""

from __future__ import annotations

import pytest
import torch

from leantrain.optim import _native, factored


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1), (2, 3), (37, 21), (300, 700), (5000, 40)])
def test_factor_means_match_float64_on_every_path(dtype, shape, monkeypatch):
    """The C pass (fp32/bf16 on CPU: double sums, rounded once) and torch's chunked
    fp32 path (fp16, CUDA, no compiler) both give the means of g^2."""
    torch.manual_seed(shape[0])
    rows = shape[0]
    g = (torch.randn(shape) * torch.rand(rows, 1) * 3).to(dtype)
    sq = g.double().reshape(rows, -1) ** 2
    want = (sq.mean(1), sq.mean(0))
    native = factored._native_means(g, rows)
    assert (native is None) == (dtype == torch.float16 or _native.load() is None)
    monkeypatch.setattr(factored, "_CHUNK_ELEMENTS", 500)  # several row chunks
    for got in (native, factored.torch_factor_means(g, rows)):
        if got is None:
            continue
        for mine, exact in zip(got, want, strict=True):
            assert mine.dtype == torch.float32
            rtol = 1e-7 if got is native else 2e-6  # native: one rounding
            torch.testing.assert_close(mine.double(), exact, rtol=rtol, atol=0)


def test_native_factor_means_ignore_the_thread_count():
    if _native.load() is None:
        pytest.skip(f"native kernel unavailable: {_native.status()}")
    g = torch.randn(3000, 500)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = factored._native_means(g, 3000)
        torch.set_num_threads(2)
        two = factored._native_means(g, 3000)
    finally:
        torch.set_num_threads(saved)
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))
    with pytest.raises(ValueError, match="factor means rejected"):
        factored._native_means(torch.zeros(1, 0), 1)  # no columns
