"""The optimizers leantrain is compared with, and how their memory is measured.

``PEERS`` maps a name to a :class:`Peer`: a factory taking ``(model, lr,
weight_decay)`` that returns a ready optimizer over all of the model's trainable
parameters, and a one-line note. Peer packages are imported inside their factory,
so a peer that is not installed (or does not import or run on this machine) fails
alone, and ``leantrain compare --peers`` and ``benchmarks/optimizers.py`` report it
as ``failed: <reason>``.

Install the peers with ``--no-deps`` (their wheels would otherwise pull a CUDA
build of torch); see docs/peers.md for the exact versions and commands.

Measurement, shared by the CLI and the benchmark: :func:`state_nbytes` counts every
state tensor (tensor subclasses opened, top-level tensors of
:func:`extra_state_tensors` included, each storage once) and :func:`measured_step`
times one ``step()`` and the resident memory it adds (Linux ``/proc``).
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

Factory = Callable[[nn.Module, float, float], Optimizer]
MUON_LR = 0.02  # Keller Jordan's default for the Muon side of GefenMuon


class Peer(NamedTuple):
    """One optimizer of the comparison: a factory and a one-line note.

    Example:
        >>> import torch
        >>> from leantrain.peers import PEERS
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = PEERS["adamw-fused"].factory(model, 1e-3, 0.01)
        >>> type(opt).__name__, opt.defaults["fused"]
        ('AdamW', True)
    """

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
    "gefen-4bit": Peer(gefen(4), "leantrain Gefen, momentum_bits=4 (factored v)"),
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


# --- measurement -------------------------------------------------------------------

try:  # glibc: malloc_trim lets the step's temporaries show up as new pages
    _LIBC: ctypes.CDLL | None = ctypes.CDLL("libc.so.6")
except OSError:
    _LIBC = None


def _inner_tensors(value: object) -> list[Tensor]:
    """Plain tensors inside a state value; opens tensor subclasses (torchao)."""
    if isinstance(value, Tensor):
        if type(value) is not Tensor and hasattr(value, "__tensor_flatten__"):
            names, _ = value.__tensor_flatten__()
            return [t for n in names for t in _inner_tensors(getattr(value, n))]
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _inner_tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _inner_tensors(v)]
    return []


def state_nbytes(optimizer: Optimizer) -> int:
    """Bytes of the optimizer's state tensors, each storage counted once.

    Counts every tensor in ``optimizer.state`` (tensor subclasses such as torchao's
    opened into their inner tensors) plus :func:`extra_state_tensors`.
    """
    tensors = _inner_tensors(list(optimizer.state.values()))
    tensors += extra_state_tensors(optimizer)
    sizes = {}
    for t in tensors:
        storage = t.untyped_storage()
        # A live allocation has one address; empty storages (address 0) weigh 0.
        sizes[(str(t.device), storage.data_ptr())] = storage.nbytes()
    return sum(sizes.values())


def _proc_status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def _reset_peak_rss() -> bool:
    """Returns freed heap memory to the OS, then resets VmHWM to the current RSS."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:  # not Linux, or /proc not writable
        return False


class StepMeasure(NamedTuple):
    """What :func:`measured_step` saw: seconds, and extra peak RSS (None if unknown)."""

    seconds: float
    peak_bytes: int | None


def measured_step(optimizer: Optimizer) -> StepMeasure:
    """Run ``optimizer.step()``; return its wall time and the peak RSS it added.

    VmHWM is reset by writing "5" to ``/proc/self/clear_refs`` just before the step
    (after glibc's ``malloc_trim(0)`` hands freed heap pages back); the step's peak is
    VmHWM after it minus VmRSS before it. Freed memory the allocator still holds and
    reuses is not seen, so this is a lower bound on the step's temporaries. Where
    ``/proc`` cannot be used, ``peak_bytes`` is None.
    """
    tracked = _reset_peak_rss()
    rss_before = _proc_status_kib("VmRSS") if tracked else 0
    t0 = time.perf_counter()
    optimizer.step()
    seconds = time.perf_counter() - t0
    if not tracked:
        return StepMeasure(seconds, None)
    return StepMeasure(seconds, 1024 * (_proc_status_kib("VmHWM") - rss_before))
