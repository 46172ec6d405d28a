"""Tiny float64 models, batches and training loops for the preconditioning
pattern matrix (tests/patterns/test_patterns_precond.py).

Every loop returns the gradient each step leaves in ``.grad`` (after
preconditioning) and the final parameters, so a pattern is compared with the
eager, plain loop on the same batches.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from leantrain.precond import make_gradient_maker, precondition_in_loop

IN, HIDDEN, OUT, BATCH = 4, 5, 3, 8
# Methods that keep one batch's per-example gradients or run the model themselves.
GRADIENT_ONLY = {"shampoo", "shampoo_10"}


class Net(nn.Module):
    """Linear-Tanh-Linear-Tanh-Linear; ``ckpt`` wraps ``l2`` ("layer") or
    ``l1``-Tanh-``l2`` ("block") in ``torch.utils.checkpoint.checkpoint``."""

    def __init__(self, ckpt: str | None = None, reentrant: bool = False) -> None:
        super().__init__()
        self.l1 = nn.Linear(IN, HIDDEN)
        self.l2 = nn.Linear(HIDDEN, HIDDEN)
        self.l3 = nn.Linear(HIDDEN, OUT)
        self.ckpt, self.reentrant = ckpt, reentrant

    def _block(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.l2(torch.tanh(self.l1(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ckpt == "block":
            h = checkpoint(self._block, x, use_reentrant=self.reentrant)
        elif self.ckpt == "layer":
            h = torch.tanh(self.l1(x))
            h = torch.tanh(checkpoint(self.l2, h, use_reentrant=self.reentrant))
        else:
            h = self._block(x)
        return self.l3(h)


class ConvNet(nn.Module):
    """Conv2d-Tanh-Linear on (N, 2, 4, 4) images."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.head = nn.Linear(3 * 4 * 4, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.conv(x)).flatten(1))


def net(seed: int = 0, **options) -> nn.Module:
    torch.manual_seed(seed)
    return Net(**options).double()


def conv_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return ConvNet().double()


def batches(n: int, *, batch: int = BATCH, image: bool = False, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, 2, 4, 4) if image else (batch, IN)
    return [
        (
            torch.randn(*shape, generator=gen, dtype=torch.float64),
            torch.randint(0, OUT, (batch,), generator=gen),
        )
        for _ in range(n)
    ]


def maker(name: str, model: nn.Module, **kwargs):
    """The registry's method with a schedule of every step (small damping kept)."""
    return make_gradient_maker(name, model, **kwargs)


def maker_loop(
    name: str,
    model: nn.Module,
    data: list,
    *,
    call: Callable | None = None,
    loss_fn: Callable = F.cross_entropy,
    before_step: Callable | None = None,
    make_kwargs: dict | None = None,
) -> list[list]:
    """SGD steps through ``forward_and_backward``: each step's ``.grad``, then the
    final parameters."""
    gm = maker(name, model, **(make_kwargs or {}))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for x, t in data:
        opt.zero_grad()
        y = gm.setup_model_call(call or model, x)
        gm.setup_loss_call(loss_fn, y, t)
        gm.forward_and_backward()
        if before_step is not None:
            before_step(model)
        grads.append(
            [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        )
        opt.step()
    return [*grads, [p.detach().clone() for p in model.parameters()]]


def loop_in_loop(
    name: str,
    model: nn.Module,
    data: list,
    *,
    call: Callable | None = None,
    before_step: Callable | None = None,
    make_kwargs: dict | None = None,
) -> list[list]:
    """The same steps through ``PreconditionedOptimizer`` in a plain loop."""
    opt = precondition_in_loop(
        torch.optim.SGD(model.parameters(), lr=0.1), model, name, **(make_kwargs or {})
    )
    grads = []
    for x, t in data:
        opt.zero_grad()
        F.cross_entropy((model if call is None else call)(x), t).backward()
        if before_step is not None:
            before_step(model)
        opt.step()
        grads.append(
            [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        )
    opt.close()
    return [*grads, [p.detach().clone() for p in model.parameters()]]


def assert_same(want, got, *, rtol: float = 0.0, atol: float = 0.0) -> None:
    """Every tensor of two nested lists equal (bit for bit with tolerances 0)."""
    for w_step, g_step in zip(want, got, strict=True):
        for a, b in zip(w_step, g_step, strict=True):
            if a is None or b is None:
                assert a is None and b is None
            elif rtol == 0 and atol == 0:
                assert torch.equal(a, b), (a - b).abs().max()
            else:
                torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


def clone(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)
