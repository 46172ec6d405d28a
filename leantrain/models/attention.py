"""Multi-head attention written with explicit matmuls.

Why not ``F.scaled_dot_product_attention``: on CPU it dispatches to a fused kernel that
has no forward-mode derivative, so ``torch.func.jvp`` (and anything built on it, such as
Hessian-vector products for curvature) fails. Explicit matmuls support float64, every
``torch.func`` transform and double backward, and at the sizes of the reference models
(T <= 256) they cost about the same on CPU.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    dropout_p: float = 0.0,
    training: bool = False,
) -> torch.Tensor:
    r"""Scaled dot-product attention :math:`\mathrm{softmax}(QK^T/\sqrt{d})V`.

    Args:
        q: queries, shape (B, nh, T, hs).
        k: keys, shape (B, nh, S, hs).
        v: values, shape (B, nh, S, hs).
        causal: if True, query t only sees keys s <= t (requires T == S).
        dropout_p: dropout probability on the attention weights.
        training: dropout is applied only when True.

    Returns:
        Tensor of shape (B, nh, T, hs).

    Raises:
        ValueError: if ``causal`` is set and T != S.

    Example:
        >>> q = torch.randn(2, 4, 8, 16)
        >>> attention(q, q, q, causal=True).shape
        torch.Size([2, 4, 8, 16])
    """
    T, S = q.size(-2), k.size(-2)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))  # (B, nh, T, S)
    if causal:
        if T != S:
            raise ValueError(
                f"causal attention needs as many queries as keys, got T={T}, S={S}"
            )
        future = torch.ones(T, S, dtype=torch.bool, device=q.device).triu(1)
        att = att.masked_fill(future, float("-inf"))
    att = F.softmax(att, dim=-1)
    if dropout_p > 0.0 and training:
        att = F.dropout(att, p=dropout_p, training=True)
    return att @ v  # (B, nh, T, hs)


class MultiHeadAttention(nn.Module):
    """Multi-head attention with separate query and key/value inputs.

    Self-attention calls it as ``attn(x, x)``; cross-attention as ``attn(y, memory)``.
    The key/value projection is one fused Linear (2*d_model outputs) so cross- and
    self-attention share one code path.

    Args:
        d_model: model width; must be divisible by ``n_heads``.
        n_heads: number of heads.
        dropout: dropout on the attention weights and on the output projection.
        causal: mask future keys (self-attention only).

    Example:
        >>> attn = MultiHeadAttention(32, 4, causal=True)
        >>> x = torch.randn(2, 10, 32)
        >>> attn(x, x).shape
        torch.Size([2, 10, 32])
    """

    def __init__(
        self, d_model: int, n_heads: int, *, dropout: float = 0.0, causal: bool = False
    ) -> None:
        super().__init__()
        if not isinstance(d_model, int) or d_model <= 0:
            raise ValueError(f"d_model must be a positive int, got {d_model!r}")
        if not isinstance(n_heads, int) or n_heads <= 0 or d_model % n_heads:
            raise ValueError(
                f"n_heads must be a positive int dividing d_model={d_model}, "
                f"got {n_heads!r}"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        self.n_heads = n_heads
        self.dropout = dropout
        self.causal = causal
        self.q_proj = nn.Linear(d_model, d_model)
        self.kv_proj = nn.Linear(d_model, 2 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.resid_drop = nn.Dropout(dropout)

    def _split(self, t: torch.Tensor) -> torch.Tensor:
        B, T, C = t.shape
        return t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """Attend from ``x`` (B, T, C) to ``context`` (B, S, C); returns (B, T, C)."""
        B, T, C = x.shape
        q = self._split(self.q_proj(x))  # (B, nh, T, hs)
        k, v = self.kv_proj(context).chunk(2, dim=-1)
        k, v = self._split(k), self._split(v)  # (B, nh, S, hs)
        y = attention(
            q,
            k,
            v,
            causal=self.causal,
            dropout_p=self.dropout,
            training=self.training,
        )
        y = y.transpose(1, 2).reshape(B, T, C)  # re-assemble heads side by side
        return self.resid_drop(self.out_proj(y))
