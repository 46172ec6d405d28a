"""Monte-Carlo Fisher: averaged over samples, unbiased for the exact Fisher."""

from __future__ import annotations

import torch
from torch import nn

from leantrain.precond.curv import curvature
from tests._helpers.curv_models import make_case, rel_err


def test_fisher_mc_converges_to_fisher_exact():
    """Trace ratio within 2% at n_mc_samples=4 over 300 draws (cross-entropy)."""
    case = make_case("mlp", n=8)
    loss, targets = "cross_entropy", case.ce_targets
    exact = curvature(
        case.model, loss, case.inputs, targets, kind="fisher_exact", shape="diag"
    )
    gen = torch.Generator().manual_seed(0)
    traces = [
        curvature(
            case.model,
            loss,
            case.inputs,
            targets,
            kind="fisher_mc",
            shape="diag",
            n_mc_samples=4,
            generator=gen,
        ).trace()
        for _ in range(300)
    ]
    ratio = sum(traces) / len(traces) / exact.trace()
    assert abs(ratio - 1.0) < 0.02, ratio


def test_fisher_mc_mse_converges_to_fisher_exact():
    """MSE samples y ~ N(z, I/2), the likelihood whose NLL is (y - z)^2. The average
    of 300 draws of 4 samples is one call with 1200 samples (see the next test)."""
    case = make_case("mlp", n=8)
    args = (case.model, "mse", case.inputs, case.mse_targets)
    exact = curvature(*args, kind="fisher_exact", shape="diag")
    gen = torch.Generator().manual_seed(1)
    mc = curvature(
        *args, kind="fisher_mc", shape="diag", n_mc_samples=1200, generator=gen
    )
    assert abs(mc.trace() / exact.trace() - 1.0) < 0.02
    assert rel_err(mc.diagonal(), exact.diagonal()) < 0.1


def test_fisher_mc_is_the_average_of_its_samples():
    """n samples are averaged (ASDL scales them by 1/n once more)."""
    case = make_case("embed_ln")
    loss = nn.CrossEntropyLoss()
    many = curvature(
        case.model,
        loss,
        case.inputs,
        case.ce_targets,
        kind="fisher_mc",
        shape="full",
        n_mc_samples=3,
        generator=torch.Generator().manual_seed(7),
    ).to_dense()
    gen = torch.Generator().manual_seed(7)  # same stream, one draw at a time
    singles = [
        curvature(
            case.model,
            loss,
            case.inputs,
            case.ce_targets,
            kind="fisher_mc",
            shape="full",
            generator=gen,
        ).to_dense()
        for _ in range(3)
    ]
    assert rel_err(many, sum(singles) / 3) < 1e-12
    assert not torch.allclose(singles[0], singles[1])


def test_fisher_mc_reproducible_with_generator():
    case = make_case("mlp")
    run = [
        curvature(
            case.model,
            "mse",
            case.inputs,
            case.mse_targets,
            kind="fisher_mc",
            shape="kron",
            generator=torch.Generator().manual_seed(3),
        ).to_dense()
        for _ in range(2)
    ]
    assert torch.equal(run[0], run[1])
