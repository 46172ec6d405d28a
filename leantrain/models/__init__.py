"""Small reference models written ODE-ready (every residual block takes ``dt``)."""

from leantrain.models.attention import MultiHeadAttention, attention
from leantrain.models.bert import BERT, BERTConfig, mlm_mask, mlm_mask_reference
from leantrain.models.blocks import (
    DecoderStep,
    EncoderStep,
    FeedForward,
    ResidualStack,
    TransformerBlock,
    init_weights,
)
from leantrain.models.cnn import CNN
from leantrain.models.encdec import EncDecConfig, EncoderDecoder
from leantrain.models.gpt import GPT, GPTConfig, lm_loss
from leantrain.models.mlp import MLP
from leantrain.models.vit import ViT, ViTConfig, patchify, patchify_reference

__all__ = [
    "BERT",
    "CNN",
    "GPT",
    "MLP",
    "BERTConfig",
    "DecoderStep",
    "EncDecConfig",
    "EncoderDecoder",
    "EncoderStep",
    "FeedForward",
    "GPTConfig",
    "MultiHeadAttention",
    "ResidualStack",
    "TransformerBlock",
    "ViT",
    "ViTConfig",
    "attention",
    "init_weights",
    "lm_loss",
    "mlm_mask",
    "mlm_mask_reference",
    "patchify",
    "patchify_reference",
]
