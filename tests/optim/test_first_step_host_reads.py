"""The first step reads the device back on the host only where its algorithm needs it.

On CUDA every read of a device value on the host (``.cpu()``, ``.item()``,
``.tolist()``, ``bool``/``int``/``float`` of a tensor) waits for the device. Gefen's
first step chooses each parameter's period and learns the codebook from the first
gradients; both run on the gradients' device, and the host reads back only small
summaries: for the period, the exact pieces of ``sum g^2`` (with a non-finite count)
and then the per-unit sums (two reads per parameter); for the codebook, the summed
histogram of every parameter with a non-finite flag (one read per optimizer), which
feeds the dynamic program on the host. Here the reads are counted on CPU tensors
with the read methods wrapped; ``tests/test_host_syncs_gpu.py`` sees a real device.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from leantrain.optim import _first_codebook, _reducible_partition
from leantrain.optim._reducible_partition import choose_period

READS = ("cpu", "item", "tolist", "__bool__", "__int__", "__float__", "__index__")


class _Reads:
    """Counts the calls of :data:`READS` on tensors while ``counting``."""

    def __init__(self, monkeypatch):
        self.count = 0
        self.counting = True
        for name in READS:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(original))

    def _wrap(self, original):
        def counted(tensor, *args, **kwargs):
            if self.counting:
                self.count += 1
            return original(tensor, *args, **kwargs)

        return counted

    @contextlib.contextmanager
    def paused(self):
        self.counting = False
        try:
            yield
        finally:
            self.counting = True


def _row_scaled(rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    scales = torch.exp(2 * torch.randn(rows, 1, generator=g))
    return torch.randn(rows, cols, generator=g) * scales


@pytest.mark.parametrize("shape", [(64, 256), (96, 40), (3000,), (7, 5)])
def test_choosing_a_period_reads_two_small_summaries(monkeypatch, shape):
    g = _row_scaled(shape[0], shape[1], 0) if len(shape) == 2 else torch.randn(shape)
    want = choose_period(g, shape)
    reads = _Reads(monkeypatch)
    assert choose_period(g, shape) == want
    assert reads.count <= 2, shape


def test_a_non_finite_gradient_still_raises():
    g = _row_scaled(64, 256, 1)
    g[3, 7] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinite"):
        choose_period(g, g.shape)
    with pytest.raises(ValueError, match="NaN or infinite"):
        _first_codebook.learn_first_codebook(8, [({}, _param(g), 256)])


def _param(grad):
    p = torch.nn.Parameter(torch.zeros_like(grad))
    p.grad = grad
    return p


@pytest.mark.parametrize("bits", [8, 4])
def test_the_first_codebook_reads_one_histogram(monkeypatch, bits):
    """Every member's histogram is summed on the device; the dynamic program gets
    them in one read (the DP and the exact-0 move run on host data, uncounted)."""
    members = [
        ({}, _param(_row_scaled(64, 256, 2)), 256),
        ({"maximize": True}, _param(_row_scaled(32, 100, 3)), 100),
        ({}, _param(torch.randn(300)), 1),
    ]
    want = _first_codebook.learn_first_codebook(bits, members)
    reads = _Reads(monkeypatch)
    for name in ("learn_codebook", "with_exact_zero"):
        host_step = getattr(_first_codebook, name)

        def uncounted(*args, _step=host_step, **kwargs):
            with reads.paused():
                return _step(*args, **kwargs)

        monkeypatch.setattr(_first_codebook, name, uncounted)
    got = _first_codebook.learn_first_codebook(bits, members)
    assert torch.equal(got, want)
    assert reads.count == 1


def test_the_partition_module_keeps_its_exact_sum():
    """The square sum read on the host as numbers equals the tensor route."""
    g = _row_scaled(16, 64, 4).reshape(-1)
    parts = _reducible_partition.square_sum_parts(g)
    assert _reducible_partition.exact_square_sum(
        parts
    ) == _reducible_partition.exact_square_sum(parts.numpy())
