"""The preconditioned gradient maker: scheduling, module selection, EMA, state.

Every preconditioning method (K-FAC, Shampoo, the diagonal empirical Fisher, ...)
subclasses :class:`PreconditionedGradientMaker` and implements four things:
which modules it handles (:meth:`~PreconditionedGradientMaker.is_supported`), how
the curvature is computed from a forward/backward pass
(:meth:`~PreconditionedGradientMaker.update_curvature`, with module hooks registered
by :meth:`~PreconditionedGradientMaker.curvature_hooks` or a custom
``_curvature_pass``), how the preconditioner follows from the curvature
(:meth:`~PreconditionedGradientMaker.update_preconditioner`), and how it is applied to
``.grad`` (:meth:`~PreconditionedGradientMaker.precondition`). The base decides when.
"""

from __future__ import annotations

import abc
import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from leantrain.precond import _patterns, _safeguards
from leantrain.precond._checks import check_int
from leantrain.precond._coverage import Coverage, coverage_of, warn_uncovered
from leantrain.precond._denormal import curvature_arithmetic
from leantrain.precond._schedule import PreconditioningConfig, is_due
from leantrain.precond.curv._recompute import (
    ReentrantCheckpointError,
    refuse_reentrant_checkpoint,
)
from leantrain.precond.gradient_maker import (
    GradientMaker,
    unscaled,
    unwrap_model,
)

__all__ = ["PreconditionedGradientMaker", "PreconditioningConfig", "is_due"]


def all_finite(tensors: list[Tensor]) -> bool:
    """Whether every entry of every tensor is finite (one host sync).

    Through each tensor's sum: a NaN or an infinity makes it non-finite, and a sum
    is 50x cheaper than ``isfinite().all()`` on CPU. A float32 sum overflows only
    when entries reach ~1e34 (a diverged run, counted as non-finite too); half
    precision is summed in float32, where it cannot overflow.
    """
    if not tensors:
        return True
    sums = [
        t.sum(dtype=torch.float32) if t.element_size() < 4 else t.sum() for t in tensors
    ]
    return bool(torch.stack([x.isfinite() for x in sums]).all())


def _check_preconditionable(name: str, module: nn.Module) -> None:
    """Refuse, when the maker is built, what no curvature here is defined for."""
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse:
        raise ValueError(
            f"module {name!r}: {type(module).__name__}(sparse=True) produces sparse "
            "gradients, which no preconditioner here reads; build it with "
            "sparse=False or list it in ignore_modules"
        )
    for pname, p in module.named_parameters(recurse=False):
        if p.requires_grad and p.is_complex():
            raise ValueError(
                f"module {name!r}: parameter {pname!r} is complex ({p.dtype}); the "
                "curvature here is real (list the module in ignore_modules)"
            )


class PreconditionedGradientMaker(GradientMaker, abc.ABC):
    """Base of every preconditioned gradient maker.

    ``forward_and_backward()`` runs, at step ``s``: the forward and backward (as the
    curvature pass when curvature is due, which also yields the loss gradient), then
    :meth:`update_curvature` if due, :meth:`update_preconditioner` if due, and
    :meth:`precondition` every step, which rewrites ``.grad`` in place. Between
    updates the last preconditioner is reused. Counters ``step``,
    ``curvature_updates`` and ``preconditioner_updates`` are saved by
    :meth:`state_dict`.

    Args:
        model: the module to train (may be wrapped in ``DistributedDataParallel``;
            module names are those of the wrapped module, without ``module.``).
        config: the schedule; ``PreconditioningConfig()`` if ``None``.

    Raises:
        TypeError: if ``config`` is not a :class:`PreconditioningConfig`.
        ValueError: if ``config.ignore_modules`` names a module instance that is not
            in the model, or no supported module is left to precondition.

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from leantrain.precond import (
        ...     DiagonalEmpiricalFisherGradientMaker, PreconditioningConfig)
        >>> # The concrete diagonal empirical Fisher maker shows the schedule.
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
        ...                             torch.nn.Linear(8, 3))
        >>> gm = DiagonalEmpiricalFisherGradientMaker(
        ...     model, PreconditioningConfig(damping=1e-3))
        >>> x, t = torch.randn(16, 4), torch.randint(0, 3, (16,))
        >>> y = gm.setup_model_call(model, x)
        >>> gm.setup_loss_call(F.cross_entropy, y, t)
        >>> output, loss = gm.forward_and_backward()
        >>> gm.step, gm.curvature_updates, gm.preconditioner_updates
        (1, 1, 1)
    """

    runs_compiled_calls = False  # hooks and HVPs need the eager call

    def __init__(
        self, model: nn.Module, config: PreconditioningConfig | None = None
    ) -> None:
        super().__init__(model)
        config = PreconditioningConfig() if config is None else config
        if not isinstance(config, PreconditioningConfig):
            raise TypeError(
                f"config must be a PreconditioningConfig, got {type(config).__name__}"
            )
        self.config = config
        self.step = 0
        self.curvature_updates = 0
        self.preconditioner_updates = 0
        # Curvature passes discarded for a non-finite loss or gradient (not saved).
        self.skipped_curvature_updates = 0
        # Steps skipped by config.nonfinite="skip" (not saved).
        self.nonfinite_steps = 0
        self._ema: dict[str, Tensor] = {}
        self._ema_counts: dict[str, int] = {}
        inner = unwrap_model(model)
        members = {id(m) for m in inner.modules()}
        for entry in config.ignore_modules:
            if isinstance(entry, nn.Module) and id(entry) not in members:
                raise ValueError(
                    f"ignore_modules contains a {type(entry).__name__} instance that "
                    "is not a submodule of the model"
                )
        if next(self.modules(), None) is None:
            supported = [
                n or "<root>" for n, m in inner.named_modules() if self.is_supported(m)
            ]
            raise ValueError(
                f"{type(self).__name__}: no module left to precondition. Supported "
                f"modules in the model: {supported or 'none'}; "
                f"ignore_modules={config.ignore_modules!r}."
            )
        for name, module in self.modules():
            _check_preconditionable(name or "<root>", module)
        warn_uncovered(type(self).__name__, self.coverage())
        self._frozen_at_build = _patterns.frozen_parameters(self.model)

    def coverage(self) -> Coverage:
        """What this maker preconditions: every module owning trainable parameters
        as covered, not covered (supported by no rule here: plain gradient) or
        ignored (by ``config.ignore_modules``), with its parameter count."""
        selected = {name for name, _ in self.modules()}
        not_ignored = {name for name, _ in self._walk(supported_only=False)}
        return coverage_of(unwrap_model(self.model), selected, not_ignored)

    # -- what subclasses define ---------------------------------------------------
    @abc.abstractmethod
    def is_supported(self, module: nn.Module) -> bool:
        """Whether this method preconditions ``module``'s own parameters.

        Called from ``__init__`` (to reject a config that leaves nothing to do), so
        set what it needs before calling ``super().__init__``.
        """

    @abc.abstractmethod
    def update_curvature(self) -> None:
        """Compute the curvature from what the last curvature pass collected."""

    @abc.abstractmethod
    def update_preconditioner(self) -> None:
        """Rebuild the preconditioner from the current curvature."""

    @abc.abstractmethod
    def precondition(self) -> None:
        """Replace ``.grad`` of the selected modules by the preconditioned gradient."""

    def curvature_hooks(self) -> contextlib.AbstractContextManager:
        """Context active during the curvature pass: register module hooks here.

        The default registers nothing. Subclasses that need per-example inputs or
        output gradients return a context manager that adds the hooks on entry and
        removes them on exit.
        """
        return contextlib.nullcontext()

    def _curvature_pass(self) -> tuple[Any, Tensor]:
        """Forward + backward that also collects curvature data (hooks active)."""
        with self.curvature_hooks():
            return self._forward_backward()

    # -- module selection -----------------------------------------------------------
    def modules(self) -> Iterator[tuple[str, nn.Module]]:
        """The ``(name, module)`` pairs of supported modules not ignored by the config.

        A module is ignored if it, or a module containing it, is an ignored instance
        or an instance of an ignored class, or if its name contains an ignored
        substring. The walk runs once per model and ``ignore_modules``: every step
        asks for the modules several times, and walking the tree each time cost a
        tenth of a small GPT's plain step.
        """
        key = (id(self.model), self.config.ignore_modules)
        if self.__dict__.get("_modules_key") != key:
            self._modules_cache = list(self._walk(supported_only=True))
            self._modules_key = key
        return iter(self._modules_cache)

    def _walk(self, *, supported_only: bool) -> Iterator[tuple[str, nn.Module]]:
        """The modules not ignored by the config (supported ones only, or all)."""
        entries = self.config.ignore_modules
        names = [e for e in entries if isinstance(e, str)]
        types = tuple(e for e in entries if isinstance(e, type))
        instances = {id(e) for e in entries if isinstance(e, nn.Module)}
        seen: set[int] = set()  # a module registered twice is preconditioned once

        def walk(name: str, module: nn.Module, ignored: bool):
            if id(module) in seen:
                return
            seen.add(id(module))
            ignored = (
                ignored
                or id(module) in instances
                or isinstance(module, types)
                or any(s in name for s in names)
            )
            if not ignored and (not supported_only or self.is_supported(module)):
                yield name, module
            for child_name, child in module.named_children():
                yield from walk(
                    f"{name}.{child_name}" if name else child_name, child, ignored
                )

        yield from walk("", unwrap_model(self.model), False)

    # -- the step ------------------------------------------------------------------
    def _check_total_steps(self) -> None:
        """Raise once ``config.num_total_steps`` steps have run."""
        total = self.config.num_total_steps
        if total is not None and self.step >= total:
            raise RuntimeError(
                f"num_total_steps={total} steps have run; raise num_total_steps in the "
                "config (or set it to None) to keep training."
            )

    def forward_and_backward(
        self, *, grad_scaler: torch.amp.GradScaler | None = None
    ) -> tuple[Any, Tensor]:
        """One step: forward/backward, due updates, then :meth:`precondition`.

        With ``config.accumulation_steps = k > 1`` a call is one micro-batch: the
        first ``k - 1`` calls only add to ``.grad`` (and record the curvature's
        statistics), the ``k``-th updates and preconditions the sum.

        Args:
            grad_scaler: back-propagate ``grad_scaler.scale(loss)``. The curvature
                is taken from the unscaled gradients, ``.grad`` is left holding the
                scaled preconditioned gradient for ``grad_scaler.step(optimizer)``,
                and a non-finite pass (the step the scaler skips) changes no
                curvature.

        Returns:
            ``(output, loss)``, as :meth:`GradientMaker.forward_and_backward` (the
            loss unscaled).

        Raises:
            RuntimeError: before setup, or once ``config.num_total_steps`` steps ran.
            ValueError: ``grad_scaler`` or ``accumulation_steps > 1`` with a method
                that cannot take them (the message says why).
        """
        self._check_ready()
        scale = _patterns.checked_scale(self, grad_scaler)
        _patterns.check_trainable(self)
        if self.config.accumulation_steps > 1 or self._records_backward:
            return _patterns.micro_batch(self, grad_scaler)
        try:
            return self._step(scale, grad_scaler)
        except ReentrantCheckpointError:
            # The pass asked torch.autograd.grad through a reentrant checkpoint. The
            # empirical Fisher can be recorded from a plain backward instead, as in
            # a user's loop; .grad and the curvature are untouched so far.
            if not (self.records_in_loop and self.fisher_type == "fisher_emp"):
                raise
            self._records_backward = True
            return _patterns.micro_batch(self, grad_scaler)

    # Steps run as one micro-batch recorded from a plain backward (set when a
    # reentrant checkpoint refused the curvature pass).
    _records_backward = False

    def _step(self, scale: float, grad_scaler: Any) -> tuple[Any, Tensor]:
        """One step on the whole batch: the pass (the curvature pass when curvature
        is due), then :meth:`finish_step` on the unscaled gradient."""
        self._check_total_steps()
        self._scaling(grad_scaler)
        try:
            with refuse_reentrant_checkpoint(type(self).__name__):
                if self.config.curvature_due(self.step):
                    self._check_no_backward_averager()
                    output, loss = self._curvature_pass()
                else:
                    output, loss = self._forward_backward()
        finally:
            self._scaling(None)
        _patterns.scale_gradients(self.model, 1.0 / scale)
        if not self.finish_step(scaled=grad_scaler is not None, loss=loss):
            return output, loss
        _patterns.scale_gradients(self.model, scale)
        return output, unscaled(loss, grad_scaler)

    def finish_step(
        self,
        *,
        scaled: bool,
        loss: Tensor | None = None,
        recorder: Any = None,
        loss_scale: float | Tensor = 1.0,
    ) -> bool:
        """The step schedule, once the (unscaled) gradient is in ``.grad``: due ->
        finite -> update curvature -> update preconditioner -> precondition ->
        count. Every way through a step runs it: :meth:`forward_and_backward` after
        its pass, the last of ``config.accumulation_steps`` micro-batches, and
        ``PreconditionedOptimizer.step()``.

        Args:
            scaled: a ``GradScaler`` drives the step (it skips a non-finite one
                itself; only the curvature of such a pass is discarded). Without
                one, a non-finite gradient skips the whole step under
                ``config.nonfinite``.
            loss: the loss of the maker's own curvature pass, checked with the
                gradients (``None``: the gradients alone, the pass ran elsewhere).
            recorder: the ``LoopRecorder`` whose recorded micro-batches are folded
                in before the curvature update (``None``: the pass set the
                statistics, or they are read from ``.grad``).
            loss_scale: the factor the recorded losses were multiplied by (a
                float, or a ``GradScaler``'s 0-dim scale tensor, read on the host
                only when curvature is due).

        Returns:
            False when the step was skipped (nothing updated, ``step`` kept).
        """
        self._check_total_steps()
        curvature_due = self.config.curvature_due(self.step)
        preconditioner_due = self.config.preconditioner_due(self.step)
        if curvature_due:
            what = "gradient" if loss is None else "loss or gradient"
            if loss is None:
                finite = self._gradients_are_finite()
            else:
                finite = self._pass_is_finite(loss)
            if not finite:
                if not scaled:  # the caller takes back a recording
                    self._skip_nonfinite_step(True, what)
                    return False
                # Overflow under GradScaler: this pass's curvature is discarded so
                # the running estimate, the EMA and the inverses stay those of the
                # last finite step. The gradient is written as it is (non-finite),
                # for the scaler to skip the step.
                curvature_due = preconditioner_due = False
                self._skip_curvature(what)
                if recorder is not None:
                    recorder.stop()  # the recorded calls belong to no step
        if curvature_due:
            if recorder is not None:
                recorder.collect(float(loss_scale))
            with curvature_arithmetic():
                self.update_curvature()
            self.curvature_updates += 1
        self._apply_preconditioner(preconditioner_due)
        # The non-finite policy's check (the one host synchronisation of a step
        # that refreshes nothing) reads the preconditioned gradient: a NaN of the
        # gradient reaches it, and so does one the preconditioner made.
        if not scaled and not self._gradients_are_finite():
            self._skip_nonfinite_step(False, "preconditioned gradient")
            return False
        self.step += 1
        return True

    def _apply_preconditioner(self, preconditioner_due: bool) -> None:
        """Rebuild the preconditioner if due, then precondition ``.grad`` (grafted
        to the plain gradient's layer norms under ``config.grafting``).

        The model's own passes run in the user's float mode; only the curvature
        arithmetic flushes subnormals (see _denormal.py for why).
        """
        with curvature_arithmetic():
            if preconditioner_due:
                self.update_preconditioner()
                self.preconditioner_updates += 1
            config = self.config
            lrs = None if config.kl_clip is None else self._layer_lrs()
            if config.grafting is None and lrs is None:
                self.precondition()
                return
            # The norms are grafting's; the KL clip needs only the copies.
            plain = self._plain_gradient(
                keep=lrs is not None, norms=config.grafting is not None
            )
            self.precondition()
            layers = self._layer_gradients()
            if config.grafting is not None:
                _safeguards.graft(layers, plain.norms)
            if lrs is not None:
                nu = _safeguards.kl_clip_factor(plain.dots(layers), lrs, config.kl_clip)
                flat = [t for layer in layers for t in layer]
                if flat:
                    torch._foreach_mul_(flat, nu.to(flat[0].dtype))

    def _layer_gradients(self) -> list[list[Tensor]]:
        """The ``.grad`` tensors of each preconditioned module (one list a module)."""
        return [
            [p.grad for p in module.parameters(recurse=False) if p.grad is not None]
            for _, module in self.modules()
        ]

    def _plain_gradient(
        self, *, keep: bool, norms: bool = True
    ) -> _safeguards.PlainGradient:
        """Each preconditioned module's plain gradient, before :meth:`precondition`
        (makers that keep gradient pieces outside ``.grad`` add theirs)."""
        return _safeguards.PlainGradient(
            self._layer_gradients(), {}, keep=keep, norms=norms
        )

    # The learning rate the KL clip assumes: a float or a callable returning the
    # current one (kfac-pytorch's ``lr=``). PreconditionedOptimizer reads each
    # module's from the wrapped optimizer instead.
    lr: float | Callable[[], float] | None = None
    # Parameter -> the learning rate of its group (set by PreconditionedOptimizer).
    _lr_of: Callable[[Tensor], float] | None = None
    _warned_no_lr = False

    def _layer_lrs(self) -> list[float] | None:
        """Each preconditioned module's learning rate for the KL clip, or None (and
        a warning, once) when the maker does not know it."""
        modules = [module for _, module in self.modules()]
        if self._lr_of is not None:
            firsts = [next(m.parameters(recurse=False), None) for m in modules]
            return [0.0 if p is None else float(self._lr_of(p)) for p in firsts]
        if self.lr is not None:
            lr = self.lr() if callable(self.lr) else self.lr
            return [float(lr)] * len(modules)
        if not self._warned_no_lr:
            self._warned_no_lr = True
            warnings.warn(
                f"{type(self).__name__}: config.kl_clip={self.config.kl_clip} needs "
                "the optimizer's learning rate, which a gradient maker does not see: "
                "set maker.lr (a float or a callable returning it), or precondition "
                "inside your loop with precondition_in_loop / "
                "PreconditionedOptimizer, which reads it; the preconditioned "
                "gradient is not clipped meanwhile (warned once)",
                UserWarning,
                stacklevel=4,
            )
        return None

    def _gradients_are_finite(self) -> bool:
        return all_finite(
            [p.grad for p in self.model.parameters() if p.grad is not None]
        )

    def _skip_nonfinite_step(self, curvature_due: bool, where: str) -> None:
        """A step whose gradient is not finite, without a scaler: raise, or skip it
        as ``GradScaler`` would (no update, the step counter stays, ``.grad``
        cleared so that ``optimizer.step()`` leaves the parameters alone)."""
        self._discard_pass()
        self.skipped_curvature_updates += curvature_due
        _safeguards.reject_nonfinite(self, where)
        for p in self.model.parameters():
            p.grad = None

    def _skip_curvature(self, what: str) -> None:
        """Discard this step's curvature pass (non-finite ``what``); warn once."""
        self._discard_pass()
        self.skipped_curvature_updates += 1
        if self.skipped_curvature_updates == 1:
            warnings.warn(
                f"{type(self).__name__}: non-finite {what} at step {self.step}; its "
                "curvature is discarded (counted in skipped_curvature_updates, "
                "warned once).",
                RuntimeWarning,
                stacklevel=3,
            )

    # -- loss scaling, micro-batches, frozen parameters (see _patterns.py) ---------
    # Whether the loss gradient reaches the curvature only through ``.grad`` and the
    # logits' gradient, so a GradScaler's scale can be divided out of both.
    scales_loss: bool = False
    # Whether the statistics come from module hooks (LoopRecorder) rather than .grad.
    records_in_loop: bool = False
    # Whether a parameter frozen after construction (no ``.grad``) is skipped.
    skips_frozen: bool = True

    def _discard_pass(self) -> None:
        """Forget what a discarded curvature pass collected (beyond what the next
        pass overwrites anyway)."""

    def _accumulation_refusal(self) -> str | None:
        """Why this maker cannot combine micro-batches (``None``: it can)."""
        return (
            "its curvature pass runs the model itself on one batch (a second-order "
            "backward, a replay at other parameters, or per-example vmap)"
        )

    def _pass_is_finite(self, loss: Tensor) -> bool:
        """Whether the curvature pass produced a finite loss and finite gradients.

        Checked on curvature steps only (the others change no state). Under DDP
        only the gradients count: they are averaged, so every rank decides alike
        (a per-rank loss could split the ranks and hang a later collective).
        Subclasses whose pass keeps gradient pieces outside ``.grad`` add them.
        """
        tensors = [p.grad for p in self.model.parameters() if p.grad is not None]
        if self._process_group() is None:
            tensors.append(loss.detach())
        return all_finite(tensors + self._unwritten_gradients())

    def _unwritten_gradients(self) -> list[Tensor]:
        """Gradient pieces of this pass not (yet) in ``.grad``; none by default."""
        return []

    def _check_no_backward_averager(self) -> None:
        # A data-parallel averager that runs in loss.backward() (the layer-parallel
        # mesh's GradientAverager) never sees a curvature pass, which writes .grad
        # itself: each replica would keep its own gradient, silently.
        if getattr(unwrap_model(self.model), "gradient_averager", None) is not None:
            raise RuntimeError(
                f"{type(self).__name__}: the model averages its gradients over data "
                "parallel replicas in backward (model.gradient_averager, set by "
                "leantrain.layer_parallel.parallelize), which a curvature pass "
                "bypasses; use parallelize(model, mesh, config=LayerParallelConfig("
                "average_gradients=False)) and wrap the model in "
                "DistributedDataParallel over the mesh's 'dp' group instead"
            )

    # -- helpers for subclasses ----------------------------------------------------
    def _ema_update(self, name: str, value: Tensor) -> Tensor:
        r"""Fold ``value`` into the running curvature ``name``; return the estimate.

        With ``ema_decay=None`` the estimate is ``value``. Otherwise
        :math:`m_t = \beta m_{t-1} + (1-\beta) x_t` (:math:`m_0 = 0`) and the estimate
        is :math:`m_t / (1 - \beta^t)`, so the first update returns ``value`` itself.
        """
        decay = self.config.ema_decay
        if decay is None:
            self._ema[name] = value
            self._ema_counts[name] = 1
            return value
        acc = self._ema.get(name)
        acc = value * (1 - decay) if acc is None else acc * decay + value * (1 - decay)
        count = self._ema_counts.get(name, 0) + 1
        self._ema[name], self._ema_counts[name] = acc, count
        return acc / (1 - decay**count)

    def _process_group(self) -> Any:
        """The DDP process group to average over, or ``None`` on a single process."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        if isinstance(self.model, nn.parallel.DistributedDataParallel):
            group = self.model.process_group
            return group if dist.get_world_size(group) > 1 else None
        return None

    def _all_reduce_mean(self, tensors: list[Tensor]) -> None:
        """Average ``tensors`` in place over the DDP group (as DDP does for grads)."""
        group = self._process_group()
        if group is None or not tensors:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat, group=group)
        flat /= dist.get_world_size(group)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    # -- state -----------------------------------------------------------------------
    def _extra_state(self) -> dict[str, Any]:
        """Subclass state (e.g. preconditioner tensors) saved by :meth:`state_dict`."""
        return {}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`_extra_state` returned."""

    def _layout(self) -> dict[str, list[list[int]]]:
        """The shapes of each preconditioned module's parameters, by module name:
        what a saved state must match to be loaded here."""
        return {
            name: [list(p.shape) for p in module.parameters(recurse=False)]
            for name, module in self.modules()
        }

    def _check_layout(self, saved: Any) -> None:
        """Raise ``ValueError`` naming the first module whose parameters differ."""
        if not isinstance(saved, dict):
            raise TypeError(f"state['modules'] must be a dict, got {saved!r}")
        here = self._layout()
        cls = type(self).__name__
        for name in sorted(set(saved) | set(here)):
            label = name or "<root>"
            if name not in here:
                raise ValueError(
                    f"{cls}: the state preconditions module {label!r} (parameter "
                    f"shapes {saved[name]}), which this model does not have (or does "
                    "not precondition): it was saved from another model"
                )
            if name not in saved:
                raise ValueError(
                    f"{cls}: the state has no module {label!r} (parameter shapes "
                    f"{here[name]}) of this model: it was saved from another model"
                )
            if [list(s) for s in saved[name]] != here[name]:
                raise ValueError(
                    f"{cls}: module {label!r} has parameter shapes {here[name]} here "
                    f"but {saved[name]} in the state: it was saved from another model"
                )

    def state_dict(self) -> dict[str, Any]:
        """Counters, EMA buffers, the subclass's preconditioner state, and the
        parameter shapes of the preconditioned modules (checked on load)."""
        return {
            "modules": self._layout(),
            "step": self.step,
            "curvature_updates": self.curvature_updates,
            "preconditioner_updates": self.preconditioner_updates,
            "ema": dict(self._ema),
            "ema_counts": dict(self._ema_counts),
            "extra": self._extra_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (tensors are copied).

        Raises:
            ValueError / TypeError: if ``state`` does not have the layout of
                :meth:`state_dict`, or was saved from a model whose preconditioned
                modules differ (the message names the module and its shapes);
                nothing is changed then.
        """
        expected = {"modules", "step", "curvature_updates", "preconditioner_updates"}
        expected |= {"ema", "ema_counts", "extra"}
        if not isinstance(state, dict) or set(state) != expected:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"state must have the keys {sorted(expected)}, got {got}")
        self._check_layout(state["modules"])
        counters = ("step", "curvature_updates", "preconditioner_updates")
        for key in counters:
            check_int(f"state[{key!r}]", state[key], minimum=0)
        for key in ("ema", "ema_counts", "extra"):
            if not isinstance(state[key], dict):
                raise TypeError(f"state[{key!r}] must be a dict, got {state[key]!r}")
        for name, value in state["ema"].items():
            if not isinstance(value, Tensor):
                raise TypeError(
                    f"state['ema'][{name!r}] must be a tensor, got {value!r}"
                )
            check_int(
                f"state['ema_counts'][{name!r}]",
                state["ema_counts"].get(name),
                minimum=1,
            )
        self._load_extra_state(state["extra"])  # validates before it assigns
        self.step, self.curvature_updates, self.preconditioner_updates = (
            state[key] for key in counters
        )
        self._ema = {k: v.clone() for k, v in state["ema"].items()}
        self._ema_counts = {k: state["ema_counts"][k] for k in state["ema"]}
