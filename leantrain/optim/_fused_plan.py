"""Gefen's cached step plan: a steady step in one kernel call, no per-step lookups.

A training loop steps the same parameters with the same states and options step
after step; only the gradients (new tensors), the learning rate (a scheduler) and
the step counters change. After a full step (``_base.GefenBase``: checks, state
creation, ``_dispatch.step_many``) whose parameters all take the C kernel,
:meth:`StepPlan.build` keeps one kernel job per parameter in a ctypes array, with
its own scalars and keys, in the optimizer's ``_dispatch.StepCache``. A plan
covers the param groups it was built for: all of Gefen's, GefenMuon's AdamW side.
:meth:`StepPlan.run` then checks, per parameter, only what can change between
steps (the gradient's presence, dtype, size and layout, the parameter's storage,
the state's tensors), writes the gradient pointers, refreshes the groups' options
and makes one kernel call. The kernel's first phase
does what the full path does in Python: the non-finite check of every gradient
(none: nothing changes, and the caller applies its policy), the step counters, the
per-step scalars and rounding keys, and the factored second moments' row and
column sums (``_kernels/gefen_prepass.h``). The result is the full path's, bit for
bit. Anything else (a parameter without a gradient where it had one, a changed
option other than the scalars, a swapped state tensor) makes :meth:`run` return
None without changing anything, and the caller takes the full path.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from . import _cabi, _checks, _dist, _fused, _native, _triton_step
from ._options import max_step, scalar_options
from ._state_layout import packed_codes
from .code_rounding import code_key
from .precision import rounding_key

# Group options a plan may refresh between steps (the kernel's scalars); any
# other option that changes sends the step down the full path.
_SCALAR_OPTIONS = ("lr", "betas", "eps", "weight_decay", "maximize")
# State entries whose in-place changes the jobs depend on (as _dispatch's cache).
_WATCHED = ("period", "qblock", "factored", "codebook")


@dataclass
class _Entry:
    """One parameter of the plan."""

    param: Tensor
    state: dict
    job: _cabi._Job  # a view into the plan's job array
    numel: int
    grad_dtype: torch.dtype
    param_ptr: int
    state_ids: tuple
    versions: tuple  # (tensor, its _version) of the watched state entries
    label: object


def _fields(group: dict) -> tuple:
    """A group's options other than the kernel's scalars, as compared each step."""
    return tuple(
        (key, group[key])
        for key in sorted(group)
        if key not in _SCALAR_OPTIONS and key != "params"
    )


def _set_opts(opts: _cabi.Opts, group: dict, update_clip: float | None) -> None:
    """Writes a group's scalars, as this step's options, into the kernel's opts."""
    lr, beta1, beta2, eps, weight_decay, maximize = scalar_options(group)
    opts.lr, opts.beta1, opts.beta2 = lr, beta1, beta2
    opts.eps, opts.weight_decay = eps, weight_decay
    opts.max_step = max_step(lr, update_clip)
    opts.maximize = maximize


def _steppable(param: Tensor, grad: Tensor, state: dict) -> bool:
    """Whether the plan can take this parameter (the kernel, no sharding, a plain
    fp32 step counter it may advance in place)."""
    step = state.get("step")
    return (
        not _dist.is_sharded(param)
        and param.numel() > 0
        and _fused.c_problem(param, grad, state) is None
        and isinstance(step, Tensor)
        and step.dtype == torch.float32
        and step.device.type == "cpu"
        and step.numel() == 1
        and step.is_contiguous()
    )


class StepPlan:
    """The kernel jobs of a steady step (see the module docstring)."""

    def __init__(self, lib, groups, entries, absent, jobs, keep, opts) -> None:
        self._lib = lib
        self._groups = groups  # [(group, its params list, len, fields, [(opts, clip)])]
        self._entries = entries
        self._absent = absent  # parameters stepped without a gradient: must stay so
        self._jobs = jobs
        self._keep = keep  # what the jobs point into
        self._opts = opts
        self._total = sum(e.numel for e in entries)
        self._cpu = True  # every gradient on the CPU (the kernel's tensors)

    @classmethod
    def build(cls, groups: list, active: list, items: list) -> StepPlan | None:
        """The plan of the step just taken, or None where it cannot hold one.

        Args:
            groups: the param groups the plan covers (their parameters without a
                gradient must stay so).
            active: the ``(group, param, label)`` of this step in them, in order.
            items: the ``StepItem`` of each, in the same order.
        """
        lib = _native.load()
        if lib is None or not active or len(active) != len(items):
            return None
        _cabi.checked_library(lib)
        stepped = {id(p) for _, p, _ in active}
        absent = [p for g in groups for p in g["params"] if id(p) not in stepped]
        opts_of: dict[tuple, _cabi.Opts] = {}
        jobs = (_cabi._Job * len(items))()
        keep, entries = [], []
        size = ctypes.sizeof(_cabi._Job)
        for k, ((group, param, label), item) in enumerate(
            zip(active, items, strict=True)
        ):
            state = item.state
            if item.param is not param or not _steppable(param, item.grad, state):
                return None
            layout, stochastic, codes_sr = _fused.check_step(
                param,
                item.grad,
                state,
                item.options.stochastic_rounding,
                item.seed,
                item.options.stochastic_codes,
            )
            key = (id(group), item.options.update_clip)
            opts = opts_of.get(key)
            if opts is None:
                opts = opts_of[key] = _cabi.Opts()
                _set_opts(opts, group, item.options.update_clip)
            template, held = _cabi.static_job(param, state, layout)
            hyper = _cabi._Hyper()
            io = _cabi._Io(
                param.dtype == torch.bfloat16,
                item.grad.dtype == torch.bfloat16,
                layout[2] == 4 and packed_codes(param, state),
                stochastic and param.dtype == torch.bfloat16,
                0,
                codes_sr,
                0,
                0,
                0,
            )
            job = _cabi._Job.from_buffer(jobs, k * size)
            ctypes.memmove(ctypes.addressof(job), ctypes.addressof(template), size)
            job.param = param.data_ptr()
            job.h, job.io = ctypes.addressof(hyper), ctypes.addressof(io)
            job.step = state["step"].data_ptr()
            job.opts = ctypes.addressof(opts)
            job.seed = item.seed
            keep.append((held, hyper, io, state["step"]))
            watched = tuple(
                (state[w], state[w]._version) for w in _WATCHED if w in state
            )
            entries.append(
                _Entry(
                    param,
                    state,
                    job,
                    param.numel(),
                    item.grad.dtype,
                    param.data_ptr(),
                    tuple(map(id, state.values())),
                    watched,
                    label,
                )
            )
        planned = []
        for group in groups:
            clips = [
                (o, clip) for (gid, clip), o in opts_of.items() if gid == id(group)
            ]
            planned.append(
                (group, group["params"], len(group["params"]), _fields(group), clips)
            )
        return cls(lib, planned, entries, absent, jobs, keep, list(opts_of.values()))

    def holds(self, groups: list, state_of: dict) -> bool:
        """Whether this step is the planned one: same groups and options (but the
        scalars), the same parameters with gradients, states and storages."""
        if len(groups) != len(self._groups):
            return False
        for group, (planned, params, count, fields, _) in zip(
            groups, self._groups, strict=True
        ):
            if group is not planned or group["params"] is not params:
                return False
            if len(params) != count or _fields(group) != fields:
                return False
        for param in self._absent:
            if param.grad is not None:
                return False
        for e in self._entries:
            grad, param = e.param.grad, e.param
            if (
                grad is None
                or grad.dtype is not e.grad_dtype
                or grad.layout is not torch.strided
                or (not grad.is_cpu if self._cpu else grad.device != param.device)
                or grad.numel() != e.numel
                or not grad.is_contiguous()
                or param.data_ptr() != e.param_ptr
                or state_of.get(param) is not e.state
                or tuple(map(id, e.state.values())) != e.state_ids
            ):
                return False
            for tensor, version in e.versions:
                if tensor._version != version:
                    return False
        return True

    def run(self, optimizer, groups: list) -> bool | None:
        """One step of every planned parameter of ``groups`` (the optimizer's):
        True when done; False when a gradient is not finite (nothing changed; the
        optimizer's policy was applied); None when the plan does not hold (nothing
        changed)."""
        if not self.holds(groups, optimizer.state):
            return None
        for e in self._entries:
            e.job.grad = e.param.grad.data_ptr()
        for group, _, _, _, clips in self._groups:
            for opts, clip in clips:
                _set_opts(opts, group, clip)
        threads = torch.get_num_threads() if self._total >= _fused._THREAD_MIN else 1
        chunk = _fused.C_CHUNK or _cabi.checked_library(self._lib)
        bad = _cabi.launch(self._lib, self._jobs, chunk, threads, check=True)
        if bad is not None:
            _checks.reject_nonfinite(optimizer, self._entries[bad].label)
            return False
        return True


def _planned_groups(groups: list, clips_of: dict) -> list:
    """The plan's record of each group (its params list, their count, its options
    but the scalars, and the kernel opts of its update clips)."""
    return [
        (
            group,
            group["params"],
            len(group["params"]),
            _fields(group),
            [(o, clip) for (gid, clip), o in clips_of.items() if gid == id(group)],
        )
        for group in groups
    ]


class TritonPlan(StepPlan):
    """The steady step of parameters that all took the Triton kernels: the same
    checks as the C plan's (:meth:`StepPlan.holds`), then the non-finite verdict
    (one read on the host per device, as the full path's), each job's per-step
    scalars and rounding keys, and the launches on the kept job tables
    (``_triton_step.Tables``)."""

    def __init__(self, groups, entries, absent, steps, tables) -> None:
        self._groups = groups
        self._entries = entries
        self._absent = absent
        self._steps = steps  # per entry: (item, layout, stochastic, codes_sr)
        self._tables = tables
        self._cpu = False

    @classmethod
    def build(
        cls, groups: list, active: list, items: list, tables
    ) -> TritonPlan | None:
        """The plan of the Triton step just taken on ``tables``, or None."""
        if not active or len(active) != len(items) or tables is None:
            return None
        stepped = {id(p) for _, p, _ in active}
        absent = [p for g in groups for p in g["params"] if id(p) not in stepped]
        entries, steps = [], []
        for (group, param, label), item in zip(active, items, strict=True):
            state, step = item.state, item.state.get("step")
            if item.param is not param or param.numel() == 0:
                return None  # a contiguous twin, or a shard's local tensor
            if not (isinstance(step, Tensor) and step.device.type == "cpu"):
                return None
            checked = _fused.check_step(
                param,
                item.grad,
                state,
                item.options.stochastic_rounding,
                item.seed,
                item.options.stochastic_codes,
            )
            watched = tuple(
                (state[w], state[w]._version) for w in _WATCHED if w in state
            )
            entries.append(
                _Entry(
                    param,
                    state,
                    None,
                    param.numel(),
                    item.grad.dtype,
                    param.data_ptr(),
                    tuple(map(id, state.values())),
                    watched,
                    label,
                )
            )
            steps.append((group, item, *checked))
        return cls(_planned_groups(groups, {}), entries, absent, steps, tables)

    def run(self, optimizer, groups: list) -> bool | None:
        """As :meth:`StepPlan.run`, on the Triton kernels."""
        if not self.holds(groups, optimizer.state):
            return None
        grads = [e.param.grad for e in self._entries]
        for ok, e in zip(_checks.finite_flags(grads), self._entries, strict=True):
            if not ok:
                _checks.reject_nonfinite(optimizer, e.label)
                return False
        scalars = {id(g): scalar_options(g) for g in groups}
        jobs, hypers = [], {}
        for (group, item, layout, stochastic, codes_sr), grad in zip(
            self._steps, grads, strict=True
        ):
            step = float(item.state["step"]) + 1
            key = (id(group), item.options, step)
            hyper = hypers.get(key)
            if hyper is None:
                lr, beta1, beta2, eps, wd, maximize = scalars[id(group)]
                options = replace(
                    item.options,
                    lr=lr,
                    beta1=beta1,
                    beta2=beta2,
                    eps=eps,
                    weight_decay=wd,
                    maximize=maximize,
                )
                hyper = hypers[key] = options.scalars(step)
            jobs.append(
                _triton_step.job(
                    item.param,
                    grad,
                    item.state,
                    hyper,
                    layout=layout,
                    stochastic=stochastic,
                    key=rounding_key(item.seed, int(step)) if stochastic else 0,
                    code_key=code_key(item.seed, int(step)) if codes_sr else None,
                    index0=item.index0,
                )
            )
        _triton_step.launch(jobs, self._tables)
        for e in self._entries:
            e.state["step"] += 1
        return True


def build_plan(
    groups: list, active: list, items: list, kinds: set, tables
) -> StepPlan | None:
    """The plan of the next steady step after a full one whose parameters all
    took one implementation (``kinds``), or None (the fallback has no plan)."""
    if kinds == {"c"}:
        return StepPlan.build(groups, active, items)
    if kinds == {"triton"}:
        return TritonPlan.build(groups, active, items, tables)
    return None
