"""An encoder-decoder (translation) transformer written as one ODE on the pair (x, y).

The state is ``(x, y)``: source and target embeddings. N :class:`EncoderStep` s advance
``x`` (``y`` rides along), then N :class:`DecoderStep` s advance ``y`` with
cross-attention to the finished ``x``. One :class:`ResidualStack` holds all 2N steps,
so a layer-parallel solver can split it anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from leantrain.models.blocks import (
    DecoderStep,
    EncoderStep,
    ResidualStack,
    TransformerBlock,
    init_weights,
)


@dataclass
class EncDecConfig:
    """Hyper-parameters of :class:`EncoderDecoder` (defaults fit the copy/reverse
    tasks of :func:`leantrain.data.sequence_task`)."""

    src_vocab_size: int = 12  # 10 symbols + BOS + SEP
    tgt_vocab_size: int = 12  # same symbols on the target side
    max_len: int = 32  # longest source or target; size of the position tables
    n_layer: int = 2  # encoder steps; as many decoder steps follow
    n_head: int = 4  # heads of 16 dims at d_model=64
    d_model: int = 64  # model width
    mlp_ratio: int = 4  # MLP hidden width = 4 * d_model
    dropout: float = 0.0  # off by default
    t_final: float | None = None  # None: dt = 1; else dt = t_final / (2 * n_layer)

    def __post_init__(self) -> None:
        for name in ("src_vocab_size", "tgt_vocab_size", "max_len", "n_layer"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(
                    f"EncDecConfig.{name} must be a positive int, got {value!r}"
                )


class EncoderDecoder(nn.Module):
    """Encoder-decoder transformer; ``forward(src, tgt_in)`` -> target logits.

    Example:
        >>> model = EncoderDecoder(EncDecConfig(n_layer=1, d_model=32))
        >>> src, tgt_in = torch.randint(10, (2, 7)), torch.randint(10, (2, 5))
        >>> model(src, tgt_in).shape
        torch.Size([2, 5, 12])
    """

    def __init__(self, config: EncDecConfig) -> None:
        super().__init__()
        self.config = c = config
        self.src_emb = nn.Embedding(c.src_vocab_size, c.d_model)
        self.tgt_emb = nn.Embedding(c.tgt_vocab_size, c.d_model)
        self.src_pos = nn.Embedding(c.max_len, c.d_model)
        self.tgt_pos = nn.Embedding(c.max_len, c.d_model)
        self.drop = nn.Dropout(c.dropout)
        kw = dict(mlp_ratio=c.mlp_ratio, dropout=c.dropout)
        steps = [
            EncoderStep(TransformerBlock(c.d_model, c.n_head, **kw))
            for _ in range(c.n_layer)
        ] + [
            DecoderStep(
                TransformerBlock(
                    c.d_model, c.n_head, causal=True, cross_attention=True, **kw
                )
            )
            for _ in range(c.n_layer)
        ]
        self.stack = ResidualStack(steps, c.t_final)
        self.ln_f = nn.LayerNorm(c.d_model)
        self.lm_head = nn.Linear(c.d_model, c.tgt_vocab_size, bias=False)
        self.apply(init_weights)

    def _positions(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.size(1) > self.config.max_len:
            raise ValueError(
                f"sequence length {idx.size(1)} exceeds max_len={self.config.max_len}"
            )
        return torch.arange(idx.size(1), device=idx.device)[None]  # (1, T), as GPT

    def embed(
        self, src: torch.Tensor, tgt_in: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, S) source and (B, T) decoder-input ids -> state (x, y), (B, S|T, D)."""
        x = self.src_emb(src) + self.src_pos(self._positions(src))
        y = self.tgt_emb(tgt_in) + self.tgt_pos(self._positions(tgt_in))
        return self.drop(x), self.drop(y)

    def head(self, state: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Target logits (B, T, V) from the final decoder state."""
        return self.lm_head(self.ln_f(state[1]))

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        return self.head(self.stack(self.embed(src, tgt_in)))

    @torch.no_grad()
    def greedy_decode(self, src: torch.Tensor, length: int, bos: int) -> torch.Tensor:
        """Generate ``length`` target tokens one at a time, most likely first.

        The full model runs once per generated token (no caching): simple, and
        fast enough for the short synthetic tasks.
        """
        out = torch.full((src.size(0), 1), bos, dtype=torch.long, device=src.device)
        for _ in range(length):
            next_token = self(src, out)[:, -1].argmax(-1, keepdim=True)  # (B, 1)
            out = torch.cat([out, next_token], dim=1)
        return out[:, 1:]
