"""Bridges to the frameworks users bring: Hugging Face ``transformers`` and Lightning.

Each module here knows one framework and imports it lazily, so ``import leantrain``
never pulls a framework in; using a bridge without its framework installed raises an
``ImportError`` naming the package to install. The three axes themselves handle the
generic patterns these frameworks use (a transposed linear weight, tied weights, inputs
broadcast over the batch) without naming any framework.
"""

from leantrain.integrations.hf_layer_parallel import (
    HFLayerParallel,
    layer_parallel_hf,
)

__all__: list[str] = ["HFLayerParallel", "layer_parallel_hf"]
