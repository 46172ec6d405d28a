"""Gefen's step for many parameters at once: one C kernel call for all of them.

A model holds many parameters, most of them small (norms, biases): one kernel call
each costs ~30 µs of Python and a parallel region apiece, ~4 ms per step on a
117-tensor GPT. :func:`step_many` checks every parameter first, then hands all the
kernel's parameters to one call, whose threads share out the blocks of all of them
(``lt_gefen_step_many`` in ``_kernels/gefen_step.c``; its first phase advances a
factored second moment's factors). CUDA parameters go to the Triton step
(``_triton_step``: a few launches for all of them) where ``_fused.gpu_problem``
finds nothing it does not cover. Parameters neither takes (fp16 on the CPU, no
compiler, an option the Triton step does not cover yet) step one by one through
``fused_step``; a non-contiguous one
(channels_last, a transposed view) steps as a contiguous copy through the kernel.
The result is that of ``fused_step`` on each parameter (on its contiguous copy)
in turn, bit for bit. A steady step skips even
this: ``_fused_plan`` keeps the jobs built here and makes the call directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

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


def _grad_fits(grad: Tensor, n: int) -> bool:
    """The gradient's half of ``_fused._c_problem`` (it is new every step)."""
    return grad.numel() == n and _fused.c_takes("grad", grad) is None


def _checked(item: StepItem, lib, cache: dict | None) -> tuple | None:
    """``(layout, stochastic, codes_sr, static job or None)`` of one item, or None
    for an empty parameter; from ``cache`` while its signature holds. The static
    job is None where the kernel cannot take the item."""
    param, grad, state = item.param, item.grad, item.state
    entry = cache.get(id(state)) if cache is not None else None
    signature = _signature(item) if cache is not None else None
    if entry is not None and entry[0] is state and entry[1] == signature:
        if grad.numel() != param.numel():
            raise ValueError(f"grad has {grad.numel()} elements, param {param.numel()}")
        if isinstance(item.seed, bool) or not isinstance(item.seed, int):
            raise TypeError(
                f"seed must be an int, got {type(item.seed).__name__} {item.seed!r}"
            )
        layout, stochastic, codes_sr, static = entry[2]
        if static is not None and (lib is None or not _grad_fits(grad, param.numel())):
            static = None  # this step's gradient is not the kernel's, or no kernel
        return layout, stochastic, codes_sr, static
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
    static = None
    if lib is not None and _fused._c_problem(param, grad, state) is None:
        static = _cabi.static_job(param, state, checked[0])
    if cache is not None:
        cache[id(state)] = (state, signature, (*checked, static))
    return (*checked, static)


@torch.no_grad()
def _contiguous_twin(item: StepItem, strided: list[tuple[Tensor, Tensor]]) -> StepItem:
    """``item`` on contiguous copies of its parameter and gradient; the pair
    (parameter, copy) goes to ``strided`` to be written back after the step."""
    twin = replace(item, param=item.param.contiguous(), grad=item.grad.contiguous())
    strided.append((item.param, twin.param))
    return twin


def step_many(items: Sequence[StepItem], cache: dict | None = None) -> None:
    """One Gefen step of every item; ``fused_step``'s result on each, bit for bit.

    Every item is checked before any is changed (sizes, state layout, seed), so a
    bad one raises with all parameters and states untouched. ``cache`` (a dict the
    caller keeps across steps, e.g. one per optimizer) holds each state's checks
    and static kernel job while the state's tensors, the parameter's storage and
    the rounding options stay the same (``_signature``); a changed one is checked
    afresh.

    Raises:
        ValueError, TypeError: as ``fused_step`` for the first bad item.
        MemoryError: the kernel's buffers do not fit (nothing changed).
    """
    lib = _native.load()
    native: list[tuple[StepItem, tuple[int, int, int], bool, bool, tuple]] = []
    gpu: list[tuple[StepItem, tuple[int, int, int], bool, bool]] = []
    others: list[StepItem] = []
    strided: list[tuple[Tensor, Tensor]] = []  # (parameter, its contiguous twin)
    for item in items:
        if _triton_step.serves(item.param.device):
            if not (item.param.is_contiguous() and item.grad.is_contiguous()):
                item = _contiguous_twin(item, strided)  # as for the C kernel
            checked = _checked(item, None, cache)
            if checked is None:
                continue
            layout, stochastic, codes_sr, _ = checked
            why = _fused.gpu_problem(item.param, item.grad, item.state, stochastic)
            if why is None:
                gpu.append((item, layout, stochastic, codes_sr))
            else:  # fused_step warns and takes the fallback
                others.append(item)
            continue
        if lib is not None and _kernel_layout_only(item):
            item = _contiguous_twin(item, strided)
        checked = _checked(item, lib, cache)
        if checked is None:
            continue
        if checked[3] is not None:
            native.append((item, *checked))
        else:
            others.append(item)
    if cache is not None:  # drop states no longer stepped (and their tensors)
        for stale in cache.keys() - {id(item.state) for item in items}:
            del cache[stale]
    if native:
        _launch_all(lib, native)
    if gpu:
        _launch_gpu(gpu)
    for item in others:
        item.one_step()
    for param, twin in strided:
        param.copy_(twin)


def _keys(item: StepItem, step: float, stochastic: bool, codes_sr: bool) -> tuple:
    """The rounding key and the code key (None: nearest codes) of one step."""
    key = rounding_key(item.seed, int(step)) if stochastic else 0
    return key, code_key(item.seed, int(step)) if codes_sr else None


def _launch_gpu(gpu: list[tuple[StepItem, tuple[int, int, int], bool, bool]]) -> None:
    """The Triton step of every checked CUDA item (a few launches in all: see
    ``_triton_step``); their steps advance after it, as ``_launch_all``'s."""
    jobs, hypers = [], {}
    for item, layout, stochastic, codes_sr in gpu:
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
    _triton_step.launch(jobs)
    for item, *_ in gpu:
        item.state["step"] += 1


def _kernel_layout_only(item: StepItem) -> bool:
    """True when only the memory layout keeps the kernel from this item: a
    channels_last or transposed CPU parameter or gradient of a kernel dtype. Such an
    item steps as a contiguous copy (same logical, row-major element order) written
    back after the call, so the layout never changes the result."""
    param, grad = item.param, item.grad
    if param.is_contiguous() and grad.is_contiguous():
        return False
    return all(
        t.dtype in _fused._C_DTYPES
        and t.device.type == "cpu"
        and t.layout == torch.strided
        for t in (param, grad)
    )


def _launch_all(
    lib, native: list[tuple[StepItem, tuple[int, int, int], bool, bool, tuple]]
) -> None:
    """One kernel call for every checked item; their steps advance after it."""
    jobs, interned = [], {}  # interned: the jobs' scalars, alive until launch returns
    hypers: dict[tuple, tuple] = {}  # items of one group share their scalars
    for item, layout, stochastic, codes_sr, static in native:
        step = float(item.state["step"]) + 1
        key = rounding_key(item.seed, int(step)) if stochastic else 0
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
                code_key=code_key(item.seed, int(step)) if codes_sr else None,
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
