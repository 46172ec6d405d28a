"""Dense references for the natural-gradient family (float64, tiny models).

Everything here is computed independently of leantrain's hooks: the curvature from
``torch.func`` (``leantrain.precond.curv.reference``), block masks from the module
shapes, and solves with ``torch.linalg.solve``. The test setup the natural-gradient
family's test modules share (``make_net``, ``batch``, ``run_maker``) lives here too.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap


class ConvNet(nn.Module):
    """Conv2d -> tanh -> Linear on 1x5x5 images (weight-shared conv)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.fc = nn.Linear(18, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.conv(x)).flatten(1))


class NormNet(nn.Module):
    """Linear -> LayerNorm -> tanh -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 5)
        self.ln = nn.LayerNorm(5)
        self.fc2 = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.ln(self.fc1(x))))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def make_net(name: str) -> nn.Module:
    """The float64 test model ``"mlp"``, ``"conv"`` or ``"norm"`` (fresh weights)."""
    nets = {
        "mlp": mlp,
        "conv": lambda: ConvNet().double(),
        "norm": lambda: NormNet().double(),
    }
    return nets[name]()


def batch(model: nn.Module, n: int = 6, seed: int = 0):
    """``(x, t)``: ``n`` float64 inputs shaped for ``model`` and 3-class targets."""
    gen = torch.Generator().manual_seed(seed)
    shape = (n, 1, 5, 5) if isinstance(model, ConvNet) else (n, 4)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    return x, torch.randint(0, 3, (n,), generator=gen)


def run_maker(gm, model: nn.Module, x, t) -> torch.Tensor:
    """One ``forward_and_backward`` of ``gm`` on a cross-entropy loss from zeroed
    gradients; returns the resulting flat ``.grad``."""
    model.zero_grad()
    y = gm.setup_model_call(model, x)
    gm.setup_loss_call(F.cross_entropy, y, t)
    gm.forward_and_backward()
    return read_grads(model)


def assert_resumes_bit_exactly(gm_a, a: nn.Module, b: nn.Module, make_maker, steps):
    """``b`` (a copy of ``a`` taken before training) gets ``a``'s weights and a fresh
    ``make_maker(b)`` gets ``gm_a``'s state dict; on the batches seeded ``steps``
    both runs then give bit-equal gradients."""
    b.load_state_dict(a.state_dict())
    gm_b = make_maker(b)
    gm_b.load_state_dict(copy.deepcopy(gm_a.state_dict()))
    for step in steps:
        assert torch.equal(
            run_maker(gm_a, a, *batch(a, seed=step)),
            run_maker(gm_b, b, *batch(b, seed=step)),
        )


def flat_grad(model: nn.Module, x, t) -> torch.Tensor:
    loss = F.cross_entropy(model(x), t)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return torch.cat([g.reshape(-1) for g in grads])


def per_example_grads(model: nn.Module, x, t) -> torch.Tensor:
    """``(N, P)`` gradients of each example's own loss (``vmap(grad)``)."""
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss(p, xi, ti):
        out = functional_call(model, p, (xi.unsqueeze(0),))
        return F.cross_entropy(out, ti.unsqueeze(0))

    g = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, t)
    return torch.cat([g[n].reshape(x.shape[0], -1) for n in params], dim=1)


def module_slices(model: nn.Module) -> list[tuple[str, nn.Module, slice]]:
    """Each module owning parameters with its slice of the flat parameter vector."""
    out, start = [], 0
    for name, m in model.named_modules():
        own = list(m.parameters(recurse=False))
        if own:
            size = sum(p.numel() for p in own)
            out.append((name, m, slice(start, start + size)))
            start += size
    return out


def block_mask(model: nn.Module, shape: str) -> torch.Tensor:
    """Boolean ``(P, P)`` mask of the blocks a representation keeps."""
    p = sum(q.numel() for q in model.parameters())
    mask = torch.zeros(p, p, dtype=torch.bool)
    if shape == "full":
        return ~mask
    if shape == "diag":
        return torch.eye(p, dtype=torch.bool)
    for _, m, sl in module_slices(model):
        if shape == "layer":
            mask[sl, sl] = True
            continue
        # unit: output unit i = weight[i] (flattened) and bias[i]; LayerNorm: [w_i, b_i]
        w = m.weight
        rows = w.shape[0]
        per_row = w[0].numel() if w.dim() > 1 else 1
        for i in range(rows):
            idx = [sl.start + i * per_row + j for j in range(per_row)]
            if getattr(m, "bias", None) is not None:
                idx.append(sl.start + w.numel() + i)
            ix = torch.tensor(idx)
            mask[ix.unsqueeze(1), ix.unsqueeze(0)] = True
    return mask


def damped_solve(matrix: torch.Tensor, g: torch.Tensor, damping: float):
    eye = torch.eye(matrix.shape[0], dtype=matrix.dtype)
    return torch.linalg.solve(matrix + damping * eye, g)


def read_grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])
