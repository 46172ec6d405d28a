"""``nn.MultiheadAttention`` written out so hooks can see its inner projections.

``nn.MultiheadAttention.forward`` applies ``in_proj_weight`` and ``out_proj.weight``
through ``F.multi_head_attention_forward``: no submodule is called, so module hooks
never see the projected queries, keys and values, nor the input of ``out_proj``. The
curvature collector registers a forward hook on the attention module that recomputes
the output with :func:`mha_forward` (same parameters, same inputs, same result) and
returns it in place of the original, so the autograd graph runs through tensors the
collector can hook. ``out_proj`` is called as a module, so its own Linear hooks fire.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["check_mha_supported", "mha_forward"]


def check_mha_supported(name: str, module: nn.MultiheadAttention) -> None:
    """Raise ValueError for the attention configurations :func:`mha_forward` lacks."""
    if not module._qkv_same_embed_dim:
        raise ValueError(
            f"module {name!r}: nn.MultiheadAttention with kdim/vdim != embed_dim "
            "(separate q/k/v projection weights) is not supported; allowed: the packed "
            "in_proj_weight (kdim = vdim = embed_dim), or list it in ignore_modules"
        )
    if module.bias_k is not None or module.add_zero_attn:
        raise ValueError(
            f"module {name!r}: nn.MultiheadAttention with add_bias_kv=True or "
            "add_zero_attn=True is not supported; list it in ignore_modules"
        )


def _float_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            mask, float("-inf")
        )
    return mask.to(dtype)


def mha_forward(
    module: nn.MultiheadAttention,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    need_weights: bool = True,
    attn_mask: torch.Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
) -> tuple[tuple[torch.Tensor, torch.Tensor | None], dict[str, torch.Tensor]]:
    """Recompute ``module(query, key, value, ...)`` step by step.

    ``is_causal`` is only a hint in torch (the causal mask must be passed as
    ``attn_mask``), so the mask alone decides here too.

    Returns:
        ``((attn_output, attn_weights), taps)`` where the first pair is what the module
        returns and ``taps`` holds the batch-first projection inputs ``q_in, k_in,
        v_in`` (N, L|S, E), projected ``q, k, v`` (N, L|S, E), and ``same`` (query,
        key and value are one tensor).
    """
    if query.dim() != 3:
        raise ValueError(
            "curvature needs batched attention inputs (3-D), got query shape "
            f"{tuple(query.shape)}"
        )
    if is_causal and attn_mask is None:
        raise ValueError("is_causal=True needs attn_mask, as in nn.MultiheadAttention")
    if module.batch_first:
        q_in, k_in, v_in = query, key, value
    else:
        q_in, k_in, v_in = (x.transpose(0, 1) for x in (query, key, value))
    embed = module.embed_dim
    heads = module.num_heads
    head_dim = embed // heads
    weight, bias = module.in_proj_weight, module.in_proj_bias
    w_q, w_k, w_v = weight[:embed], weight[embed : 2 * embed], weight[2 * embed :]
    b_q = b_k = b_v = None
    if bias is not None:
        b_q, b_k, b_v = bias[:embed], bias[embed : 2 * embed], bias[2 * embed :]
    q = F.linear(q_in, w_q, b_q)  # (N, L, E)
    k = F.linear(k_in, w_k, b_k)  # (N, S, E)
    v = F.linear(v_in, w_v, b_v)  # (N, S, E)
    n, tgt_len, _ = q.shape
    src_len = k.shape[1]

    def split(x: torch.Tensor) -> torch.Tensor:  # (N, T, E) -> (N, H, T, hd)
        return x.reshape(n, x.shape[1], heads, head_dim).transpose(1, 2)

    scores = split(q) @ split(k).transpose(-1, -2) / math.sqrt(head_dim)
    mask = _float_mask(attn_mask, scores.dtype)
    if mask is not None:
        # (L, S) broadcasts; (N*H, L, S) is per batch and head as in torch.
        scores = scores + (
            mask.reshape(n, heads, tgt_len, src_len) if mask.dim() == 3 else mask
        )
    pad = _float_mask(key_padding_mask, scores.dtype)
    if pad is not None:
        scores = scores + pad.reshape(n, 1, 1, src_len)
    weights = torch.softmax(scores, dim=-1)  # (N, H, L, S)
    dropped = weights
    if module.training and module.dropout > 0.0:
        dropped = F.dropout(weights, p=module.dropout)
    context = (dropped @ split(v)).transpose(1, 2).reshape(n, tgt_len, embed)
    out = module.out_proj(context)  # called as a module so its hooks fire
    if not module.batch_first:
        out = out.transpose(0, 1)
    returned = None
    if need_weights:
        returned = weights.mean(dim=1) if average_attn_weights else weights
    taps = {"q_in": q_in, "k_in": k_in, "v_in": v_in, "q": q, "k": k, "v": v}
    taps["same"] = query is key and key is value  # self-attention: one shared input
    return (out, returned), taps
