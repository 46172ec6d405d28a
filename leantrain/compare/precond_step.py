"""What a preconditioned training step costs, and the mean step of a run with the
registry's schedule: the measurement behind ``benchmarks/precond_step.py`` (CPU) and
the preconditioning section of ``scripts/gpu_check.sh`` (GPU).

Every arm steps its own copy of one model on the same batch (``x``, ``t``):

* a **reference** (``loss.backward(); opt.step()`` with a plain optimizer, e.g.
  AdamW): the step every ratio is taken against;
* per method, the **plain** arm: curvature and preconditioner refreshed at step 0
  (in the warm-up), then never again (both intervals :data:`NEVER`), so every timed
  step only applies the preconditioner; in the user's loop
  (:func:`~leantrain.precond.precondition_in_loop` around the method's base
  optimizer, arm ``"<label> loop"``) and/or through the gradient maker
  (``gm.forward_and_backward(); base.step()``, arm ``"<label> maker"``);
* with ``schedule``, the arms that refresh on every step (:func:`refresh_arms`):
  ``"<label> curvature"`` updates the curvature only (the preconditioner never;
  only when the registry's schedule has curvature steps without a preconditioner
  update) and ``"<label> refresh"`` both.

A run with the registry's schedule is periodic (curvature every ``C`` steps, the
preconditioner every ``I``, ``I`` a multiple of ``C``), so its mean step is
:func:`~leantrain.precond.step_cost.schedule_mean_step` of the plain, curvature and
refresh medians (the refresh median standing in for a missing curvature arm).

Each arm's figure is the median of its timed steps, as ``clock`` measures them
(:class:`~leantrain.compare.optimizer_step.Clock`: CUDA events on a GPU, e.g.
``time.process_time`` on a shared CPU). The **floor** of a method is the ratio the
multiply-adds alone predict for a plain step over the forward and backward,
``1 + application_macs / (tokens * forward_backward_macs)``
(:mod:`leantrain.precond.step_cost`).

Example:
    >>> import torch
    >>> from leantrain.compare.optimizer_step import Clock
    >>> from leantrain.compare.precond_step import measure
    >>> from leantrain.models.gpt import GPT, GPTConfig
    >>> model = GPT(GPTConfig(n_layer=1, d_model=32, n_head=2, block_size=8))
    >>> x = t = torch.randint(0, 256, (2, 8))
    >>> costs = measure(
    ...     model, (x, t), ["kfac"],
    ...     base=lambda method, ps: torch.optim.SGD(ps, lr=1e-3),
    ...     references={"sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3)},
    ...     reference="sgd", clock=Clock(torch.device("cpu")), steps=1, warmup=0,
    ... )
    >>> sorted(costs.medians), costs.intervals["kfac"]
    (['kfac loop', 'kfac maker', 'kfac refresh', 'sgd'], (20, 20))
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from leantrain.compare.optimizer_step import Clock
from leantrain.models.gpt import lm_loss
from leantrain.precond import (
    IN_LOOP_METHODS,
    PRECOND_METHODS,
    PreconditioningConfig,
    make_gradient_maker,
    precondition_in_loop,
)
from leantrain.precond.step_cost import (
    application_macs,
    forward_backward_macs,
    schedule_mean_step,
)

__all__ = [
    "FORMS",
    "NEVER",
    "PrecondMethod",
    "StepCosts",
    "measure",
    "refresh_arms",
    "registry_intervals",
]

# An interval no run reaches: refreshed at step 0 (in the warm-up), never again.
NEVER = 10**9
FORMS = ("loop", "maker")
BaseFactory = Callable[[str, Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class PrecondMethod:
    """A registry method as one row: ``name`` (a key of ``PRECOND_METHODS``), the
    row's ``label`` (the name when empty) and maker keyword arguments overriding
    the registry's (e.g. ``{"fisher_type": "fisher_emp"}``)."""

    name: str
    label: str = ""
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def row(self) -> str:
        return self.label or self.name


@dataclass
class StepCosts:
    """What :func:`measure` returns; seconds throughout.

    Attributes:
        medians: arm name -> median seconds of its timed steps.
        arms: arm name -> (method label, kind), kind one of ``"reference"``,
            ``"loop"``, ``"maker"``, ``"curvature"``, ``"refresh"``.
        plain: method label -> the plain arm its schedule mean uses (the loop's
            when timed, else the maker's).
        floors: method label -> the plain step's floor over the forward and
            backward (a ratio).
        intervals: method label -> the registry's (curvature, preconditioner)
            intervals.
        means: method label -> the mean step of a run with those intervals.
        reference: the arm every ratio is taken against.
    """

    medians: dict[str, float]
    arms: dict[str, tuple[str, str]]
    plain: dict[str, str]
    floors: dict[str, float]
    intervals: dict[str, tuple[int, int]]
    means: dict[str, float]
    reference: str

    def x_reference(self, seconds: float) -> float:
        """``seconds`` over the reference arm's median."""
        return seconds / self.medians[self.reference]


def registry_intervals(method: str) -> tuple[int, int]:
    """(curvature, preconditioner) interval of ``method``'s registry schedule, as
    its maker's ``PreconditioningConfig`` holds them."""
    if method not in PRECOND_METHODS:
        raise ValueError(f"unknown preconditioning method {method!r}")
    config = dataclasses.replace(
        PreconditioningConfig(), **PRECOND_METHODS[method].config
    )
    return config.curvature_interval, config.preconditioner_interval


def refresh_arms(
    method: str, ignore_modules: tuple[str, ...] = ()
) -> dict[str, dict[str, Any]]:
    """The configs of the arms that refresh on every step: ``"curvature"`` (the
    curvature only; when the schedule has curvature steps without a preconditioner
    update) and ``"refresh"`` (both)."""
    every = {
        "ignore_modules": ignore_modules,
        "curvature_interval": 1,
        "preconditioner_interval": 1,
    }
    curvature, preconditioner = registry_intervals(method)
    arms = {"refresh": every}
    if preconditioner > curvature:
        arms["curvature"] = {**every, "preconditioner_interval": NEVER}
    return arms


@dataclass
class _Arm:
    step: Callable[[], None]
    method: str
    kind: str
    rounds: int  # warm-up + timed steps
    warmup: int
    maker: Any = None


def _check_count(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _methods(methods: Sequence[str | PrecondMethod]) -> list[PrecondMethod]:
    out = [m if isinstance(m, PrecondMethod) else PrecondMethod(m) for m in methods]
    for m in out:
        if m.name not in PRECOND_METHODS:
            raise ValueError(
                f"unknown preconditioning method {m.name!r}; registered: "
                f"{', '.join(PRECOND_METHODS)}"
            )
    rows = [m.row for m in out]
    if len(set(rows)) < len(rows):
        raise ValueError(f"methods must have distinct labels, got {rows}")
    return out


def measure(
    model: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    methods: Sequence[str | PrecondMethod],
    *,
    base: BaseFactory,
    references: Mapping[str, Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]],
    reference: str,
    clock: Clock,
    steps: int,
    warmup: int,
    refresh_steps: int | None = None,
    refresh_warmup: int | None = None,
    schedule: bool = True,
    forms: Sequence[str] = FORMS,
    ignore_modules: tuple[str, ...] = ("wpe",),
    loss_fn: Callable = lm_loss,
    autocast_dtype: torch.dtype | None = None,
    per_method: bool = False,
) -> StepCosts:
    """Time every arm (see the module docstring) on copies of ``model``.

    Args:
        model: the model; every arm steps its own deep copy, from the same init.
        batch: ``(x, t)`` on the model's device; ``loss_fn(model(x), t)`` is the
            loss, ``x.shape[-1]`` the context the floor counts attention over.
        methods: registry names or :class:`PrecondMethod` rows.
        base: ``base(method name, params)`` -> the optimizer a method wraps (in
            the loop) or steps after its maker (e.g. SGD without momentum for SOAP,
            whose direction already carries Adam's moments).
        references: name -> factory of a plain optimizer arm.
        reference: the key of ``references`` ratios are taken against.
        clock: times one step (its ``time``).
        steps, warmup: timed and untimed steps of the reference and plain arms.
        refresh_steps, refresh_warmup: the same for the curvature and refresh
            arms (default: ``steps``, ``warmup``); a refresh can cost many plain
            steps, so a GPU check times few.
        schedule: also time the curvature and refresh arms and return the means.
        forms: ``"loop"`` and/or ``"maker"``; a method that cannot run in the
            loop (PSGD) runs through its maker only.
        ignore_modules: modules the makers skip (a GPT's position table sees
            ``(T,)`` positions, not the batch).
        loss_fn: the loss of the logits and ``t``.
        autocast_dtype: run the forward under ``torch.autocast`` of ``x``'s device
            type at this dtype (bf16 on a GPU); None: no autocast.
        per_method: time the references, then each method's arms, as separate
            groups, each built, timed and deleted before the next, so one GPU
            holds one method's model copies at a time (the arms of a 12-layer
            d 768 GPT hold some GB each). Off (the default), all arms take
            turns step by step, which keeps them fair under a shared CPU's
            changing load; on a dedicated GPU groups timed one after another
            compare fairly.

    Returns:
        :class:`StepCosts`.

    Raises:
        ValueError: an unknown method or form, a method that cannot run in the
            requested forms, two methods with one label, a reference not in
            ``references``, or a step count that is not an int (``steps`` and
            ``refresh_steps`` >= 1, the warm-ups >= 0).
    """
    rows = _methods(methods)
    _check_count("steps", steps, 1)
    _check_count("warmup", warmup, 0)
    refresh_steps = steps if refresh_steps is None else refresh_steps
    refresh_warmup = warmup if refresh_warmup is None else refresh_warmup
    _check_count("refresh_steps", refresh_steps, 1)
    _check_count("refresh_warmup", refresh_warmup, 0)
    if not forms or any(f not in FORMS for f in forms):
        raise ValueError(f"forms must be a non-empty subset of {FORMS}, got {forms!r}")
    if reference not in references:
        raise ValueError(f"reference {reference!r} is not one of {list(references)}")
    for m in rows:
        if "maker" not in forms and m.name not in IN_LOOP_METHODS:
            raise ValueError(f"method {m.name!r} cannot run in the loop")
    x, t = batch
    if autocast_dtype is None:
        autocast = contextlib.nullcontext
    else:

        def autocast():
            return torch.autocast(x.device.type, dtype=autocast_dtype)

    def base_step(net: nn.Module, opt: torch.optim.Optimizer) -> Callable[[], None]:
        def step() -> None:
            opt.zero_grad(set_to_none=True)
            with autocast():
                loss = loss_fn(net(x), t)
            loss.backward()
            opt.step()

        return step

    def method_arm(m: PrecondMethod, form: str, kind: str, config: dict) -> _Arm:
        net = copy.deepcopy(model)
        opt = base(m.name, net.parameters())
        plain = kind in FORMS
        rounds = (warmup + steps) if plain else (refresh_warmup + refresh_steps)
        skip = warmup if plain else refresh_warmup
        if form == "loop":
            wrapped = precondition_in_loop(opt, net, m.name, config=config, **m.kwargs)
            return _Arm(
                base_step(net, wrapped), m.row, kind, rounds, skip, wrapped.maker
            )
        gm = make_gradient_maker(
            m.name, net, config=config, lr=lambda: opt.param_groups[0]["lr"], **m.kwargs
        )

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            with autocast():
                y = gm.setup_model_call(net, x)
                gm.setup_loss_call(loss_fn, y, t)
                gm.forward_and_backward()
            opt.step()

        return _Arm(step, m.row, kind, rounds, skip, gm)

    def reference_arms() -> dict[str, _Arm]:
        arms = {}
        for name, make in references.items():
            net = copy.deepcopy(model)
            step = base_step(net, make(net.parameters()))
            arms[name] = _Arm(step, name, "reference", warmup + steps, warmup)
        return arms

    plain_config = {
        "ignore_modules": ignore_modules,
        "curvature_interval": NEVER,
        "preconditioner_interval": NEVER,
    }
    plain_arm: dict[str, str] = {}

    def arms_of(m: PrecondMethod) -> dict[str, _Arm]:
        arms = {}
        timed = [f for f in FORMS if f in forms]
        timed = [f for f in timed if f == "maker" or m.name in IN_LOOP_METHODS]
        for form in timed:
            arms[f"{m.row} {form}"] = method_arm(m, form, form, plain_config)
        plain_arm[m.row] = f"{m.row} {timed[0]}"
        if schedule:
            for kind, config in refresh_arms(m.name, ignore_modules).items():
                arms[f"{m.row} {kind}"] = method_arm(m, timed[0], kind, config)
        return arms

    per_token = forward_backward_macs(model, x.shape[-1])
    floors: dict[str, float] = {}
    medians: dict[str, float] = {}
    labels: dict[str, tuple[str, str]] = {}

    def run(arms: dict[str, _Arm]) -> None:
        medians.update(_time_in_turns(arms, clock))
        labels.update({name: (arm.method, arm.kind) for name, arm in arms.items()})
        for m in rows:
            if plain_arm.get(m.row) in arms:
                gm = arms[plain_arm[m.row]].maker
                floors[m.row] = 1.0 + application_macs(gm) / (x.numel() * per_token)

    if per_method:
        run(reference_arms())
        for m in rows:
            run(arms_of(m))
            gc.collect()  # the makers' hooks hold their models in cycles
            if x.device.type == "cuda":
                torch.cuda.empty_cache()  # the group's copies are gone
    else:
        arms = reference_arms()
        for m in rows:
            arms.update(arms_of(m))
        run(arms)
    intervals = {m.row: registry_intervals(m.name) for m in rows}
    means = {}
    if schedule:
        for m in rows:
            plain = medians[plain_arm[m.row]]
            refresh = medians[f"{m.row} refresh"]
            curvature = medians.get(f"{m.row} curvature", refresh)
            means[m.row] = schedule_mean_step(
                plain, curvature, refresh, *intervals[m.row]
            )
    return StepCosts(medians, labels, plain_arm, floors, intervals, means, reference)


def _time_in_turns(arms: dict[str, _Arm], clock: Clock) -> dict[str, float]:
    """One step of each arm per round (while it has steps left), so the changing
    load of a shared machine hits them alike; the median of each one's timed
    steps."""
    times: dict[str, list[float]] = {name: [] for name in arms}
    for round_ in range(max(arm.rounds for arm in arms.values())):
        for name, arm in arms.items():
            if round_ < arm.rounds:
                times[name].append(clock.time(arm.step))
    return {
        name: statistics.median(times[name][arm.warmup :]) for name, arm in arms.items()
    }
