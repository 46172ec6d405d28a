"""A small convolutional network for tiny images such as the 8x8 digits."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def conv_bn_relu(c_in: int, c_out: int) -> nn.Sequential:
    """3x3 convolution (same padding) -> BatchNorm -> ReLU.

    The convolution has no bias: BatchNorm's shift would cancel it.
    """
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, kernel_size=3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(),
    )


class CNN(nn.Module):
    """``conv-BN-ReLU`` x len(widths), a 2x2 max-pool after the second, global
    average pooling and a linear head.

    At 8x8 one pooling step (to 4x4) is enough: more would leave 1x1 maps.

    Args:
        in_channels: image channels (1 for the digits).
        n_classes: outputs of the head.
        widths: channels of each conv layer (at least one).

    Example:
        >>> model = CNN()
        >>> model(torch.randn(5, 1, 8, 8)).shape
        torch.Size([5, 10])
    """

    def __init__(
        self,
        in_channels: int = 1,
        n_classes: int = 10,
        widths: Sequence[int] = (32, 64, 64),
    ) -> None:
        super().__init__()
        widths = list(widths)
        for name, value in [("in_channels", in_channels), ("n_classes", n_classes)]:
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not widths or any(not isinstance(w, int) or w <= 0 for w in widths):
            raise ValueError(f"widths must be one or more positive ints, got {widths}")
        layers: list[nn.Module] = []
        c_in = in_channels
        for i, width in enumerate(widths):
            layers.append(conv_bn_relu(c_in, width))
            if i == 1:
                layers.append(nn.MaxPool2d(2))
            c_in = width
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)  # any image size >= 2 works
        self.fc = nn.Linear(c_in, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> logits (B, n_classes)."""
        return self.fc(self.pool(self.features(x)).flatten(1))
