"""step_many: every parameter of a step in one kernel call == fused_step on each."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from leantrain.optim import _cabi, _native
from leantrain.optim._dispatch import StepItem, step_many
from leantrain.optim._options import StepOptions
from leantrain.optim._state import new_state
from tests._helpers.fused_states import HYPER, codebook, copy_state, random_state


def _mixed_items(seed: int = 0) -> list[StepItem]:
    """Parameters the kernel takes (fp32/bf16, 8/4-bit, fp32 momentum, per-element
    v, odd and long blocks, a fresh state and older ones) and some it does not
    (fp16, a strided gradient), plus an empty one."""
    g = torch.Generator().manual_seed(seed)
    specs = [  # (n, period, bits, dtype)
        (4099, 61, 8, torch.float32),
        (40000, 5000, 8, torch.float32),
        (3001, 1, 8, torch.float32),
        (777, 7, 4, torch.float32),
        (20000, 20000, 4, torch.bfloat16),
        (513, 513, None, torch.float32),
        (1000, 1, None, torch.bfloat16),
        (900, 30, 8, torch.float16),
        (0, 1, 8, torch.float32),
    ]
    items = []
    for i, (n, period, bits, dtype) in enumerate(specs):
        if n:
            state = random_state(n, period, bits, seed=i)
            state["step"] += i  # steps differ between parameters
        else:
            state = new_state(torch.empty(0), 1, bits, codebook(bits))
        param = torch.randn(n, generator=g).to(dtype)
        grad = torch.randn(n, generator=g).to(dtype)
        items.append(StepItem(param, grad, state, StepOptions(**HYPER), seed=i))
    strided = torch.randn(2 * 500, generator=g)[::2]  # a contiguous copy steps
    items.append(
        StepItem(
            torch.randn(500),
            strided,
            random_state(500, 50, 8, 99),
            StepOptions(**HYPER),
        )
    )
    return items


def _clone(items: list[StepItem]) -> list[StepItem]:
    return [
        dataclasses.replace(
            i,
            param=i.param.clone(),
            grad=i.grad.clone() if i.grad.is_contiguous() else i.grad,
            state=copy_state(i.state),
        )
        for i in items
    ]


@pytest.mark.parametrize("threads", [1, 2])
def test_step_many_is_fused_step_on_each_bit_for_bit(backend, threads):  # noqa: F811
    torch.set_num_threads(threads)
    try:
        items = _mixed_items()
        one_by_one, together = _clone(items), _clone(items)
        for _ in range(3):  # later steps read the codes the kernel wrote
            for item in one_by_one:
                item.one_step()
            step_many(together)
        for a, b in zip(one_by_one, together, strict=True):
            assert torch.equal(a.param, b.param)
            for key in a.state:
                assert torch.equal(a.state[key], b.state[key]), key
    finally:
        torch.set_num_threads(2)


def test_a_bad_item_changes_nothing(backend):  # noqa: F811
    items = _mixed_items(1)
    before = _clone(items)
    bad = items[3]
    items[3] = StepItem(bad.param, bad.grad[:-1], bad.state, StepOptions(**HYPER))
    with pytest.raises(ValueError, match="grad has"):
        step_many(items)
    items[3] = StepItem(bad.param, bad.grad, bad.state, StepOptions(**HYPER), seed=1.5)
    with pytest.raises(TypeError, match="seed must be an int"):
        step_many(items)
    for a, b in zip(items, before, strict=True):
        assert torch.equal(a.param, b.param)
        for key in a.state:
            assert torch.equal(a.state[key], b.state[key]), key


def test_one_kernel_call_per_step(monkeypatch):
    """The kernel's parameters of a whole step go in a single launch."""
    if _native.load() is None:
        pytest.skip(f"native kernel unavailable: {_native.status()}")
    calls = []
    real = _cabi.launch

    def counting(lib, jobs, *args, **kwargs):
        calls.append(len(jobs))
        return real(lib, jobs, *args, **kwargs)

    monkeypatch.setattr(_cabi, "launch", counting)
    step_many(_mixed_items())
    # 9 items: fp16 steps on its own; the strided gradient joins as a contiguous copy
    assert calls == [8]
