"""Tests for the ODE-ready blocks (docs/CONTRACTS.md, "ODE-ready models")."""

import math

import pytest
import torch
from torch.func import functional_call, jvp, vmap

from leantrain.models import (
    DecoderStep,
    EncoderStep,
    ResidualStack,
    TransformerBlock,
    attention,
)


def _naive_attention(q, k, v, causal):
    """Loop reference: each query t takes a softmax over keys s (s <= t if causal)."""
    B, H, T, D = q.shape
    out = torch.zeros_like(q)
    for t in range(T):
        S = t + 1 if causal else k.shape[2]
        scores = torch.einsum("bhd,bhsd->bhs", q[:, :, t], k[:, :, :S]) / math.sqrt(D)
        w = torch.exp(scores - scores.max(-1, keepdim=True).values)
        w = w / w.sum(-1, keepdim=True)
        out[:, :, t] = torch.einsum("bhs,bhsd->bhd", w, v[:, :, :S])
    return out


@pytest.mark.parametrize("causal", [False, True])
def test_attention_matches_naive_loop(causal):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 5, generator=g, dtype=torch.float64) for _ in "qkv")
    torch.testing.assert_close(
        attention(q, k, v, causal=causal), _naive_attention(q, k, v, causal)
    )


def test_attention_matches_torch_sdpa():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 6, 4, generator=g, dtype=torch.float64) for _ in "qkv")
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(attention(q, k, v, causal=True), ref)


def test_block_dt_zero_is_identity_and_dt_is_euler():
    torch.manual_seed(0)
    block = TransformerBlock(16, 4, causal=True).double().eval()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    assert torch.equal(block(x, dt=0.0), x)
    # Explicit pre-LN formula with dt.
    dt = 0.3
    h = block.ln_attn(x)
    x1 = x + dt * block.attn(h, h)
    ref = x1 + dt * block.mlp(block.ln_mlp(x1))
    torch.testing.assert_close(block(x, dt=dt), ref)


def test_causal_block_future_does_not_change_past():
    torch.manual_seed(0)
    block = TransformerBlock(16, 2, causal=True).eval()
    x = torch.randn(1, 8, 16)
    y = x.clone()
    y[:, 5:] = torch.randn(1, 3, 16)
    torch.testing.assert_close(block(x)[:, :5], block(y)[:, :5])
    # Non-causal block: the past does see the future.
    nc = TransformerBlock(16, 2).eval()
    assert not torch.allclose(nc(x)[:, :5], nc(y)[:, :5])


def test_residual_stack_dt_equals_stepping_each_block():
    torch.manual_seed(0)
    blocks = [TransformerBlock(8, 2).double() for _ in range(4)]
    stack = ResidualStack(blocks, t_final=2.0).eval()
    assert stack.dt == 0.5
    x = torch.randn(3, 4, 8, dtype=torch.float64)
    ref = x
    for b in blocks:
        ref = b(ref, 2.0 / 4)
    torch.testing.assert_close(stack(x), ref)
    assert ResidualStack(blocks).dt == 1.0


@pytest.mark.parametrize("bad", [0, -1.0, "1"])
def test_residual_stack_rejects_bad_t_final(bad):
    with pytest.raises(ValueError, match="t_final"):
        ResidualStack([TransformerBlock(8, 2)], t_final=bad)


def test_residual_stack_rejects_empty():
    with pytest.raises(ValueError, match="at least one"):
        ResidualStack([])


def test_encoder_decoder_steps():
    torch.manual_seed(0)
    enc = TransformerBlock(8, 2).double()
    dec = TransformerBlock(8, 2, causal=True, cross_attention=True).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    y = torch.randn(2, 3, 8, dtype=torch.float64)
    x1, y1 = EncoderStep(enc)((x, y), 0.5)
    torch.testing.assert_close(x1, enc(x, 0.5))
    assert y1 is y
    x2, y2 = DecoderStep(dec)((x1, y1), 0.5)
    assert x2 is x1
    torch.testing.assert_close(y2, dec(y1, 0.5, memory=x1))
    # Decoder output depends on the memory.
    assert not torch.allclose(dec(y, 0.5, memory=x), dec(y, 0.5, memory=x1))


def test_memory_checks():
    with pytest.raises(ValueError, match="cross_attention"):
        DecoderStep(TransformerBlock(8, 2))
    with pytest.raises(ValueError, match="memory"):
        TransformerBlock(8, 2, cross_attention=True)(torch.randn(1, 2, 8))
    with pytest.raises(ValueError, match="memory"):
        TransformerBlock(8, 2)(torch.randn(1, 2, 8), memory=torch.randn(1, 2, 8))


@pytest.mark.parametrize("bad", [dict(n_heads=3), dict(dropout=1.0), dict(d_model=0)])
def test_block_rejects_bad_arguments(bad):
    kwargs = dict(d_model=8, n_heads=2) | bad
    with pytest.raises(ValueError):
        TransformerBlock(**kwargs)


def test_dropout_only_in_training():
    torch.manual_seed(0)
    block = TransformerBlock(16, 2, dropout=0.5)
    x = torch.randn(2, 6, 16)
    block.train()
    assert not torch.equal(block(x), block(x))
    block.eval()
    assert torch.equal(block(x), block(x))


def test_block_supports_torch_func_transforms():
    """jvp and vmap through the block (needed for curvature products and MGRIT)."""
    torch.manual_seed(0)
    block = TransformerBlock(8, 2, causal=True, cross_attention=True).double().eval()
    x = torch.randn(2, 4, 8, dtype=torch.float64)
    m = torch.randn(2, 3, 8, dtype=torch.float64)
    tangent = torch.randn_like(x)

    def f(x):
        return block(x, 0.5, memory=m)

    _, jv = jvp(f, (x,), (tangent,))
    eps = 1e-6
    fd = (f(x + eps * tangent) - f(x - eps * tangent)) / (2 * eps)
    torch.testing.assert_close(jv, fd, rtol=1e-6, atol=1e-7)

    params = dict(block.named_parameters())
    batched = vmap(
        lambda xi, mi: functional_call(block, params, (xi[None], 0.5, mi[None]))[0]
    )(x, m)
    torch.testing.assert_close(batched, f(x))
