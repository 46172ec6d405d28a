"""Seeded mini-batch samplers: next-token windows of a token stream, rows of tensors.

Every sampler draws from its own ``torch.Generator``, never the global RNG, so the same
seed gives the same batches whatever else the program does with randomness (model init,
dropout), and two optimizers compared side by side see identical data.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def sample_windows(
    data: torch.Tensor, block_size: int, batch_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random next-token pairs ``(x, y)``, each (B, T) int64, ``y[:, t] = x[:, t+1]``.

    Window starts are uniform over every position where ``block_size + 1`` tokens fit.

    Raises:
        ValueError: if ``data`` has fewer than ``block_size + 1`` tokens.
    """
    _check_positive("block_size", block_size)
    _check_positive("batch_size", batch_size)
    if data.dim() != 1 or data.numel() < block_size + 1:
        raise ValueError(
            f"block_size={block_size} needs a 1-D token stream of at least "
            f"{block_size + 1} tokens, got shape {tuple(data.shape)}"
        )
    starts = torch.randint(
        data.numel() - block_size, (batch_size,), generator=generator
    )  # (B,)
    offsets = torch.arange(block_size + 1)  # (T+1,)
    windows = data[starts[:, None] + offsets].long()  # (B, T+1)
    return windows[:, :-1], windows[:, 1:]


def sample_windows_reference(
    data: torch.Tensor, block_size: int, batch_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slow, obvious version of :func:`sample_windows` (same random draws)."""
    starts = torch.randint(
        data.numel() - block_size, (batch_size,), generator=generator
    ).tolist()
    xs = [[int(data[s + t]) for t in range(block_size)] for s in starts]
    ys = [[int(data[s + t + 1]) for t in range(block_size)] for s in starts]
    return torch.tensor(xs, dtype=torch.long), torch.tensor(ys, dtype=torch.long)


class TokenBatches:
    """Endless seeded stream of next-token batches from a 1-D token tensor.

    Args:
        data: 1-D tensor of token ids (e.g. ``TextCorpus.train``).
        block_size: sequence length T.
        batch_size: batch size B.
        seed: seed of the sampler's own generator.

    Example:
        >>> data = torch.arange(100) % 7
        >>> x, y = next(iter(TokenBatches(data, block_size=8, batch_size=4, seed=0)))
        >>> x.shape, bool((y[:, :-1] == x[:, 1:]).all())
        (torch.Size([4, 8]), True)
    """

    def __init__(
        self, data: torch.Tensor, *, block_size: int, batch_size: int, seed: int = 0
    ) -> None:
        _check_positive("block_size", block_size)
        _check_positive("batch_size", batch_size)
        if data.dim() != 1 or data.numel() < block_size + 1:
            raise ValueError(
                f"block_size={block_size} is too long for a token stream of shape "
                f"{tuple(data.shape)} (need a 1-D stream of >= block_size + 1 tokens)"
            )
        self.data = data
        self.block_size = block_size
        self.batch_size = batch_size
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next (x, y) batch, each (B, T) int64."""
        return sample_windows(
            self.data, self.block_size, self.batch_size, self.generator
        )

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.sample()


def fixed_token_batches(
    data: torch.Tensor, n_batches: int, *, block_size: int, batch_size: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n_batches`` batches drawn once, for a validation loss that is the same set
    of windows at every evaluation and for every optimizer."""
    _check_positive("n_batches", n_batches)
    sampler = TokenBatches(
        data, block_size=block_size, batch_size=batch_size, seed=seed
    )
    return [sampler.sample() for _ in range(n_batches)]


class TensorBatches:
    """Endless seeded stream of random mini-batches of rows of aligned tensors.

    Each epoch is one seeded permutation; a batch never spans two epochs, so every
    batch has exactly ``batch_size`` rows.

    Args:
        *tensors: tensors with the same first dimension (e.g. images and labels).
        batch_size: rows per batch (at most the number of rows).
        seed: seed of the sampler's own generator.

    Example:
        >>> X, Y = torch.randn(10, 3), torch.arange(10)
        >>> xb, yb = TensorBatches(X, Y, batch_size=4, seed=0).sample()
        >>> torch.equal(xb, X[yb])
        True
    """

    def __init__(self, *tensors: torch.Tensor, batch_size: int, seed: int = 0) -> None:
        if not tensors:
            raise ValueError("TensorBatches needs at least one tensor")
        n = tensors[0].shape[0]
        if any(t.shape[0] != n for t in tensors):
            raise ValueError(
                "tensors must share their first dimension, got "
                f"{[tuple(t.shape) for t in tensors]}"
            )
        _check_positive("batch_size", batch_size)
        if batch_size > n:
            raise ValueError(f"batch_size={batch_size} is larger than the {n} rows")
        self.tensors = tensors
        self.batch_size = batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self._order = torch.empty(0, dtype=torch.long)
        self._pos = 0

    def sample(self) -> tuple[torch.Tensor, ...]:
        """The next batch: one tensor per input, each with ``batch_size`` rows."""
        if self._pos + self.batch_size > len(self._order):
            n = self.tensors[0].shape[0]
            self._order = torch.randperm(n, generator=self.generator)
            self._pos = 0
        idx = self._order[self._pos : self._pos + self.batch_size]
        self._pos += self.batch_size
        return tuple(t[idx] for t in self.tensors)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        while True:
            yield self.sample()
