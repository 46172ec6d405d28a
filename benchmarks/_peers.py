"""The optimizers leantrain is compared with: name -> (factory, note).

A factory takes ``(model, lr, weight_decay)`` and returns a ready optimizer over all
of the model's trainable parameters. Peer packages are imported inside their
factory, so a peer that is not installed (or does not import or run on this
machine) fails alone, and the benchmark reports it as ``failed: <reason>``.

Install the peers with ``--no-deps`` (their wheels would otherwise pull a CUDA
build of torch); see docs/peers.md for the exact versions and commands.

``extra_state_tensors(opt)`` returns tensors a peer keeps outside
``optimizer.state`` (its "top-level" state), so state bytes count them too.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

Factory = Callable[[nn.Module, float, float], Optimizer]
MUON_LR = 0.02  # Keller Jordan's default for the Muon side of GefenMuon


class Peer(NamedTuple):
    """One optimizer of the comparison."""

    factory: Factory
    note: str


def _params(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _quiet(build: Callable[[], Optimizer]) -> Optimizer:
    """Builds a peer that prints banners on construction, without the banners."""
    with contextlib.redirect_stdout(io.StringIO()):
        return build()


def _head_modules(model: nn.Module) -> list[nn.Module]:
    """The output head: ``lm_head``/``fc``/``head`` if the model has one, else the
    last ``nn.Linear`` (what a classifier's logits come from)."""
    for name in ("lm_head", "fc", "head_linear"):
        module = getattr(model, name, None)
        if isinstance(module, nn.Module):
            return [module]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return linears[-1:]


def adamw(model: nn.Module, lr: float, weight_decay: float) -> Optimizer:
    return torch.optim.AdamW(
        _params(model), lr=lr, weight_decay=weight_decay, foreach=True
    )


def adamw_fused(model: nn.Module, lr: float, weight_decay: float) -> Optimizer:
    return torch.optim.AdamW(
        _params(model), lr=lr, weight_decay=weight_decay, fused=True
    )


def gefen(bits: int | None) -> Factory:
    def build(model: nn.Module, lr: float, weight_decay: float) -> Optimizer:
        from leantrain.optim import Gefen

        return Gefen(
            _params(model), lr=lr, weight_decay=weight_decay, momentum_bits=bits
        )

    return build


def gefen_muon(model: nn.Module, lr: float, weight_decay: float) -> Optimizer:
    from leantrain.optim.muon import GefenMuon, muon_param_groups

    groups = muon_param_groups(model, adamw_modules=_head_modules(model))
    # Muon side: Keller Jordan's defaults (lr 0.02, "original" lr adjustment); with
    # "match_rms_adamw" and AdamW's lr it trained clearly worse in these short runs.
    # The AdamW side (embeddings, head, 1-D params) uses the task's AdamW settings.
    return GefenMuon(
        groups,
        lr=MUON_LR,
        weight_decay=weight_decay,
        adamw_lr=lr,
        adamw_betas=(0.9, 0.999),
        adamw_eps=1e-8,
        adamw_weight_decay=weight_decay,
    )


def gefen_upstream(model: nn.Module, lr: float, weight_decay: float) -> Optimizer:
    from gefen import Gefen as UpstreamGefen

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return _quiet(
        lambda: UpstreamGefen(
            named, lr=lr, weight_decay=weight_decay, fused=False, verbose=False
        )
    )


def adam_mini(model: nn.Module, lr: float, weight_decay: float) -> Optimizer:
    from adam_mini import Adam_mini

    config = getattr(model, "config", None)
    # Adam-mini partitions by parameter *names* and head counts; non-transformer
    # models fall back to its default (one lr per tensor/neuron).
    dim = getattr(config, "d_model", 2048)
    heads = getattr(config, "n_head", 32)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = _quiet(
        lambda: Adam_mini(
            named,
            lr=lr,
            weight_decay=weight_decay,
            dim=dim,
            n_heads=heads,
            verbose=False,
        )
    )
    # Its substring rules send e.g. "ln_mlp.weight" (1-D, contains "mlp") to the
    # per-neuron matrix branch, which raises IndexError. Its documented fix is to
    # extend the name sets: every 1-D parameter goes to its per-element Adam branch.
    for name, p in named:
        if p.ndim < 2:
            opt.adam_block_names.add(name.lower())
    return opt


def bnb_adamw8bit(model: nn.Module, lr: float, weight_decay: float) -> Optimizer:
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(_params(model), lr=lr, weight_decay=weight_decay)


def torchao_adamw(bits: int) -> Factory:
    def build(model: nn.Module, lr: float, weight_decay: float) -> Optimizer:
        from torchao import optim as ao

        cls = ao.AdamW8bit if bits == 8 else ao.AdamW4bit
        return _quiet(lambda: cls(_params(model), lr=lr, weight_decay=weight_decay))

    return build


def adafactor(model: nn.Module, lr: float, weight_decay: float) -> Optimizer:
    from pytorch_optimizer import AdaFactor

    # relative_step/scale_parameter off: use the given lr like every other peer
    # (by default AdaFactor ignores lr); its momentum is bf16 by default.
    return AdaFactor(
        _params(model),
        lr=lr,
        weight_decay=weight_decay,
        relative_step=False,
        scale_parameter=False,
        warmup_init=False,
    )


PEERS: dict[str, Peer] = {
    "adamw-foreach": Peer(adamw, "torch.optim.AdamW(foreach=True), the baseline"),
    "adamw-fused": Peer(adamw_fused, "torch.optim.AdamW(fused=True)"),
    "gefen-8bit": Peer(gefen(8), "leantrain Gefen, momentum_bits=8"),
    "gefen-4bit": Peer(gefen(4), "leantrain Gefen, momentum_bits=4"),
    "gefen-muon": Peer(
        gefen_muon,
        "leantrain GefenMuon 8-bit, Muon lr 0.02; embeddings+head+1-D on AdamW",
    ),
    "gefen-1.2.3": Peer(gefen_upstream, "authors' gefen 1.2.3, fused=False on CPU"),
    "adam-mini-1.1.1": Peer(
        adam_mini, "Adam-mini 1.1.1 (name-based blocks; 1-D params named to Adam)"
    ),
    "bnb-adamw8bit": Peer(
        bnb_adamw8bit, "bitsandbytes AdamW8bit (tensors < 4096 elements stay fp32)"
    ),
    "torchao-adamw8bit": Peer(
        torchao_adamw(8), "torchao AdamW8bit (torch.compile'd step; <4096 fp32)"
    ),
    "torchao-adamw4bit": Peer(
        torchao_adamw(4), "torchao AdamW4bit (torch.compile'd step; <4096 fp32)"
    ),
    "adafactor": Peer(
        adafactor, "pytorch-optimizer AdaFactor, relative_step=False, bf16 momentum"
    ),
}


def extra_state_tensors(optimizer: Optimizer) -> list[Tensor]:
    """Tensors a peer keeps on the optimizer object rather than in ``.state``.

    * gefen 1.2.3: ``_gefen_codebook`` (the 256-entry codebook, 1 KB).
    * bitsandbytes: ``name2qmap`` (the 256-entry dynamic maps; also referenced from
      each quantized parameter's state, and counted once).
    Everyone else keeps all tensors in ``.state``.
    """
    extra: list[Tensor] = []
    codebook = getattr(optimizer, "_gefen_codebook", None)
    if isinstance(codebook, Tensor):
        extra.append(codebook)
    qmaps = getattr(optimizer, "name2qmap", None)
    if isinstance(qmaps, dict):
        extra += [t for t in qmaps.values() if isinstance(t, Tensor)]
    return extra
