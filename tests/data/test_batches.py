"""Tests of the seeded batch samplers."""

import pytest
import torch

from leantrain.data import (
    TensorBatches,
    TokenBatches,
    fixed_token_batches,
    sample_windows,
    sample_windows_reference,
)


def test_sample_windows_matches_loop_reference():
    data = torch.randint(256, (500,), dtype=torch.uint8)
    fast = sample_windows(data, 16, 8, torch.Generator().manual_seed(5))
    slow = sample_windows_reference(data, 16, 8, torch.Generator().manual_seed(5))
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(a, b)


def test_windows_are_next_token_pairs_from_the_data():
    data = torch.arange(1000) % 251
    x, y = TokenBatches(data, block_size=32, batch_size=16, seed=0).sample()
    assert x.shape == y.shape == (16, 32) and x.dtype == torch.long
    assert torch.equal(y[:, :-1], x[:, 1:])
    # Every row is a contiguous run of the data (data[i] = i mod 251).
    assert bool(((x[:, 1:] - x[:, :-1]) % 251 == 1).all())
    assert bool(((y[:, -1] - x[:, -1]) % 251 == 1).all())


def test_same_seed_same_batches_different_seed_different():
    data = torch.randint(256, (10_000,))
    a = [TokenBatches(data, block_size=8, batch_size=4, seed=1).sample()[0]]
    s = TokenBatches(data, block_size=8, batch_size=4, seed=1)
    torch.manual_seed(123)  # the global RNG must not matter
    b = [s.sample()[0]]
    c = [TokenBatches(data, block_size=8, batch_size=4, seed=2).sample()[0]]
    assert torch.equal(a[0], b[0])
    assert not torch.equal(a[0], c[0])


def test_windows_reach_both_ends_of_the_data():
    data = torch.arange(20)
    x, y = sample_windows(data, 10, 2000, torch.Generator().manual_seed(0))
    assert int(x[:, 0].min()) == 0  # first window starts at 0
    assert int(y[:, -1].max()) == 19  # last target is the last token


def test_fixed_batches_are_reproducible():
    data = torch.randint(256, (1000,))
    a = fixed_token_batches(data, 3, block_size=8, batch_size=2, seed=7)
    b = fixed_token_batches(data, 3, block_size=8, batch_size=2, seed=7)
    assert len(a) == 3
    assert all(torch.equal(p[0], q[0]) for p, q in zip(a, b, strict=True))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(block_size=100, batch_size=2), "block_size"),
        (dict(block_size=0, batch_size=2), "block_size"),
        (dict(block_size=4, batch_size=-1), "batch_size"),
    ],
)
def test_token_batches_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TokenBatches(torch.arange(100), **kwargs)


def test_tensor_batches_cover_each_epoch_once():
    X = torch.arange(12).float()[:, None]
    Y = torch.arange(12)
    s = TensorBatches(X, Y, batch_size=4, seed=0)
    epoch = [s.sample() for _ in range(3)]
    assert all(torch.equal(xb[:, 0].long(), yb) for xb, yb in epoch)
    seen = torch.cat([yb for _, yb in epoch])
    assert sorted(seen.tolist()) == list(range(12))
    again = TensorBatches(X, Y, batch_size=4, seed=0)
    assert torch.equal(again.sample()[1], epoch[0][1])


def test_tensor_batches_bad_arguments():
    with pytest.raises(ValueError, match="first dimension"):
        TensorBatches(torch.zeros(3), torch.zeros(4), batch_size=1)
    with pytest.raises(ValueError, match="larger"):
        TensorBatches(torch.zeros(3), batch_size=4)
