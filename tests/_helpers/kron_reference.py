"""Independent, slow references for the Kronecker-factored makers' tests.

Factors are computed here from plain forward hooks and ``torch.autograd.grad`` on the
layer outputs, with the Fisher vectors written out from their definitions, so the
tests never reuse the curvature layer's collector.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def fisher_vectors(logits: torch.Tensor, targets: torch.Tensor, kind: str) -> list:
    """Output-space vectors of mean cross-entropy: ``sum_k v v^T`` is the Fisher."""
    n = logits.shape[0]
    r = 1.0 / n
    p = torch.softmax(logits.detach(), dim=-1)
    eye = torch.eye(logits.shape[-1], dtype=logits.dtype)
    if kind == "fisher_exact":
        return [(eye[c] - p) * (r * p[:, c : c + 1]).sqrt() for c in range(p.shape[1])]
    if kind == "fisher_emp":
        return [(p - eye[targets]) * r**0.5]
    raise ValueError(kind)


def layer_data(model: nn.Module, x: torch.Tensor, names: list[str]):
    """Run ``model(x)``; return logits and each named module's (input, output)."""
    modules = dict(model.named_modules())
    store = {}
    handles = [
        modules[n].register_forward_hook(
            lambda mod, inp, out, n=n: store.__setitem__(n, (inp[0], out))
        )
        for n in names
    ]
    try:
        logits = model(x)
    finally:
        for h in handles:
            h.remove()
    return logits, store


def _rows(module: nn.Module, inp: torch.Tensor, out_grad: torch.Tensor):
    """Per-position inputs ``ã`` (N*T, U) and output-gradients (N*T, R)."""
    if isinstance(module, nn.Conv2d):
        cols = F.unfold(
            inp, module.kernel_size, module.dilation, module.padding, module.stride
        )  # (N, C*k*k, L)
        a = cols.transpose(1, 2).reshape(-1, cols.shape[1])
        e = out_grad.flatten(2).transpose(1, 2).reshape(-1, out_grad.shape[1])
    else:
        a = inp.reshape(-1, inp.shape[-1])
        e = out_grad.reshape(-1, out_grad.shape[-1])
    if module.bias is not None:
        a = torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype)], 1)
    return a, e


def kron_factors(model, x, targets, names, kind):
    """``{name: (A, B)}`` from their definitions (A over N, B summed)."""
    logits, store = layer_data(model, x, names)
    n = x.shape[0]
    out = {}
    vectors = fisher_vectors(logits, targets, kind)
    for name in names:
        module = dict(model.named_modules())[name]
        inp, outp = store[name]
        a_rows, _ = _rows(module, inp.detach(), outp.detach())
        a = a_rows.T @ a_rows / n
        b = 0
        for v in vectors:
            (g,) = torch.autograd.grad(logits, outp, v, retain_graph=True)
            _, e = _rows(module, inp.detach(), g)
            b = b + e.T @ e
        out[name] = (a, b)
    return out


def canonical_grad(module: nn.Module) -> torch.Tensor:
    """``[dW (flattened per output unit), db]``."""
    w = module.weight.grad.reshape(module.weight.shape[0], -1)
    if module.bias is None:
        return w
    return torch.cat([w, module.bias.grad.unsqueeze(1)], 1)


def dense_solve(a, b, g, damp_a=0.0, damp_b=0.0, damping=0.0):
    """``((B + dB I) ⊗ (A + dA I) + λ I)^{-1} vec(G)`` by a dense solve."""
    ea = torch.eye(a.shape[0], dtype=a.dtype)
    eb = torch.eye(b.shape[0], dtype=b.dtype)
    k = torch.kron(b + damp_b * eb, a + damp_a * ea)
    k = k + damping * torch.eye(k.shape[0], dtype=k.dtype)
    return torch.linalg.solve(k, g.reshape(-1)).reshape(g.shape)


def per_example_grads(model, loss_fn, x, t, params):
    """Stacked per-example gradients (loop over examples: slow and obvious)."""
    rows = []
    for i in range(x.shape[0]):
        loss = loss_fn(model(x[i : i + 1]), t[i : i + 1])
        rows.append(torch.autograd.grad(loss, params))
    return [torch.stack([r[k] for r in rows]) for k in range(len(params))]
