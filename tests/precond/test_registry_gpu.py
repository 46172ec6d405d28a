"""Every registry method on CUDA against the same method on the CPU (``-m gpu``).

The maker is built while the model is on the CPU and the model is moved after,
as a user's ``model.cuda()`` after the optimizer does: the random streams, the
layout indices and PSGD's factors must follow it. Monte-Carlo draws differ
between devices (the CPU's Mersenne Twister against CUDA's Philox), so the
Fisher-based methods are compared with the empirical Fisher, which draws
nothing; PSGD's and SENG's draws are random by design, so they are checked to
run on the device and stay finite.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leantrain.precond.registry import PRECOND_METHODS, make_gradient_maker

DRAWS_RANDOMLY = {"psgd", "seng"}
MONTE_CARLO = {
    name
    for name, spec in PRECOND_METHODS.items()
    if spec.kwargs.get("fisher_type") == "fisher_mc"
}


def _grads(name: str, model: nn.Module, device: str, x, t) -> list[torch.Tensor]:
    overrides = {"fisher_type": "fisher_emp"} if name in MONTE_CARLO else {}
    gm = make_gradient_maker(name, model, **overrides)  # built on the CPU
    model.to(device)
    x, t = x.to(device), t.to(device)
    for _ in range(3):
        for p in model.parameters():
            p.grad = None
        gm.setup_loss_call(F.cross_entropy, gm.setup_model_call(model, x), t)
        gm.forward_and_backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(PRECOND_METHODS))
def test_method_on_cuda_matches_cpu(name):
    if not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    x = torch.randn(32, 6, dtype=torch.float64)
    t = torch.arange(32) % 3
    cpu = _grads(name, copy.deepcopy(model), "cpu", x, t)
    cuda = _grads(name, copy.deepcopy(model), "cuda", x, t)
    assert all(g.is_cuda and torch.isfinite(g).all() for g in cuda)
    if name in DRAWS_RANDOMLY:
        return
    for a, b in zip(cpu, cuda, strict=True):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-10, atol=1e-12)


@pytest.mark.gpu
def test_default_kfac_in_loop_runs_on_cuda_with_its_monte_carlo_fisher():
    """The registry's K-FAC (Monte-Carlo Fisher) in the user's loop on CUDA."""
    if not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device")
    from leantrain.precond import precondition_in_loop

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = precondition_in_loop(
        torch.optim.SGD(model.parameters(), lr=0.05), model, "kfac"
    )
    model.cuda()
    x, t = torch.randn(32, 6, device="cuda"), torch.arange(32, device="cuda") % 3
    for _ in range(3):
        F.cross_entropy(model(x), t).backward()
        opt.step()
        opt.zero_grad()
    assert opt.maker.curvature_updates >= 1
    state = opt.maker.state_dict()
    assert "cuda:0" in state["extra"]["generator"]
    assert all(torch.isfinite(p).all() for p in model.parameters())
