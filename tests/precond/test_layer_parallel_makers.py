"""Gradient makers on a GPT whose stack is a LayerParallel, against the serial GPT.

With MGRIT iterated to exactness the layer-parallel forward and adjoint equal the
serial ones to rounding, so every maker's preconditioned gradient (and its curvature)
must equal the serial model's: the hooks see each layer once, in the final forward
sweep and the final adjoint sweep, never in MGRIT's other evaluations. Makers that
differentiate twice or use ``torch.func`` raise an error naming LayerParallel in
parallel mode and equal the serial model after ``.serial()``.
"""

from __future__ import annotations

import copy

import pytest
import torch

from leantrain.layer_parallel import LayerParallel
from leantrain.models import GPT
from leantrain.models.gpt import GPTConfig, lm_loss
from leantrain.precond import DiagonalEmpiricalFisherGradientMaker, curvature
from leantrain.precond.registry import make_gradient_maker

VOCAB, T, BATCH = 16, 6, 3
# Four layers, cf 2: two V-cycles reach the serial trajectory (to rounding).
EXACT = {"levels": 2, "cf": 2, "fwd_iters": 2, "bwd_iters": 2}
# A deeper setting: eight layers of width 16, four V-cycles each way.
DEEP = {"levels": 2, "cf": 2, "fwd_iters": 4, "bwd_iters": 4}


def pair(*, d_model=8, mlp_ratio=2, n_layer=4, **lp):
    """(serial GPT, the same GPT with a LayerParallel stack), float64."""
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=VOCAB,
        block_size=T,
        n_layer=n_layer,
        n_head=2,
        d_model=d_model,
        mlp_ratio=mlp_ratio,
        t_final=1.0,
    )
    serial = GPT(config).double()
    layered = copy.deepcopy(serial)
    layered.stack = LayerParallel(layered.stack, t_final=1.0, **(lp or EXACT))
    return serial, layered


def batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (BATCH, T), generator=g)
    return x, torch.randint(0, VOCAB, (BATCH, T), generator=g)


def make(name, model, **kwargs):
    # The position embedding sees (T,), not the batch: the collector needs dim 0.
    config = {"damping": 1e-2, "ignore_modules": ["wpe"]}
    return make_gradient_maker(name, model, config=config, **kwargs)


def train(gm, model, steps=1):
    """``steps`` maker steps with SGD between them; the last step's gradients."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = batch(step + 1)
        opt.zero_grad()
        out = gm.setup_model_call(model, x)
        gm.setup_loss_call(lm_loss, out, y)
        gm.forward_and_backward()
        if step < steps - 1:
            opt.step()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def assert_equal(serial, layered, tol=1e-8):
    err = float((serial - layered).norm() / serial.norm())
    assert err < tol, f"relative difference {err:.3g}"


# Makers that keep state across steps run two (K-BFGS: a secant pair; PSGD: a fit).
STEPS = {"kbfgs": 2, "psgd": 2}
FIRST_ORDER = {
    "kfac": {},
    "ekfac": {},
    "shampoo": {},
    "kbfgs": {},
    "seng": {"sketching_size": 4, "truncated_rank": 2},
    "smw_ng": {},
    "ng_unit": {},
    "ng_diag": {},
    "psgd": {"mode": "whitening"},
}


@pytest.mark.parametrize("name", sorted(FIRST_ORDER))
def test_first_order_makers_equal_serial(name):
    serial, layered = pair()
    steps = STEPS.get(name, 1)
    want = train(make(name, serial, **FIRST_ORDER[name]), serial, steps)
    got = train(make(name, layered, **FIRST_ORDER[name]), layered, steps)
    assert_equal(want, got)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FIRST_ORDER))
def test_first_order_makers_equal_serial_issue_setting(name):
    serial, layered = pair(d_model=16, mlp_ratio=4, n_layer=8, **DEEP)
    want = train(make(name, serial, **FIRST_ORDER[name]), serial, 2)
    got = train(make(name, layered, **FIRST_ORDER[name]), layered, 2)
    assert_equal(want, got)


@pytest.mark.parametrize("name", ["ng_full", "ng_layer"])
def test_dense_natural_gradient_equals_serial(name):
    serial, layered = pair(mlp_ratio=1)
    assert_equal(train(make(name, serial), serial), train(make(name, layered), layered))


def test_kfac_factors_equal_serial():
    # One factor per layer and site, from the final sweeps only: MGRIT's other
    # evaluations (coarse steps with a larger dt, relaxation) would change A and B.
    serial, layered = pair()
    makers = [make("kfac", m, low_rank=False) for m in (serial, layered)]
    for gm, model in zip(makers, (serial, layered), strict=True):
        train(gm, model, steps=1)
    want, got = (gm.factors for gm in makers)
    assert sorted(want) == sorted(got)
    assert any("A" in f for f in want.values())
    for name in want:
        if "unit" in want[name]:  # LayerNorm: its exact unit blocks
            torch.testing.assert_close(got[name]["unit"], want[name]["unit"])
            continue
        for key in ("A", "B"):
            for a, b in zip(want[name][key], got[name][key], strict=True):
                torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(
    ("kind", "shape"),
    [("fisher_mc", "kron"), ("fisher_mc", "diag"), ("fisher_emp", "unit")],
)
def test_curvature_equals_serial(kind, shape):
    serial, layered = pair()
    x, y = batch()
    curv = [
        curvature(
            m,
            "cross_entropy",
            x,
            y,
            kind=kind,
            shape=shape,
            generator=torch.Generator().manual_seed(2),
            ignore_modules=["wpe"],
        )
        for m in (serial, layered)
    ]
    g = torch.Generator().manual_seed(3)
    v = torch.randn(curv[0].numel, generator=g, dtype=torch.float64)
    assert_equal(curv[0] @ v, curv[1] @ v)
    assert_equal(curv[0].diagonal(), curv[1].diagonal())


SECOND_ORDER = ("psgd", "hessian_free", "newton", "diagonal_fisher")


def second_order(name, model):
    if name == "diagonal_fisher":
        return DiagonalEmpiricalFisherGradientMaker(model)
    if name == "newton":  # a dense Hessian: the layer norms' 144 parameters only
        config = {
            "damping": 1.0,
            "ignore_modules": ["wte", "wpe", "lm_head", "attn", "mlp"],
        }
        return make_gradient_maker(name, model, config=config)
    return make(name, model)


@pytest.mark.parametrize("name", SECOND_ORDER)
def test_second_order_makers_name_layer_parallel_then_run_serial(name):
    serial, layered = pair(mlp_ratio=1)
    gm = second_order(name, layered)
    with pytest.raises(RuntimeError, match=r"LayerParallel.*\.serial\(\)"):
        train(gm, layered, steps=1)
    layered.stack.serial()  # exact autograd through the same module
    want = train(second_order(name, serial), serial)
    assert_equal(want, train(second_order(name, layered), layered))


def test_curvature_hessian_names_layer_parallel():
    _, layered = pair()
    x, y = batch()
    with pytest.raises(RuntimeError, match="LayerParallel"):
        curvature(layered, "cross_entropy", x, y, kind="hessian", shape="diag")


def test_inexact_iterations_reported_per_adjoint_solve():
    # Default iterations: the curvature is as inexact as the solves it comes from;
    # stats lists the forward and every adjoint solve of the curvature pass (the
    # loss gradient, then one per Monte-Carlo Fisher vector).
    serial, layered = pair(cf=2, fwd_iters=1, bwd_iters=1)
    want = train(make("kfac", serial), serial)
    got = train(make("kfac", layered), layered)
    stats = layered.stack.stats
    assert len(stats.backwards) == 2 and stats.backward is stats.backwards[-1]
    residuals = [stats.forward.final_residual] + [
        s.final_residual for s in stats.backwards
    ]
    assert all(r > 0 for r in residuals)
    err = float((want - got).norm() / want.norm())
    assert 1e-8 < err < 1.0  # inexact, but the same curvature, not another one


def test_a_backward_gradient_averager_is_refused():
    # parallelize() with dp > 1 attaches an averager that only runs in backward();
    # a curvature pass would leave each replica with its own gradient.
    _, layered = pair()
    layered.gradient_averager = object()
    with pytest.raises(RuntimeError, match="DistributedDataParallel"):
        train(make("kfac", layered), layered)
