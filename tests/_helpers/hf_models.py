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


def _built(model_class, config, *, dtype: torch.dtype, seed: int):
    """``model_class(config)`` in ``dtype``, its weights drawn after
    ``torch.manual_seed(seed)`` (so one seed builds one model)."""
    torch.manual_seed(seed)
    return model_class(config).to(dtype)


# The encoder BERT and ViT share: width 16 in 2 heads, an MLP of 32, dropout off (so
# two runs from one init see the same forward).
_SMALL_ENCODER = dict(
    hidden_size=16,
    num_attention_heads=2,
    intermediate_size=32,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)


def tiny_gpt2(*, dtype: torch.dtype = torch.float32, seed: int = 0, layers: int = 2):
    """GPT2LMHeadModel: d 16, 2 heads; ``wte`` tied to ``lm_head``; Conv1D weights."""
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
    return _built(transformers.GPT2LMHeadModel, config, dtype=dtype, seed=seed)


def tiny_llama(
    *, dtype: torch.dtype = torch.float32, seed: int = 0, layers: int = 2, tied=True
):
    """LlamaForCausalLM: d 16, 2 heads (1 key-value head), RoPE, tied embeddings."""
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
    return _built(transformers.LlamaForCausalLM, config, dtype=dtype, seed=seed)


def tiny_bert(*, dtype: torch.dtype = torch.float32, seed: int = 0, layers: int = 2):
    """BertForMaskedLM: d 16, 2 heads, no dropout."""
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        num_hidden_layers=layers,
        max_position_embeddings=32,
        **_SMALL_ENCODER,
    )
    return _built(transformers.BertForMaskedLM, config, dtype=dtype, seed=seed)


def tiny_vit(*, dtype: torch.dtype = torch.float32, seed: int = 0, layers: int = 2):
    """ViTForImageClassification: 8x8 single-channel images, 4x4 patches, 10 classes;
    the encoder is BERT's (d 16, 2 heads, no dropout)."""
    config = transformers.ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=1,
        num_hidden_layers=layers,
        num_labels=10,
        **_SMALL_ENCODER,
    )
    return _built(
        transformers.ViTForImageClassification, config, dtype=dtype, seed=seed
    )


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
