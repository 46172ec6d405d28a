"""Gefen's step for many parameters at once: one C kernel call for all of them.

A model holds many parameters, most of them small (norms, biases): one kernel call
each costs ~30 µs of Python and a parallel region apiece, ~4 ms per step on a
117-tensor GPT. :func:`step_many` checks every parameter first, then hands all the
kernel's parameters to one call, whose threads share out the blocks of all of them
(``lt_gefen_step_many`` in ``_kernels/gefen_step.c``). Parameters the kernel cannot
take (fp16, CUDA, no compiler) step one by one through ``fused_step``. The result is
that of ``fused_step`` on each parameter in turn, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from . import _cabi, _fused, _native
from .code_rounding import code_key
from .precision import rounding_key


@dataclass
class StepItem:
    """One parameter's share of a step: tensors, hyperparameters, rounding seed."""

    param: Tensor
    grad: Tensor
    state: dict
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    maximize: bool
    stochastic_rounding: bool | None = None
    seed: int = 0
    stochastic_codes: bool = False
    index0: int = 0  # global flat index of the first element (a shard's offset)
    update_clip: float | None = None  # each element's step <= lr * update_clip

    def options(self) -> dict:
        """The hyperparameters as ``fused_step`` and ``hyperparameters`` take them."""
        return {
            "lr": self.lr,
            "beta1": self.beta1,
            "beta2": self.beta2,
            "eps": self.eps,
            "weight_decay": self.weight_decay,
            "maximize": self.maximize,
            "update_clip": self.update_clip,
        }

    def hyper(self, step: float) -> dict[str, float]:
        return _fused.hyperparameters(step, **self.options())

    def one_step(self) -> None:
        _fused.fused_step(
            self.param,
            self.grad,
            self.state,
            **self.options(),
            stochastic_rounding=self.stochastic_rounding,
            seed=self.seed,
            stochastic_codes=self.stochastic_codes,
            index0=self.index0,
        )


@torch.no_grad()
def step_many(items: Sequence[StepItem]) -> None:
    """One Gefen step of every item; ``fused_step``'s result on each, bit for bit.

    Every item is checked before any is changed (sizes, state layout, seed), so a
    bad one raises with all parameters and states untouched.

    Raises:
        ValueError, TypeError: as ``fused_step`` for the first bad item.
        MemoryError: the kernel's buffers do not fit (nothing changed).
    """
    lib = _native.load()
    native: list[tuple[StepItem, tuple[int, int, int], bool, bool]] = []
    others: list[StepItem] = []
    for item in items:
        param, grad, state = item.param, item.grad, item.state
        checked = _fused.check_step(
            param,
            grad,
            state,
            item.stochastic_rounding,
            item.seed,
            item.stochastic_codes,
        )
        if checked is None:  # an empty parameter
            continue
        if lib is not None and _fused._c_problem(param, grad, state) is None:
            native.append((item, *checked))
        else:
            others.append(item)
    if native:
        _launch_all(lib, native)
    for item in others:
        item.one_step()


def _launch_all(
    lib, native: list[tuple[StepItem, tuple[int, int, int], bool, bool]]
) -> None:
    """One kernel call for every checked item; their steps advance after it."""
    jobs, interned = [], {}  # interned: the jobs' scalars, alive until launch returns
    # factored states advance their factors first; put back if the launch fails
    saved = [
        (item.state, item.state["exp_avg_sq"].clone())
        for item, *_ in native
        if "factored" in item.state
    ]
    for item, layout, stochastic, codes_sr in native:
        step = float(item.state["step"]) + 1
        key = rounding_key(item.seed, int(step)) if stochastic else 0
        cbar = _fused.advance_factors(item.grad, item.state, item.beta2)
        jobs.append(
            _cabi.c_job(
                item.param,
                item.grad,
                item.state,
                item.hyper(step),
                layout=layout,
                stochastic=stochastic,
                key=key,
                interned=interned,
                code_key=code_key(item.seed, int(step)) if codes_sr else None,
                index0=item.index0,
                cbar=cbar,
            )
        )
    total = sum(item.param.numel() for item, *_ in native)
    threads = torch.get_num_threads() if total >= _fused._THREAD_MIN else 1
    max_chunk = _cabi.checked_library(lib)
    try:
        _cabi.launch(lib, jobs, _fused.C_CHUNK or max_chunk, threads)
    except (MemoryError, ValueError):
        for state, factors in saved:
            state["exp_avg_sq"].copy_(factors)
        raise
    for item, *_ in native:
        item.state["step"] += 1
