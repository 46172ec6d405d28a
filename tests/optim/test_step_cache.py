"""The dispatch's per-state cache (``StepCache.checks``): cached steps == uncached
ones, and every change of a state's tensors, the parameter's storage or the
gradient is seen."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from leantrain.optim import Gefen, _native
from leantrain.optim._dispatch import StepCache, StepItem, step_many
from leantrain.optim._options import StepOptions
from leantrain.optim._state import state_bits
from tests._helpers.fused_states import HYPER, copy_state, random_state


def _items(seed: int = 0) -> list[StepItem]:
    g = torch.Generator().manual_seed(seed)
    specs = [(4099, 61, 8), (777, 7, 4), (513, 513, None), (3001, 1, 8)]
    items = []
    for i, (n, period, bits) in enumerate(specs):
        param = torch.randn(n, generator=g)
        grad = torch.randn(n, generator=g)
        state = random_state(n, period, bits, seed=i)
        items.append(StepItem(param, grad, state, StepOptions(**HYPER), seed=i))
    return items


def _clone(items: list[StepItem]) -> list[StepItem]:
    return [
        dataclasses.replace(
            i, param=i.param.clone(), grad=i.grad.clone(), state=copy_state(i.state)
        )
        for i in items
    ]


def _assert_equal(a: list[StepItem], b: list[StepItem]) -> None:
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.param, y.param)
        for key in x.state:
            assert torch.equal(x.state[key], y.state[key]), key


def test_cached_steps_equal_uncached_through_state_changes(backend):  # noqa: F811
    """Between steps the states are swapped for others, a state tensor is replaced,
    the gradients are new tensors (one of them fp16, which the kernel cannot take)
    and a parameter moves to new storage: the cached step must follow each."""
    items = _items()
    plain, cached = _clone(items), _clone(items)
    cache = StepCache()
    for step in range(6):
        if step == 2:  # a load_state_dict-like swap: new state dicts
            for a, b in zip(plain, cached, strict=True):
                n, period = a.param.numel(), int(a.state["period"])
                fresh = random_state(n, period, state_bits(a.state), seed=100 + n)
                a.state, b.state = copy_state(fresh), copy_state(fresh)
        if step == 3:  # one state tensor replaced by a copy with other values
            for x in (plain[0], cached[0]):
                x.state["exp_avg_sq"] = x.state["exp_avg_sq"].clone() * 2
        if step == 4:  # new gradient tensors, one the kernel cannot take
            for x in (plain[1], cached[1]):
                x.grad = x.grad.to(torch.float16)
            for x in (plain[2], cached[2]):
                x.grad = x.grad.clone() * 0.5
        if step == 5:  # the parameter moves to new storage
            for x in (plain[3], cached[3]):
                x.param = x.param.clone()
        for item in plain:
            item.one_step()
        step_many(cached, cache)
        _assert_equal(plain, cached)
    assert set(cache.checks) == {id(i.state) for i in cached}  # replaced states dropped


def test_a_bad_gradient_is_caught_on_a_cached_state(backend):  # noqa: F811
    items = _items(1)
    cache = StepCache()
    step_many(items, cache)
    before = _clone(items)
    items[1] = dataclasses.replace(items[1], grad=items[1].grad[:-1])
    with pytest.raises(ValueError, match="grad has"):
        step_many(items, cache)
    items[1] = dataclasses.replace(before[1], seed=1.5)
    with pytest.raises(TypeError, match="seed must be an int"):
        step_many(items, cache)
    items[1] = before[1]
    _assert_equal(items, before)


def test_gefen_after_load_state_dict_steps_as_a_fresh_optimizer():
    """An optimizer that stepped (so its cache is filled) and then loads another's
    checkpoint steps exactly as a new optimizer loading the same checkpoint."""
    if _native.load() is None:
        pytest.skip(f"native kernel unavailable: {_native.status()}")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Linear(30, 5))
    grads = [[torch.randn_like(p) for p in model.parameters()] for _ in range(4)]

    def run(opt, params, steps):
        for gs in steps:
            for p, g in zip(params, gs, strict=True):
                p.grad = g.clone()
            opt.step()

    source = [p.detach().clone().requires_grad_() for p in model.parameters()]
    opt_source = Gefen(source, lr=1e-2)
    run(opt_source, source, grads[:2])
    checkpoint = opt_source.state_dict()
    a = [p.detach().clone().requires_grad_() for p in source]
    b = [p.detach().clone().requires_grad_() for p in source]
    opt_a = Gefen(a, lr=1e-2)
    run(opt_a, a, grads[2:])  # fills its cache with states about to be replaced
    for p, q in zip(a, source, strict=True):
        p.data.copy_(q)
    opt_a.load_state_dict(checkpoint)
    opt_b = Gefen(b, lr=1e-2)
    opt_b.load_state_dict(checkpoint)
    run(opt_a, a, grads[2:])
    run(opt_b, b, grads[2:])
    for p, q in zip(a, b, strict=True):
        assert torch.equal(p, q)
