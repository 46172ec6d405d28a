"""SengGradientMaker: layer-wise SMW with sketching and truncation vs dense solves."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from leantrain.precond import PreconditioningConfig
from leantrain.precond.curv import dense_empirical_fisher
from leantrain.precond.methods.seng import SengGradientMaker
from tests._helpers.ng_reference import (
    assert_resumes_bit_exactly,
    batch,
    block_mask,
    damped_solve,
    flat_grad,
    make_net,
    mlp,
    module_slices,
    per_example_grads,
    run_maker,
)

DAMPING = 1e-2


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
    model = make_net(net)
    x, t = batch(model)
    fisher = dense_empirical_fisher(model, nn.CrossEntropyLoss(), x, t)
    fisher = torch.where(block_mask(model, "layer"), fisher, 0 * fisher)
    expected = damped_solve(fisher, flat_grad(model, x, t), DAMPING)
    gm = SengGradientMaker(
        model,
        PreconditioningConfig(damping=DAMPING),
        sketching_size=6,
        truncated_rank=None,
    )
    torch.testing.assert_close(
        run_maker(gm, model, x, t), expected, rtol=1e-9, atol=1e-11
    )


def test_truncated_rank_keeps_top_eigenpairs():
    torch.manual_seed(0)
    model = mlp()
    x, t = batch(model, n=8)
    fisher = dense_empirical_fisher(model, nn.CrossEntropyLoss(), x, t)
    expected = _layerwise(model, fisher, flat_grad(model, x, t), rank=3)
    gm = SengGradientMaker(
        model,
        PreconditioningConfig(damping=DAMPING),
        sketching_size=64,
        truncated_rank=3,
    )
    torch.testing.assert_close(
        run_maker(gm, model, x, t), expected, rtol=1e-8, atol=1e-10
    )


def test_sketch_uses_drawn_examples_rescaled():
    """Sketch of s < N examples: F = (1/s) sum over the drawn examples of g g^T."""
    torch.manual_seed(0)
    model = mlp()
    x, t = batch(model, n=8)
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
    torch.testing.assert_close(
        run_maker(gm, model, x, t), expected, rtol=1e-8, atol=1e-10
    )


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
        run_maker(gm_a, a, *batch(a, seed=step))
        seen.append(gm_a.eigen["0"][1])
    assert seen[0] is seen[1] is seen[2] and seen[3] is not seen[2]
    assert gm_a.curvature_updates == 2
    assert_resumes_bit_exactly(
        gm_a,
        a,
        b,
        lambda m: SengGradientMaker(m, cfg, sketching_size=4, truncated_rank=2, seed=7),
        range(4, 8),  # crosses a curvature step with a fresh sketch
    )


def test_errors():
    with pytest.raises(ValueError, match="sketching_size must be >= 1"):
        SengGradientMaker(mlp(), sketching_size=0)
    with pytest.raises(TypeError, match="truncated_rank must be an int"):
        SengGradientMaker(mlp(), truncated_rank=2.5)
    with pytest.raises(ValueError, match="ema_decay"):
        SengGradientMaker(mlp(), PreconditioningConfig(ema_decay=0.5))
