"""A plain multi-layer perceptron (default: 64-512-512-10 for the 8x8 digits)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

ACTIVATIONS: dict[str, type[nn.Module]] = {
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "tanh": nn.Tanh,
}


class MLP(nn.Module):
    """``Linear -> act -> ... -> Linear`` on inputs flattened from dim 1.

    Args:
        sizes: layer widths, input first, output last (at least two entries).
        activation: ``"relu"``, ``"gelu"`` or ``"tanh"``; none after the last layer.

    Raises:
        ValueError: fewer than two sizes, a non-positive size, an unknown activation.

    Example:
        >>> model = MLP()
        >>> model(torch.randn(5, 1, 8, 8)).shape
        torch.Size([5, 10])
    """

    def __init__(
        self, sizes: Sequence[int] = (64, 512, 512, 10), activation: str = "relu"
    ) -> None:
        super().__init__()
        sizes = list(sizes)
        if len(sizes) < 2 or any(
            not isinstance(s, int) or isinstance(s, bool) or s <= 0 for s in sizes
        ):
            raise ValueError(
                f"sizes must be >= 2 positive ints (input ... output), got {sizes!r}"
            )
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}"
            )
        layers: list[nn.Module] = []
        for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            layers.append(nn.Linear(n_in, n_out))
            if i < len(sizes) - 2:
                layers.append(ACTIVATIONS[activation]())
        self.net = nn.Sequential(*layers)
        self.sizes = tuple(sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, ...) with prod(...) == sizes[0] -> (B, sizes[-1])."""
        x = x.flatten(1)
        if x.size(1) != self.sizes[0]:
            raise ValueError(
                f"MLP expects {self.sizes[0]} input features, got {x.size(1)}"
            )
        return self.net(x)
