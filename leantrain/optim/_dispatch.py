"""Gefen's one step dispatch: every parameter of a step, on the implementation its
tensors take, with one cache per optimizer.

:func:`step_many` is the one entry of Gefen's and GefenMuon's steps (a steady
Gefen step goes straight to the cached C plan it built, ``_fused_plan``). It
checks every parameter first (sizes, state layout, seed: a bad one raises with
nothing changed), asks ``_fused.implementation`` (the one check, from the tensors'
device, dtype and layout) which implementation takes it, and then steps each
implementation's parameters together:

* **"c"** — one call into the C kernel for all of them, whose threads share out
  the blocks of every tensor (``lt_gefen_step_many``); a channels_last or
  transposed CPU parameter steps as a contiguous copy, written back after;
* **"triton"** — a few launches for all of them (``_triton_step``), CUDA
  parameters (non-contiguous ones as contiguous copies too);
* **"torch"** — one by one through the eager fallback (``_fused.torch_fallback``).

The result is ``_fused.fused_step``'s on each parameter (on its contiguous copy)
in turn, bit for bit.

:class:`StepCache` is the optimizer's one cache of its steps, keyed on what
invalidates each part: per state, the checks, the implementation and the C
kernel's static job (while the state's tensors, the parameter's storage and the
rounding options stay: :func:`_signature`); the steady C plan
(``_fused_plan.StepPlan``, which re-checks what can change every step); the
Triton step's job tables (while the same states step in the same order with the
same gradient dtypes); FSDP2 shards' straddle layouts (per parameter and period).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from . import _cabi, _fused, _native, _triton_step
from ._options import StepOptions
from .code_rounding import code_key
from .precision import rounding_key


@dataclass
class StepItem:
    """One parameter's share of a step: tensors, options, rounding seed."""

    param: Tensor
    grad: Tensor
    state: dict
    options: StepOptions
    seed: int = 0
    index0: int = 0  # global flat index of the first element (a shard's offset)

    def one_step(self) -> None:
        _fused.fused_step(
            self.param,
            self.grad,
            self.state,
            self.options,
            seed=self.seed,
            index0=self.index0,
        )


@dataclass
class StepCache:
    """An optimizer's one cache of its steps (see the module docstring).

    Attributes:
        checks: ``id(state) -> (state, signature, checked)`` of the states the last
            step took: ``checked`` is ``(layout, stochastic, codes_sr,
            implementation, why, static C job or None)``.
        plan: the steady C plan of the last full step, or None.
        triton: the Triton job tables of the last step, or None.
        layouts: FSDP2 shards' straddle layouts (``_straddle.straddle_layout``).
        bits: ``id(state) -> (state, momentum_bits, codebook)`` of the states
            whose momentum width the last step checked against their groups.
    """

    checks: dict = field(default_factory=dict)
    plan: object = None
    triton: object = None
    layouts: dict = field(default_factory=dict)
    bits: dict = field(default_factory=dict)


# State entries whose values (not only identity) the cached checks depend on.
_SCALARS = ("period", "qblock", "factored")


def _signature(item: StepItem) -> tuple:
    """What one parameter's cached checks depend on: the parameter's storage and
    layout, its rounding options, and every state tensor's identity (the layout
    scalars' and the codebook's in-place changes too, by their version counters).
    The step counter is left out: it changes every step."""
    param, state = item.param, item.state
    return (
        param.data_ptr(),
        param.dtype,
        param.device,
        param.layout,
        param.numel(),
        param.is_contiguous(),
        item.options.stochastic_rounding,
        item.options.stochastic_codes,
        tuple(state),
        tuple(map(id, state.values())),
        tuple(state[k]._version for k in _SCALARS if k in state),
        state["codebook"]._version if "codebook" in state else None,
    )


def _checked(item: StepItem, cache: StepCache | None) -> tuple | None:
    """``(layout, stochastic, codes_sr, implementation, why, static C job or
    None)`` of one item, or None for an empty parameter; from ``cache`` while its
    signature holds (the gradient, new every step, is checked afresh)."""
    param, grad, state = item.param, item.grad, item.state
    checks = cache.checks if cache is not None else None
    entry = checks.get(id(state)) if checks is not None else None
    signature = _signature(item) if checks is not None else None
    if entry is not None and entry[0] is state and entry[1] == signature:
        if grad.numel() != param.numel():
            raise ValueError(f"grad has {grad.numel()} elements, param {param.numel()}")
        if isinstance(item.seed, bool) or not isinstance(item.seed, int):
            raise TypeError(
                f"seed must be an int, got {type(item.seed).__name__} {item.seed!r}"
            )
        layout, stochastic, codes_sr, kind, why, static = entry[2]
        if kind == "c" and _fused.c_takes("grad", grad) is None:
            return entry[2]
        if kind == "triton" and _triton_step.grad_fits(param, grad):
            return entry[2]
        # this step's gradient is not the cached implementation's: ask afresh
        kind, why = _fused.implementation(param, grad, state, stochastic)
        return layout, stochastic, codes_sr, kind, why, static
    checked = _fused.check_step(
        param,
        grad,
        state,
        item.options.stochastic_rounding,
        item.seed,
        item.options.stochastic_codes,
    )
    if checked is None:  # an empty parameter
        return None
    kind, why = _fused.implementation(param, grad, state, checked[1])
    static = _cabi.static_job(param, state, checked[0]) if kind == "c" else None
    if checks is not None:
        checks[id(state)] = (state, signature, (*checked, kind, why, static))
    return (*checked, kind, why, static)


@torch.no_grad()
def _contiguous_twin(item: StepItem, strided: list[tuple[Tensor, Tensor]]) -> StepItem:
    """``item`` on contiguous copies of its parameter and gradient; the pair
    (parameter, copy) goes to ``strided`` to be written back after the step."""
    twin = replace(item, param=item.param.contiguous(), grad=item.grad.contiguous())
    strided.append((item.param, twin.param))
    return twin


def _layout_only(item: StepItem) -> bool:
    """True when only the memory layout may keep a kernel from this item: a
    channels_last or transposed parameter or gradient that a kernel takes once
    contiguous (a kernel dtype on the CPU, or a CUDA tensor). Such an item steps as
    a contiguous copy (same logical, row-major element order) written back after
    the call, so the layout never changes the result."""
    param, grad = item.param, item.grad
    if param.is_contiguous() and grad.is_contiguous():
        return False
    if _triton_step.serves(param.device):
        return True
    return _native.load() is not None and all(
        t.dtype in _fused.C_DTYPES
        and t.device.type == "cpu"
        and t.layout == torch.strided
        for t in (param, grad)
    )


def step_many(items: Sequence[StepItem], cache: StepCache | None = None) -> set[str]:
    """One Gefen step of every item; ``fused_step``'s result on each, bit for bit.

    Every item is checked before any is changed (sizes, state layout, seed), so a
    bad one raises with all parameters and states untouched. ``cache`` (one per
    optimizer, kept across steps) holds each state's checks, implementation and
    static kernel job while the state's tensors, the parameter's storage and the
    rounding options stay the same (``_signature``), and the Triton tables while
    the same states step; a changed one is checked afresh.

    Returns:
        The implementations that took a step ("c", "triton", "torch").

    Raises:
        ValueError, TypeError: as ``fused_step`` for the first bad item.
        MemoryError: the kernel's buffers do not fit (nothing changed).
    """
    by_kind: dict[str, list] = {"c": [], "triton": [], "torch": []}
    strided: list[tuple[Tensor, Tensor]] = []  # (parameter, its contiguous twin)
    for item in items:
        if _layout_only(item):
            item = _contiguous_twin(item, strided)
        checked = _checked(item, cache)
        if checked is None:
            continue
        by_kind[checked[3]].append((item, *checked))
    if cache is not None:  # drop states no longer stepped (and their tensors)
        for stale in cache.checks.keys() - {id(item.state) for item in items}:
            del cache.checks[stale]
    if by_kind["c"]:
        _launch_c(by_kind["c"])
    if by_kind["triton"]:
        _launch_triton(by_kind["triton"], cache)
    for item, layout, stochastic, codes_sr, _, why, _ in by_kind["torch"]:
        _torch_one(item, layout, stochastic, codes_sr, why)
    for param, twin in strided:
        param.copy_(twin)
    return {kind for kind, taken in by_kind.items() if taken}


def _keys(item: StepItem, step: float, stochastic: bool, codes_sr: bool) -> tuple:
    """The rounding key and the code key (None: nearest codes) of one step."""
    key = rounding_key(item.seed, int(step)) if stochastic else 0
    return key, code_key(item.seed, int(step)) if codes_sr else None


def _torch_one(item, layout, stochastic, codes_sr, why) -> None:
    """One item through the eager fallback (``fused_step``'s "torch" branch)."""
    item.state["step"] += 1
    step = float(item.state["step"])
    key, ckey = _keys(item, step, stochastic, codes_sr)
    _fused.torch_fallback(
        item.param,
        item.grad,
        item.state,
        item.options.scalars(step),
        item.options.beta2,
        why,
        stochastic=stochastic,
        key=key,
        code_key=ckey,
        index0=item.index0,
    )


def _launch_triton(gpu: list, cache: StepCache | None) -> None:
    """The Triton step of every checked item (a few launches in all: see
    ``_triton_step``), on the cached tables while the same states step in the same
    order; their steps advance after it, as ``_launch_c``'s."""
    jobs, hypers = [], {}
    for item, layout, stochastic, codes_sr, *_ in gpu:
        step = float(item.state["step"]) + 1
        hyper = hypers.get((step, item.options))
        if hyper is None:
            hyper = hypers[step, item.options] = item.options.scalars(step)
        key, ckey = _keys(item, step, stochastic, codes_sr)
        jobs.append(
            _triton_step.job(
                item.param,
                item.grad,
                item.state,
                hyper,
                layout=layout,
                stochastic=stochastic,
                key=key,
                code_key=ckey,
                index0=item.index0,
            )
        )
    if cache is None:
        _triton_step.launch(jobs)
    else:
        # The tables hold while every job's checks hold (its signature: the state's
        # tensors, the parameter's storage, the options) with the same gradient
        # dtype and offset, in the same order.
        tables_key = tuple(
            (cache.checks[id(j.state)][1], j.grad.dtype, j.index0) for j in jobs
        )
        tables = cache.triton
        if tables is None or tables.key != tables_key:
            tables = cache.triton = _triton_step.Tables(tables_key)
        _triton_step.launch(jobs, tables)
    for item, *_ in gpu:
        item.state["step"] += 1


def _launch_c(native: list) -> None:
    """One kernel call for every checked item; their steps advance after it."""
    lib = _native.load()
    jobs, interned = [], {}  # interned: the jobs' scalars, alive until launch returns
    hypers: dict[tuple, tuple] = {}  # items of one group share their scalars
    for item, layout, stochastic, codes_sr, _, _, static in native:
        step = float(item.state["step"]) + 1
        key, ckey = _keys(item, step, stochastic, codes_sr)
        hyper = hypers.get((step, item.options))
        if hyper is None:
            h = item.options.scalars(step)
            hyper = hypers[step, item.options] = tuple(
                h[f] for f, _ in _cabi._Hyper._fields_
            )
        jobs.append(
            _cabi.c_job(
                item.param,
                item.grad,
                item.state,
                hyper,
                layout=layout,
                stochastic=stochastic,
                key=key,
                interned=interned,
                code_key=ckey,
                index0=item.index0,
                static=static,
            )
        )
    total = sum(item.param.numel() for item, *_ in native)
    threads = torch.get_num_threads() if total >= _fused._THREAD_MIN else 1
    max_chunk = _cabi.checked_library(lib)
    # factored states' factors advance inside the call (its first phase)
    _cabi.launch(lib, jobs, _fused.C_CHUNK or max_chunk, threads)
    for item, *_ in native:
        item.state["step"] += 1
