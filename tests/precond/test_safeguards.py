"""Grafting: each layer's preconditioned gradient rescaled to the norm of its plain
gradient, checked against the ungrafted maker and plain autograd in float64."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leantrain.precond import GradientMaker
from leantrain.precond._safeguards import shortcut_gradient_norm
from leantrain.precond.registry import make_gradient_maker


def model() -> nn.Module:
    torch.manual_seed(0)
    # 24 wide at batch 8: K-FAC never forms the middle weight gradient (the
    # factored path), so its plain norm comes from the layer's inputs and
    # output-gradients.
    return nn.Sequential(
        nn.Linear(5, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 3)
    ).double()


def grads(gm, net, x, t):
    for p in net.parameters():
        p.grad = None
    gm.setup_loss_call(F.cross_entropy, gm.setup_model_call(net, x), t)
    gm.forward_and_backward()
    return {n: p.grad.clone() for n, p in net.named_parameters()}


@pytest.mark.parametrize("method", ["kfac", "ekfac", "shampoo", "psgd", "ng_diag"])
def test_grafted_layer_has_the_plain_norm_and_the_preconditioned_direction(method):
    gen = torch.Generator().manual_seed(1)
    data = [
        (
            torch.randn(8, 5, generator=gen, dtype=torch.float64),
            torch.randint(0, 3, (8,), generator=gen),
        )
        for _ in range(3)
    ]
    net = model()
    nets = {g: copy.deepcopy(net) for g in (None, "sgd")}
    makers = {
        g: make_gradient_maker(method, nets[g], config={"grafting": g}) for g in nets
    }
    plain = GradientMaker(net)
    for x, t in data:  # the makers see the same batches from the same state
        want = grads(plain, net, x, t)
        raw = grads(makers[None], nets[None], x, t)
        got = grads(makers["sgd"], nets["sgd"], x, t)
        for prefix in ("0.", "2.", "4."):  # the three layers
            names = [n for n in want if n.startswith(prefix)]
            plain_norm = torch.cat([want[n].flatten() for n in names]).norm()
            raw_norm = torch.cat([raw[n].flatten() for n in names]).norm()
            for n in names:
                expected = raw[n] * (plain_norm / raw_norm)
                torch.testing.assert_close(got[n], expected, rtol=1e-10, atol=1e-14)
        for n in want:  # the three nets take the same optimizer step
            for each in (net, *nets.values()):
                dict(each.named_parameters())[n].data.add_(-0.1 * got[n])


@pytest.mark.parametrize("n", [3, 40])  # the Gram form, and the formed product
def test_factored_gradient_norm_equals_the_formed_gradient(n):
    x = torch.randn(n, 7, dtype=torch.float64)
    e = torch.randn(n, 5, dtype=torch.float64)
    want = torch.linalg.matrix_norm(e.T @ x)
    torch.testing.assert_close(shortcut_gradient_norm(x, e), want)


@pytest.mark.parametrize("method", ["kfac", "ekfac", "shampoo"])
@pytest.mark.parametrize("lr", [0.5, 1e-4])  # clipped, and not (nu = 1)
def test_kl_clip_scales_by_kfac_pytorchs_factor(method, lr):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 5, generator=gen, dtype=torch.float64)
    t = torch.randint(0, 3, (8,), generator=gen)
    net = model()
    nets = {c: copy.deepcopy(net) for c in (None, 1e-3)}
    makers = {
        c: make_gradient_maker(method, nets[c], config={"kl_clip": c}) for c in nets
    }
    makers[1e-3].lr = lambda: lr  # a callable, as kfac-pytorch's lr= may be
    want = grads(GradientMaker(net), net, x, t)
    raw = grads(makers[None], nets[None], x, t)
    got = grads(makers[1e-3], nets[1e-3], x, t)
    vg = sum((raw[n] * want[n]).sum() for n in want) * lr**2
    nu = min(1.0, float((1e-3 / vg) ** 0.5))
    assert (nu < 0.5) == (lr == 0.5)
    for n in want:
        torch.testing.assert_close(got[n], raw[n] * nu, rtol=1e-10, atol=1e-14)


def test_kl_clip_in_a_loop_reads_the_optimizers_lr_and_warns_without_one():
    from leantrain.precond import precondition_in_loop

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 5, generator=gen, dtype=torch.float64)
    t = torch.randint(0, 3, (8,), generator=gen)
    net = model()
    ref_net = copy.deepcopy(net)
    config = {"kl_clip": 1e-3}
    opt = precondition_in_loop(
        torch.optim.SGD(net.parameters(), lr=0.5),
        net,
        "kfac",
        config=config,
        fisher_type="fisher_emp",
    )
    ref = make_gradient_maker("kfac", ref_net, config=config, fisher_type="fisher_emp")
    ref.lr = 0.5
    F.cross_entropy(net(x), t).backward()
    opt.step()  # .grad keeps the clipped preconditioned gradient SGD applied
    want = grads(ref, ref_net, x, t)
    for n, p in net.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-10, atol=1e-14)
    bare = make_gradient_maker("kfac", model(), config=config)
    with pytest.warns(UserWarning, match="needs the optimizer's learning rate"):
        grads(bare, bare.model, x, t)
