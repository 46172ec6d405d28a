"""SengGradientMaker: layer-wise SMW with sketching and truncation vs dense solves."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _ng_reference import (
    ConvNet,
    NormNet,
    block_mask,
    damped_solve,
    flat_grad,
    mlp,
    module_slices,
    per_example_grads,
    read_grads,
)
from torch import nn

from leantrain.precond import PreconditioningConfig
from leantrain.precond.curv import dense_empirical_fisher
from leantrain.precond.seng import SengGradientMaker

DAMPING = 1e-2


def _batch(model, n=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (n, 1, 5, 5) if isinstance(model, ConvNet) else (n, 4)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    return x, torch.randint(0, 3, (n,), generator=gen)


def _run(gm, model, x, t):
    model.zero_grad()
    y = gm.setup_model_call(model, x)
    gm.setup_loss_call(F.cross_entropy, y, t)
    gm.forward_and_backward()
    return read_grads(model)


def _layerwise(model, fisher, g, rank=None):
    """Per module: (top-``rank`` eigen-part of F_m + damping I)^{-1} g_m."""
    out = torch.empty_like(g)
    for _, _, sl in module_slices(model):
        block = fisher[sl, sl]
        if rank is not None:
            vals, vecs = torch.linalg.eigh(block)
            vals, vecs = vals[-rank:], vecs[:, -rank:]
            block = vecs @ torch.diag(vals) @ vecs.T
        out[sl] = damped_solve(block, g[sl], DAMPING)
    return out


@pytest.mark.parametrize("net", ["mlp", "conv", "norm"])
def test_exact_when_sketch_covers_the_batch(net):
    torch.manual_seed(0)
    model = {
        "mlp": mlp,
        "conv": lambda: ConvNet().double(),
        "norm": lambda: NormNet().double(),
    }[net]()
    x, t = _batch(model)
    fisher = dense_empirical_fisher(model, nn.CrossEntropyLoss(), x, t)
    fisher = torch.where(block_mask(model, "layer"), fisher, 0 * fisher)
    expected = damped_solve(fisher, flat_grad(model, x, t), DAMPING)
    gm = SengGradientMaker(
        model,
        PreconditioningConfig(damping=DAMPING),
        sketching_size=6,
        truncated_rank=None,
    )
    torch.testing.assert_close(_run(gm, model, x, t), expected, rtol=1e-9, atol=1e-11)


def test_truncated_rank_keeps_top_eigenpairs():
    torch.manual_seed(0)
    model = mlp()
    x, t = _batch(model, n=8)
    fisher = dense_empirical_fisher(model, nn.CrossEntropyLoss(), x, t)
    expected = _layerwise(model, fisher, flat_grad(model, x, t), rank=3)
    gm = SengGradientMaker(
        model,
        PreconditioningConfig(damping=DAMPING),
        sketching_size=64,
        truncated_rank=3,
    )
    torch.testing.assert_close(_run(gm, model, x, t), expected, rtol=1e-8, atol=1e-10)


def test_sketch_uses_drawn_examples_rescaled():
    """Sketch of s < N examples: F = (1/s) sum over the drawn examples of g g^T."""
    torch.manual_seed(0)
    model = mlp()
    x, t = _batch(model, n=8)
    keep = torch.randperm(8, generator=torch.Generator().manual_seed(5))[:3]
    u = per_example_grads(model, x, t)[keep]
    fisher = u.T @ u / 3
    expected = _layerwise(model, fisher, flat_grad(model, x, t))
    gm = SengGradientMaker(
        model,
        PreconditioningConfig(damping=DAMPING),
        sketching_size=3,
        truncated_rank=None,
        seed=5,
    )
    torch.testing.assert_close(_run(gm, model, x, t), expected, rtol=1e-8, atol=1e-10)


def test_interval_and_state_dict():
    torch.manual_seed(0)
    cfg = PreconditioningConfig(
        damping=DAMPING, curvature_interval=3, preconditioner_interval=3
    )
    a = mlp()
    b = copy.deepcopy(a)
    gm_a = SengGradientMaker(a, cfg, sketching_size=4, truncated_rank=2)
    seen = []
    for step in range(4):
        _run(gm_a, a, *_batch(a, seed=step))
        seen.append(gm_a.eigen["0"][1])
    assert seen[0] is seen[1] is seen[2] and seen[3] is not seen[2]
    assert gm_a.curvature_updates == 2
    b.load_state_dict(a.state_dict())
    gm_b = SengGradientMaker(b, cfg, sketching_size=4, truncated_rank=2, seed=7)
    gm_b.load_state_dict(copy.deepcopy(gm_a.state_dict()))
    for step in range(4, 8):  # crosses a curvature step with a fresh sketch
        assert torch.equal(
            _run(gm_a, a, *_batch(a, seed=step)), _run(gm_b, b, *_batch(b, seed=step))
        )


def test_errors():
    with pytest.raises(ValueError, match="sketching_size must be >= 1"):
        SengGradientMaker(mlp(), sketching_size=0)
    with pytest.raises(TypeError, match="truncated_rank must be an int"):
        SengGradientMaker(mlp(), truncated_rank=2.5)
    with pytest.raises(ValueError, match="ema_decay"):
        SengGradientMaker(mlp(), PreconditioningConfig(ema_decay=0.5))
