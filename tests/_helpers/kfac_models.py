"""Small models, batches and one-step helpers shared by the K-FAC tests."""

from __future__ import annotations

import copy
import io

import torch
import torch.nn.functional as F
from torch import nn


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 16, 3)
    ).double()


def batch(shape=(10, 4)):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    t = torch.randint(0, 3, (shape[0],), generator=g)
    return x, t


def step(gm, model, x, t):
    model.zero_grad()
    y = gm.setup_model_call(model, x)
    gm.setup_loss_call(F.cross_entropy, y, t)
    return gm.forward_and_backward()


def plain_grads(model, x, t):
    ref = copy.deepcopy(model)
    F.cross_entropy(ref(x), t).backward()
    return ref


def factor_dampings(a, b, lam, mode):
    """``(damp_a, damp_b)`` of the ``"pi"`` or ``"tikhonov"`` rule, written out."""
    if mode == "pi":
        pi = ((a.trace() / a.shape[0]) / (b.trace() / b.shape[0])).sqrt()
        return pi * lam**0.5, lam**0.5 / pi
    return lam**0.5, lam**0.5


def assert_resume_bit_exact(
    make_gm, model, data, step_fn=step, *, split=2, on_save=None, on_load=None
):
    """Train ``make_gm(model)`` on ``data[:split]``, save its ``state_dict`` (through
    ``torch.save``), go on with ``data[split:]``; a new maker on a copy of the model
    taken at the save, loaded from those bytes, must then give the same gradients
    bit for bit. ``on_save(state_dict)`` / ``on_load(maker)`` add checks."""
    gm = make_gm(model)
    for x, t in data[:split]:
        step_fn(gm, model, x, t)
    buf = io.BytesIO()
    torch.save(gm.state_dict(), buf)
    if on_save is not None:
        on_save(gm.state_dict())
    model2 = copy.deepcopy(model)
    for x, t in data[split:]:
        step_fn(gm, model, x, t)
    buf.seek(0)
    gm2 = make_gm(model2)
    gm2.load_state_dict(torch.load(buf))
    if on_load is not None:
        on_load(gm2)
    for x, t in data[split:]:
        step_fn(gm2, model2, x, t)
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
