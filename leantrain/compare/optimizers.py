"""Every optimizer ``leantrain compare`` runs, under one name each.

:data:`OPTIMIZERS` maps a name to an :class:`OptimizerEntry`: a factory taking
``(model, lr, weight_decay)`` that returns a ready optimizer over all of the model's
trainable parameters, the label of its table row and a one-line note. Two lists of
its names are what the command line offers: :data:`VARIANTS` (AdamW and leantrain's
Gefen settings, ``leantrain compare --optimizers``) and :data:`PEERS` (the published
optimizers beside leantrain's, ``leantrain compare --peers`` and
``benchmarks/optimizers.py``).

Peer packages are imported inside their factory, so a peer that is not installed
(or does not import or run on this machine) fails alone, and ``leantrain compare
--peers`` and ``benchmarks/optimizers.py`` report it as ``failed: <reason>``.
Install the peers with ``--no-deps`` (their wheels would otherwise pull a CUDA
build of torch); see docs/peers.md for the exact versions and commands.

Extending: an optimizer is one entry in :data:`OPTIMIZERS`, and its name in
:data:`VARIANTS` or :data:`PEERS` puts it on the command line.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn
from torch.optim import Optimizer

Factory = Callable[[nn.Module, float, float], Optimizer]
MUON_LR = 0.02  # Keller Jordan's default for the Muon side of GefenMuon
# AdamW's default, given to every optimizer: AdamW and Gefen then differ by what the
# optimizer is, not by their settings (they share betas and eps as well).
WEIGHT_DECAY = 1e-2


class OptimizerEntry(NamedTuple):
    """One optimizer of the comparison: a factory, its table label, a note.

    Example:
        >>> import torch
        >>> from leantrain.compare.optimizers import OPTIMIZERS
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = OPTIMIZERS["adamw-fused"].factory(model, 1e-3, 0.01)
        >>> type(opt).__name__, opt.defaults["fused"]
        ('AdamW', True)
    """

    factory: Factory
    label: str
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
    return torch.optim.AdamW(_params(model), lr=lr, weight_decay=weight_decay)


def adamw_foreach(model: nn.Module, lr: float, weight_decay: float) -> Optimizer:
    return torch.optim.AdamW(
        _params(model), lr=lr, weight_decay=weight_decay, foreach=True
    )


def adamw_fused(model: nn.Module, lr: float, weight_decay: float) -> Optimizer:
    return torch.optim.AdamW(
        _params(model), lr=lr, weight_decay=weight_decay, fused=True
    )


def gefen(bits: int | None, **options) -> Factory:
    """Gefen with ``bits`` of momentum and ``options`` (its keyword options)."""

    def build(model: nn.Module, lr: float, weight_decay: float) -> Optimizer:
        from leantrain.optim import Gefen  # imported late: only when asked for

        return Gefen(
            _params(model),
            lr=lr,
            weight_decay=weight_decay,
            momentum_bits=bits,
            **options,
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


OPTIMIZERS: dict[str, OptimizerEntry] = {
    "adamw": OptimizerEntry(adamw, "AdamW", "torch.optim.AdamW, torch's defaults"),
    "adamw-foreach": OptimizerEntry(
        adamw_foreach,
        "AdamW (foreach)",
        "torch.optim.AdamW(foreach=True), the baseline",
    ),
    "adamw-fused": OptimizerEntry(
        adamw_fused, "AdamW (fused)", "torch.optim.AdamW(fused=True)"
    ),
    "gefen8": OptimizerEntry(
        gefen(8), "Gefen 8-bit", "leantrain Gefen, momentum_bits=8"
    ),
    "gefen4": OptimizerEntry(
        gefen(4), "Gefen 4-bit", "leantrain Gefen, momentum_bits=4 (factored v)"
    ),
    "gefen-fp32": OptimizerEntry(
        gefen(None), "Gefen fp32-m", "leantrain Gefen, fp32 momentum"
    ),
    "gefen8-factored": OptimizerEntry(
        gefen(8, second_moment="factored"),
        "Gefen 8-bit, factored v",
        "leantrain Gefen, momentum_bits=8, second_moment='factored'",
    ),
    "gefen4-blocks": OptimizerEntry(
        gefen(4, second_moment="blocks"),
        "Gefen 4-bit, blocks v",
        "leantrain Gefen, momentum_bits=4, second_moment='blocks'",
    ),
    "gefen4-noclip": OptimizerEntry(
        gefen(4, update_clip=None),
        "Gefen 4-bit, no clip",
        "leantrain Gefen, momentum_bits=4, update_clip=None",
    ),
    "gefen-muon": OptimizerEntry(
        gefen_muon,
        "GefenMuon 8-bit",
        "leantrain GefenMuon 8-bit, Muon lr 0.02; embeddings+head+1-D on AdamW",
    ),
    "gefen-1.2.3": OptimizerEntry(
        gefen_upstream, "gefen 1.2.3", "authors' gefen 1.2.3, fused=False on CPU"
    ),
    "adam-mini-1.1.1": OptimizerEntry(
        adam_mini,
        "Adam-mini 1.1.1",
        "Adam-mini 1.1.1 (name-based blocks; 1-D params named to Adam)",
    ),
    "bnb-adamw8bit": OptimizerEntry(
        bnb_adamw8bit,
        "bitsandbytes AdamW8bit",
        "bitsandbytes AdamW8bit (tensors < 4096 elements stay fp32)",
    ),
    "torchao-adamw8bit": OptimizerEntry(
        torchao_adamw(8),
        "torchao AdamW8bit",
        "torchao AdamW8bit (torch.compile'd step; <4096 fp32)",
    ),
    "torchao-adamw4bit": OptimizerEntry(
        torchao_adamw(4),
        "torchao AdamW4bit",
        "torchao AdamW4bit (torch.compile'd step; <4096 fp32)",
    ),
    "adafactor": OptimizerEntry(
        adafactor,
        "AdaFactor",
        "pytorch-optimizer AdaFactor, relative_step=False, bf16 momentum",
    ),
}
# AdamW and leantrain's Gefen settings: what `leantrain compare --optimizers` and
# the memory axis train (one loop, leantrain's state count).
VARIANTS = (
    "adamw",
    "gefen8",
    "gefen4",
    "gefen-fp32",
    "gefen8-factored",
    "gefen4-blocks",
    "gefen4-noclip",
)
# The published optimizers beside leantrain's: what `leantrain compare --peers` and
# benchmarks/optimizers.py run (a failing one is a table row).
PEERS = (
    "adamw-foreach",
    "adamw-fused",
    "gefen8",
    "gefen4",
    "gefen-muon",
    "gefen-1.2.3",
    "adam-mini-1.1.1",
    "bnb-adamw8bit",
    "torchao-adamw8bit",
    "torchao-adamw4bit",
    "adafactor",
)


def label(name: str) -> str:
    """The table label of optimizer ``name`` (the name itself if it has none)."""
    entry = OPTIMIZERS.get(name)
    return entry.label if entry is not None else name
