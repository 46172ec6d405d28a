"""A small GPT (decoder-only transformer) written ODE-ready, in the style of nanoGPT.

``forward = head(stack(embed(idx)))``: the embeddings and the head stay outside the
residual stack, so ``.stack`` can be swapped for a layer-parallel solver unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from leantrain.models.blocks import ResidualStack, TransformerBlock, init_weights


@dataclass
class GPTConfig:
    """Hyper-parameters of :class:`GPT`; the defaults are ``GPT.default()``."""

    vocab_size: int = 256  # bytes: the embedded corpora need no tokenizer
    block_size: int = 64  # longest context; size of the position-embedding table
    n_layer: int = 4  # residual steps in the stack (ODE time steps)
    n_head: int = 4  # heads of 32 dims at d_model=128
    d_model: int = 128  # ~0.8M params: 300 CPU steps take tens of seconds
    mlp_ratio: int = 4  # MLP hidden width = 4 * d_model, as in GPT-2
    dropout: float = 0.0  # short runs on >1 MB of text do not overfit
    t_final: float | None = None  # None: dt = 1, a plain ResNet; else dt = t_final/n
    tie_weights: bool = False  # see GPT's docstring for why this is off

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(
                    f"GPTConfig.{name} must be a positive int, got {value!r}"
                )
        if self.d_model % self.n_head:
            raise ValueError(
                f"GPTConfig.n_head={self.n_head} must divide d_model={self.d_model}"
            )


class GPT(nn.Module):
    """Decoder-only transformer language model.

    Weight tying (``tie_weights=True``, head weight = token embedding) is optional and
    off by default: with a 256-byte vocabulary it saves only ``256 * d_model`` weights,
    and untied weights keep the embedding (first layer-parallel rank) and the head (last
    rank) independent, so no gradient has to be summed across ranks.

    Args:
        config: the model's :class:`GPTConfig`.

    Example:
        >>> model = GPT(GPTConfig(block_size=16, n_layer=2, d_model=32))
        >>> idx = torch.randint(256, (2, 16))
        >>> logits = model(idx)
        >>> logits.shape
        torch.Size([2, 16, 256])
        >>> float(lm_loss(logits, idx)) > 0
        True
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = c = config
        self.wte = nn.Embedding(c.vocab_size, c.d_model)  # token embedding
        self.wpe = nn.Embedding(c.block_size, c.d_model)  # learned position embedding
        self.drop = nn.Dropout(c.dropout)
        blocks = [
            TransformerBlock(
                c.d_model,
                c.n_head,
                mlp_ratio=c.mlp_ratio,
                dropout=c.dropout,
                causal=True,
            )
            for _ in range(c.n_layer)
        ]
        self.stack = ResidualStack(blocks, c.t_final)
        self.ln_f = nn.LayerNorm(c.d_model)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.apply(init_weights)
        if c.tie_weights:
            self.lm_head.weight = self.wte.weight

    @classmethod
    def default(cls) -> GPT:
        """The model ``leantrain compare`` trains: ``GPT(GPTConfig())``."""
        return cls(GPTConfig())

    def num_params(self) -> int:
        """Number of distinct parameters (a tied weight is counted once)."""
        return sum(p.numel() for p in self.parameters())

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token + position embedding: (B, T) int64 -> (B, T, C)."""
        T = idx.size(1)
        if T > self.config.block_size:
            raise ValueError(
                f"sequence length {T} exceeds block_size={self.config.block_size}"
            )
        # (1, T): broadcast over the batch, as HF models pass position ids, so a
        # curvature hook sees a leading batch dim it can expand (docs/precond.md).
        pos = torch.arange(T, device=idx.device)[None]  # (1, T)
        return self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final LayerNorm and projection to the vocabulary: (B, T, C) -> (B, T, V)."""
        return self.lm_head(self.ln_f(x))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, V) for every position of ``idx`` (B, T)."""
        return self.head(self.stack(self.embed(idx)))


def lm_loss(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """Mean next-token cross-entropy; ``logits`` (B, T, V), ``targets`` (B, T).

    Targets equal to ``ignore_index`` do not count (e.g. unpredictable prompt tokens).
    """
    V = logits.size(-1)
    return F.cross_entropy(
        logits.reshape(-1, V), targets.reshape(-1), ignore_index=ignore_index
    )
