"""A small Vision Transformer (ViT), ODE-ready: patches -> encoder stack -> class head.

Works on the 8x8 digits with 2x2 patches (16 tokens) or 4x4 patches (4 tokens), and on
any image whose side is a multiple of the patch size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from leantrain.models.blocks import ResidualStack, TransformerBlock, init_weights


def patchify(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """Cut images into non-overlapping square patches, row by row.

    Args:
        images: (B, C, H, W); H and W must be multiples of ``patch_size``.
        patch_size: side p of a patch.

    Returns:
        (B, N, C*p*p) with N = (H/p)(W/p); each patch flattened channel-major.
    """
    B, C, H, W = images.shape
    p = patch_size
    if H % p or W % p:
        raise ValueError(f"image size {H}x{W} is not a multiple of patch_size={p}")
    x = images.reshape(B, C, H // p, p, W // p, p)  # (B, C, gh, p, gw, p)
    x = x.permute(0, 2, 4, 1, 3, 5)  # (B, gh, gw, C, p, p)
    return x.reshape(B, (H // p) * (W // p), C * p * p)


def patchify_reference(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """Loop version of :func:`patchify`."""
    B, C, H, W = images.shape
    p = patch_size
    patches = [
        images[:, :, i : i + p, j : j + p].reshape(B, -1)
        for i in range(0, H, p)
        for j in range(0, W, p)
    ]
    return torch.stack(patches, dim=1)


@dataclass
class ViTConfig:
    """Hyper-parameters of :class:`ViT` (defaults: the 8x8 digits)."""

    image_size: int = 8  # square images of this side
    patch_size: int = 2  # 2x2 patches -> 16 tokens on 8x8 images
    in_channels: int = 1  # grey-scale digits
    n_classes: int = 10  # digits 0-9
    n_layer: int = 4  # residual steps in the stack
    n_head: int = 4  # heads of 16 dims at d_model=64
    d_model: int = 64  # tiny images need only a narrow model
    mlp_ratio: int = 4  # MLP hidden width = 4 * d_model
    dropout: float = 0.0  # off by default
    t_final: float | None = None  # None: dt = 1; else dt = t_final / n_layer

    def __post_init__(self) -> None:
        for name in ("image_size", "patch_size", "in_channels", "n_classes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(
                    f"ViTConfig.{name} must be a positive int, got {value!r}"
                )
        if self.image_size % self.patch_size:
            raise ValueError(
                f"ViTConfig.patch_size={self.patch_size} must divide "
                f"image_size={self.image_size}"
            )

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class ViT(nn.Module):
    """Vision Transformer: linear patch embedding, a class token, learned positions,
    a non-causal :class:`ResidualStack` and a linear head on the class token.

    Example:
        >>> model = ViT(ViTConfig(patch_size=4, n_layer=2, d_model=32))
        >>> model(torch.randn(3, 1, 8, 8)).shape
        torch.Size([3, 10])
    """

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.config = c = config
        patch_dim = c.in_channels * c.patch_size**2
        self.patch_embed = nn.Linear(patch_dim, c.d_model)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.d_model))
        self.pos_embed = nn.Parameter(torch.zeros(1, 1 + c.n_patches, c.d_model))
        self.drop = nn.Dropout(c.dropout)
        blocks = [
            TransformerBlock(
                c.d_model, c.n_head, mlp_ratio=c.mlp_ratio, dropout=c.dropout
            )
            for _ in range(c.n_layer)
        ]
        self.stack = ResidualStack(blocks, c.t_final)
        self.ln_f = nn.LayerNorm(c.d_model)
        self.fc = nn.Linear(c.d_model, c.n_classes)
        self.apply(init_weights)
        nn.init.normal_(self.pos_embed, std=0.02)  # positions must differ at start

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> tokens (B, 1 + N, D), the class token first."""
        c = self.config
        if images.shape[1:] != (c.in_channels, c.image_size, c.image_size):
            raise ValueError(
                f"ViT expects images of shape (B, {c.in_channels}, {c.image_size}, "
                f"{c.image_size}), got {tuple(images.shape)}"
            )
        x = self.patch_embed(patchify(images, c.patch_size))  # (B, N, D)
        cls = self.cls_token.expand(x.size(0), -1, -1)  # (B, 1, D)
        return self.drop(torch.cat([cls, x], dim=1) + self.pos_embed)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits from the class token: (B, 1 + N, D) -> (B, n_classes)."""
        return self.fc(self.ln_f(x[:, 0]))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.stack(self.embed(images)))
