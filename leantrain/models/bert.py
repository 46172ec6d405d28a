"""A small BERT-style encoder with a masked-language-model head, ODE-ready.

``forward = head(stack(embed(idx)))``; the stack is non-causal (every token sees the
whole sequence) and is a :class:`ResidualStack`, so it can be made layer-parallel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from leantrain.models.blocks import ResidualStack, TransformerBlock, init_weights


@dataclass
class BERTConfig:
    """Hyper-parameters of :class:`BERT`."""

    vocab_size: int = 257  # 256 bytes + one [MASK] token
    mask_token_id: int = 256  # the extra id after the bytes
    block_size: int = 64  # longest sequence; size of the position-embedding table
    n_layer: int = 4  # residual steps in the stack
    n_head: int = 4  # heads of 32 dims at d_model=128
    d_model: int = 128  # model width
    mlp_ratio: int = 4  # MLP hidden width = 4 * d_model
    dropout: float = 0.0  # small models on small data: off by default
    t_final: float | None = None  # None: dt = 1; else dt = t_final / n_layer

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(
                    f"BERTConfig.{name} must be a positive int, got {value!r}"
                )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id={self.mask_token_id} must be in "
                f"[0, vocab_size={self.vocab_size})"
            )


class BERT(nn.Module):
    """Bidirectional transformer encoder with a masked-LM head.

    Example:
        >>> model = BERT(BERTConfig(block_size=16, n_layer=2, d_model=32))
        >>> idx = torch.randint(256, (2, 16))
        >>> inputs, targets = mlm_mask(idx, mask_token_id=256, vocab_size=256)
        >>> model(inputs).shape
        torch.Size([2, 16, 257])
    """

    def __init__(self, config: BERTConfig) -> None:
        super().__init__()
        self.config = c = config
        self.wte = nn.Embedding(c.vocab_size, c.d_model)
        self.wpe = nn.Embedding(c.block_size, c.d_model)
        self.drop = nn.Dropout(c.dropout)
        blocks = [
            TransformerBlock(
                c.d_model, c.n_head, mlp_ratio=c.mlp_ratio, dropout=c.dropout
            )
            for _ in range(c.n_layer)
        ]
        self.stack = ResidualStack(blocks, c.t_final)
        self.ln_f = nn.LayerNorm(c.d_model)
        self.mlm_head = nn.Linear(c.d_model, c.vocab_size)
        self.apply(init_weights)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """(B, T) int64 -> (B, T, C)."""
        T = idx.size(1)
        if T > self.config.block_size:
            raise ValueError(
                f"sequence length {T} exceeds block_size={self.config.block_size}"
            )
        pos = torch.arange(T, device=idx.device)[None]  # (1, T), as in GPT
        return self.drop(self.wte(idx) + self.wpe(pos))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> MLM logits (B, T, V)."""
        return self.mlm_head(self.ln_f(x))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.stack(self.embed(idx)))


def _mlm_draws(
    idx: torch.Tensor, vocab_size: int, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # All randomness in one place, so the fast and the reference versions agree.
    select = torch.rand(idx.shape, generator=generator)
    action = torch.rand(idx.shape, generator=generator)
    random_tokens = torch.randint(vocab_size, idx.shape, generator=generator)
    return select, action, random_tokens


def _check_mlm_args(mask_prob: float, vocab_size: int) -> None:
    if not 0.0 < mask_prob <= 1.0:
        raise ValueError(f"mask_prob must be in (0, 1], got {mask_prob!r}")
    if not isinstance(vocab_size, int) or vocab_size <= 0:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")


def mlm_mask(
    idx: torch.Tensor,
    *,
    mask_token_id: int,
    vocab_size: int,
    mask_prob: float = 0.15,
    generator: torch.Generator | None = None,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking: pick each token with ``mask_prob``; of the picked, 80% become
    ``mask_token_id``, 10% a random token in ``[0, vocab_size)``, 10% stay.

    Args:
        idx: (B, T) token ids.
        mask_token_id: id of [MASK].
        vocab_size: random replacements are drawn from ``[0, vocab_size)`` (the real
            tokens, not the special ones).
        mask_prob: probability that a position is predicted.
        generator: source of randomness (default: the global RNG).
        ignore_index: target value of positions that are not predicted.

    Returns:
        ``(inputs, targets)``, both (B, T); targets hold the original token where a
        position was picked and ``ignore_index`` elsewhere.
    """
    _check_mlm_args(mask_prob, vocab_size)
    select, action, random_tokens = _mlm_draws(idx, vocab_size, generator)
    picked = select < mask_prob
    targets = torch.where(picked, idx, torch.full_like(idx, ignore_index))
    inputs = torch.where(picked & (action < 0.8), mask_token_id, idx)
    inputs = torch.where(
        picked & (action >= 0.8) & (action < 0.9), random_tokens, inputs
    )
    return inputs, targets


def mlm_mask_reference(
    idx: torch.Tensor,
    *,
    mask_token_id: int,
    vocab_size: int,
    mask_prob: float = 0.15,
    generator: torch.Generator | None = None,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-by-element loop version of :func:`mlm_mask` (same random draws)."""
    _check_mlm_args(mask_prob, vocab_size)
    select, action, random_tokens = _mlm_draws(idx, vocab_size, generator)
    inputs, targets = idx.clone(), torch.full_like(idx, ignore_index)
    B, T = idx.shape
    for b in range(B):
        for t in range(T):
            if select[b, t] >= mask_prob:
                continue
            targets[b, t] = idx[b, t]
            if action[b, t] < 0.8:
                inputs[b, t] = mask_token_id
            elif action[b, t] < 0.9:
                inputs[b, t] = random_tokens[b, t]
    return inputs, targets
