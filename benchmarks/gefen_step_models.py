"""Whole-model optimizer steps and their bandwidth (``gefen_step.py --model``).

Every contender steps the same model with the same fixed gradients:

* torch AdamW, default (foreach on CPU) and ``fused=True``;
* Gefen 8-bit and 4-bit with every other option at its default, and 8-bit with
  ``second_moment="factored"`` (``opt.step``, everything a training loop pays: the
  non-finite check, the per-step bookkeeping, the kernel);
* ``p.add_(g)`` over every parameter: the memory-traffic reference, a step that
  reads p and g and writes p and does nothing else.

Bandwidth is nominal bytes moved / time. The bytes are counted from the tensors a
step must touch, once each: AdamW reads p, g, m, v and writes p, m, v (28 bytes
per fp32 parameter); ``p.add_(g)`` reads p, g and writes p (12); Gefen reads p, g
and every state tensor and writes p and every state tensor (8-bit: 4 + 4 + 1 + 4
+ 1 = 14 bytes plus the block scales), and a factored second moment reads g once
more for its row and column sums. A step faster than ``p.add_(g)``'s bandwidth
would mean the count is wrong; one far below it is compute- or overhead-bound.

Contenders run round-robin, one step of each per round, so the load of a shared
machine hits them alike; the load average is printed beside the table.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable

import torch
from torch import nn

from leantrain.optim import Gefen

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def stack_model() -> nn.Module:
    """A ~29.3 M-parameter transformer-like stack: an embedding and three MLP
    blocks with a LayerNorm each (the shapes, not the forward, matter here)."""
    layers: list[nn.Module] = [nn.Embedding(4000, 1024)]
    for _ in range(3):
        layers += [nn.Linear(1024, 4096), nn.Linear(4096, 1024), nn.LayerNorm(1024)]
    return nn.Sequential(*layers)


def gpt_model() -> nn.Module:
    """leantrain's GPT.default() (~0.87 M parameters in about 60 tensors)."""
    from leantrain.models.gpt import GPT

    return GPT.default()


MODELS: dict[str, Callable[[], nn.Module]] = {"stack": stack_model, "gpt": gpt_model}


def _with_grads(build: Callable[[], nn.Module]) -> list[nn.Parameter]:
    torch.manual_seed(0)
    params = list(build().parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2  # fixed: every step sees the same
    return params


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the per-parameter state a step reads and writes (scalars left out)."""
    total = 0
    for state in opt.state.values():
        for key, t in state.items():
            if torch.is_tensor(t) and t.numel() > 1 and key != "codebook":
                total += t.numel() * t.element_size()
    return total


def _factored_grad_bytes(opt: torch.optim.Optimizer) -> int:
    """Gradient bytes read a second time by the factor statistics' pass."""
    return sum(
        p.grad.numel() * p.grad.element_size()
        for p, state in opt.state.items()
        if "factored" in state
    )


class Contender:
    """One optimizer (or the reference) on its own copy of the model."""

    def __init__(self, name: str, build: Callable[[], nn.Module], kind: str):
        self.name = name
        self.params = _with_grads(build)
        p_bytes = sum(p.numel() * p.element_size() for p in self.params)
        g_bytes = sum(p.grad.numel() * p.grad.element_size() for p in self.params)
        if kind == "add":
            grads = [p.grad for p in self.params]

            def step() -> None:
                with torch.no_grad():
                    for p, g in zip(self.params, grads, strict=True):
                        p.add_(g)

            self.step = step
            self.bytes = 2 * p_bytes + g_bytes
            return
        if kind == "adamw":
            opt = torch.optim.AdamW(self.params, **HYPER)
        elif kind == "adamw-fused":
            opt = torch.optim.AdamW(self.params, **HYPER, fused=True)
        else:  # "8", "4", or "8b": 8-bit with blocks (nearest codes: the fast path)
            extra = {"second_moment": "blocks"} if kind.endswith("b") else {}
            opt = Gefen(self.params, **HYPER, momentum_bits=int(kind[0]), **extra)
        opt.step()  # creates the state (and Gefen's partition and codebook)
        self.step = opt.step
        self.bytes = (
            2 * p_bytes + g_bytes + 2 * _state_bytes(opt) + _factored_grad_bytes(opt)
        )


CONTENDERS = (
    ("torch AdamW (default, foreach)", "adamw"),
    ("torch AdamW (fused=True)", "adamw-fused"),
    ("Gefen 8-bit (defaults)", "8"),
    ("Gefen 4-bit (defaults)", "4"),
    ("Gefen 8-bit, blocks v", "8b"),
    ("p.add_(g) (bandwidth reference)", "add"),
)


def run(model: str, repeats: int, clock, peak_extra_bytes) -> None:
    """Prints the table for one model: ms/step, ratios, bandwidth, peak extra."""
    build = MODELS[model]
    contenders = [Contender(name, build, kind) for name, kind in CONTENDERS]
    n = sum(p.numel() for p in contenders[0].params)
    load_before = os.getloadavg()
    times: dict[str, list[float]] = {c.name: [] for c in contenders}
    for round_ in range(repeats + 1):  # round 0 is the warm-up
        for c in contenders:
            start = clock()
            c.step()
            if round_:
                times[c.name].append(clock() - start)
    load_after = os.getloadavg()
    rows = [
        (c, statistics.median(times[c.name]), peak_extra_bytes(c.step))
        for c in contenders
    ]
    base, fused = rows[0][1], rows[1][1]
    add_bw = rows[-1][0].bytes / rows[-1][1]
    print(
        f"{model}: {n:,} parameters in {len(contenders[0].params)} tensors, "
        f"{torch.get_num_threads()} threads, median of {repeats} round-robin rounds; "
        f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after"
    )
    width = max(len(c.name) for c in contenders)
    header = (
        f"{'step':{width}s} {'ms/step':>9s} {'/AdamW':>7s} {'/fused':>7s} "
        f"{'B/param':>8s} {'GB/s':>6s} {'/add_':>6s} {'peak extra':>11s}"
    )
    print(header)
    print("-" * len(header))
    for c, seconds, extra in rows:
        bw = c.bytes / seconds
        frac = "n/a" if extra is None else f"{extra / (4 * n):.3f}x p"
        print(
            f"{c.name:{width}s} {seconds * 1e3:9.2f} {seconds / base:7.2f} "
            f"{seconds / fused:7.2f} {c.bytes / n:8.1f} {bw / 1e9:6.2f} "
            f"{bw / add_bw:6.2f} {frac:>11s}"
        )
