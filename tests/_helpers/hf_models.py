"""Tiny, randomly initialised Hugging Face models for the integration tests.

Built from configs (no download), small enough that a forward and backward take
milliseconds. Each factory takes ``dtype`` and ``seed`` so a test can build the same
initial model twice (for example once per optimizer it compares).
"""

from __future__ import annotations

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import transformers  # noqa: E402  (the test extra installs it)

VOCAB = 64
SEQ = 12


def tiny_gpt2(*, dtype: torch.dtype = torch.float32, seed: int = 0, layers: int = 2):
    """GPT2LMHeadModel: d 16, 2 heads; ``wte`` tied to ``lm_head``; Conv1D weights."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=16,
        n_layer=layers,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config).to(dtype)


def tiny_llama(
    *, dtype: torch.dtype = torch.float32, seed: int = 0, layers: int = 2, tied=True
):
    """LlamaForCausalLM: d 16, 2 heads (1 key-value head), RoPE, tied embeddings."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=tied,
    )
    return transformers.LlamaForCausalLM(config).to(dtype)


def tiny_bert(*, dtype: torch.dtype = torch.float32, seed: int = 0, layers: int = 2):
    """BertForMaskedLM: d 16, 2 heads, no dropout."""
    torch.manual_seed(seed)
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForMaskedLM(config).to(dtype)


def tiny_vit(*, dtype: torch.dtype = torch.float32, seed: int = 0, layers: int = 2):
    """ViTForImageClassification: 8x8 single-channel images, 4x4 patches, 10 classes."""
    torch.manual_seed(seed)
    config = transformers.ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=1,
        hidden_size=16,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=10,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.ViTForImageClassification(config).to(dtype)


def token_batch(batch: int = 4, seq: int = SEQ, *, seed: int = 0) -> torch.Tensor:
    """Random token ids of shape ``(batch, seq)``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=g)


def image_batch(batch: int = 4, *, seed: int = 0, dtype=torch.float32):
    """Random ``(batch, 1, 8, 8)`` images and ``(batch,)`` labels in [0, 10)."""
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(batch, 1, 8, 8, generator=g, dtype=dtype),
        torch.randint(0, 10, (batch,), generator=g),
    )
