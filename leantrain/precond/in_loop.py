r"""Preconditioning inside a loop that runs its own forward and ``loss.backward()``.

A gradient maker owns forward and backward; HF ``Trainer`` and Lightning own them
too. :class:`PreconditionedOptimizer` wraps the optimizer the trainer steps instead:
the maker's curvature is recorded by module hooks during the trainer's ordinary
forward and backward (see :mod:`leantrain.precond._loop_record`), and ``step()``
runs what the maker's ``forward_and_backward()`` runs after its pass, the maker's
``finish_step`` (the due curvature and preconditioner updates, then the
preconditioning of ``.grad``), before the wrapped optimizer's step. On the same
batches the result is the maker's.

Which makers work this way (:data:`IN_LOOP_METHODS`): those whose statistics come
from one forward and one backward of the user's loss. Makers that must run the model
themselves (second-order backward, a replay at other parameters, per-example
``vmap``) are refused with the reason (:data:`REFUSED_IN_LOOP`).
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from leantrain.precond._hooked import HookedMaker
from leantrain.precond._kron import KronFactorMaker
from leantrain.precond._loop_record import LoopRecorder, ModuleHookGuards, amp_scale
from leantrain.precond._patterns import check_trainable
from leantrain.precond.methods.shampoo import ShampooGradientMaker
from leantrain.precond.methods.soap import SoapGradientMaker
from leantrain.precond.preconditioned import PreconditionedGradientMaker
from leantrain.precond.registry import PRECOND_METHODS, make_gradient_maker

__all__ = [
    "IN_LOOP_METHODS",
    "REFUSED_IN_LOOP",
    "PreconditionedOptimizer",
    "precondition_in_loop",
]

# Registered method -> how its statistics are obtained inside the user's loop.
IN_LOOP_METHODS: dict[str, str] = {
    "kfac": "module hooks (inputs; output-gradients of the backward or of the "
    "Fisher vectors)",
    "kfac_1": "as kfac",
    "ekfac": "as kfac",
    "shampoo": "the gradient in .grad at step()",
    "shampoo_1": "as shampoo",
    "soap": "as shampoo",
    **{f"ng_{s}": "as kfac" for s in ("full", "layer", "unit", "diag")},
    "smw_ng": "as kfac (one micro-batch per step)",
    "seng": "as kfac (one micro-batch per step)",
}

# Maker class name -> why it cannot run inside someone else's loop.
REFUSED_IN_LOOP: dict[str, str] = {
    "PsgdGradientMaker": "it needs Hessian-vector products, a second-order "
    "backward through the loss's graph, which the loop's loss.backward() frees",
    "KbfgsGradientMaker": "it runs a second forward and backward on the same batch "
    "at the previous step's parameters",
    "HessianFreeGradientMaker": "its conjugate gradient needs curvature-vector "
    "products of the batch, many backward passes through the model after the loss",
    "NewtonGradientMaker": "it builds the Hessian by a second-order backward "
    "through the loss's graph",
    "DiagonalEmpiricalFisherGradientMaker": "its per-example gradients come from "
    "vmapping the model call itself; the diagonal empirical Fisher from hooks is "
    "NaturalGradientMaker(shape='diag', fisher_type='fisher_emp')",
}


def _is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _warn_soap_momentum(optimizer: torch.optim.Optimizer) -> None:
    """SOAP's direction already holds Adam's momentum and scale: SGD's momentum on
    top multiplies its step about tenfold. Measured (``GPT.default()`` and the digits
    MLP, 150 steps, two seeds; docs/notebook/2026-12-05-precond-first-try.md): around
    ``SGD(lr=0.05, momentum=0.9)`` SOAP ends at mean losses of 531 / 525 where plain
    SGD reaches 2.8 / 0.08."""
    momenta = {g.get("momentum", 0.0) for g in optimizer.param_groups}
    if isinstance(optimizer, torch.optim.SGD) and any(m > 0 for m in momenta):
        warnings.warn(
            f"SOAP wraps SGD with momentum={max(momenta)}: SOAP's direction already "
            "holds Adam's momentum and per-entry scale, so SGD's momentum multiplies "
            "its step about tenfold (it diverged so at SGD(lr=0.05, momentum=0.9)); "
            "wrap torch.optim.SGD(params, lr=1e-3..1e-2, momentum=0) for SOAP's own "
            "step (docs/precond_methods_kron.md, SOAP)",
            UserWarning,
            stacklevel=4,
        )


class PreconditionedOptimizer(torch.optim.Optimizer):
    """An optimizer that preconditions ``.grad`` with a gradient maker, then steps.

    Use it where the loop calls ``loss.backward()`` and ``optimizer.step()`` itself
    (HF ``Trainer(optimizers=(wrapped, None))``, Lightning ``configure_optimizers``,
    a plain loop). ``param_groups``, ``state`` and ``defaults`` are the wrapped
    optimizer's, so learning-rate schedulers, gradient clipping and
    ``zero_grad`` act on it. ``step(closure)`` first runs the closure (forward and
    backward, as Lightning's automatic optimization passes it). ``state_dict()`` is
    the wrapped optimizer's with the maker's curvature state under
    ``"preconditioner"``.

    Each step follows the maker's schedule (``config``): on curvature steps the
    hooks record the model calls since the last step; every call with gradients is
    one micro-batch. With gradient accumulation the losses of the micro-batches must
    sum to the mean loss over their union (what HF ``Trainer`` and Lightning's
    ``accumulate_grad_batches`` do); the statistics are then those of the union
    batch. Whatever the trainer does to ``.grad`` before ``step()`` (clipping)
    happens before the preconditioning. Under ``GradScaler.step(optimizer)`` the
    curvature is taken from unscaled quantities and skipped steps record nothing.

    A ``torch.compile``'d model works: while the optimizer is open (until
    :meth:`close` or its collection) dynamo guards compiled graphs on module hooks
    (``torch._dynamo.config.skip_nnmodule_hook_guards = False``, process-wide as the
    option is; graphs compiled before are dropped once), so a compiled call runs the
    hooks exactly when they are attached. ``close()`` puts the option back as it was
    found (:class:`~leantrain.precond._loop_record.ModuleHookGuards`).

    Activation checkpointing (``torch.utils.checkpoint.checkpoint`` with
    ``use_reentrant=False``, Hugging Face's default) is recorded once per call: the
    re-run inside the backward only rebuilds saved tensors
    (:func:`leantrain.evaluation.recomputation`). A reentrant checkpoint's re-run
    is recorded for the call whose backward runs it with ``fisher_emp`` (the
    Monte-Carlo and exact Fisher vectors need ``torch.autograd.grad``, which it
    refuses: ``RuntimeError``).

    Args:
        optimizer: the optimizer that applies the preconditioned gradient.
        maker: a preconditioned gradient maker on the module whose call returns the
            logits (see :data:`IN_LOOP_METHODS`); its ``setup_*`` calls are not
            used.
        grad_scaler: the ``torch.amp.GradScaler`` of the loop, needed only when
            the loop calls ``grad_scaler.unscale_(optimizer)`` before
            ``grad_scaler.step(optimizer)`` (gradient clipping); without that call
            the scale comes with ``grad_scaler.step``.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer`` or ``maker`` is
            not a preconditioned gradient maker.
        ValueError: the maker's method cannot run inside a loop (the message says
            why), or a parameter the maker preconditions is not in the optimizer.
        NotImplementedError: more than one process.

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from leantrain.precond import KfacGradientMaker, PreconditionedOptimizer
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
        ...                             torch.nn.Linear(8, 3))
        >>> opt = PreconditionedOptimizer(
        ...     torch.optim.SGD(model.parameters(), lr=0.1),
        ...     KfacGradientMaker(model, fisher_type="fisher_emp"))
        >>> x, t = torch.randn(16, 4), torch.randint(0, 3, (16,))
        >>> F.cross_entropy(model(x), t).backward()
        >>> opt.step(); opt.zero_grad()
        >>> opt.maker.step, sorted(opt.maker.factors)
        (1, ['0', '2'])
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        maker: PreconditionedGradientMaker,
        *,
        grad_scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "optimizer must be a torch.optim.Optimizer, got "
                f"{type(optimizer).__name__}"
            )
        if not isinstance(maker, PreconditionedGradientMaker):
            raise TypeError(
                "maker must be a preconditioned gradient maker (e.g. "
                f"KfacGradientMaker), got {type(maker).__name__}"
            )
        name = type(maker).__name__
        if name in REFUSED_IN_LOOP:
            raise ValueError(
                f"{name} cannot precondition inside a trainer's loop: "
                f"{REFUSED_IN_LOOP[name]}. Use it as a gradient maker "
                "(forward_and_backward) in your own loop, or one of: "
                f"{', '.join(IN_LOOP_METHODS)}."
            )
        if isinstance(maker, (KronFactorMaker, HookedMaker)):
            self._recorder: LoopRecorder | None = LoopRecorder(maker)
        elif isinstance(maker, (ShampooGradientMaker, SoapGradientMaker)):
            self._recorder = None  # its statistics are the gradient itself
            if isinstance(maker, SoapGradientMaker):
                _warn_soap_momentum(optimizer)
        else:
            raise ValueError(
                f"{name} is not known to work inside a trainer's loop; supported "
                "makers: KfacGradientMaker, EkfacGradientMaker, ShampooGradientMaker, "
                "SoapGradientMaker, NaturalGradientMaker, SmwNgGradientMaker, "
                "SengGradientMaker."
            )
        if grad_scaler is not None and not isinstance(
            grad_scaler, torch.amp.GradScaler
        ):
            raise TypeError(
                f"grad_scaler must be a torch.amp.GradScaler, got {grad_scaler!r}"
            )
        if maker.config.accumulation_steps != 1:
            raise ValueError(
                f"accumulation_steps={maker.config.accumulation_steps} is for the "
                "maker's forward_and_backward; in a loop every model call between "
                "two optimizer steps is a micro-batch (leave it at 1)"
            )
        if _is_distributed():
            raise NotImplementedError(
                "PreconditionedOptimizer runs on a single process: under "
                "DistributedDataParallel the recorded statistics would be one rank's "
                "(use the gradient maker's forward_and_backward, which averages them)."
            )
        owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
        for module_name, module in maker.modules():
            for pname, p in module.named_parameters(recurse=False):
                if p.requires_grad and id(p) not in owned:
                    raise ValueError(
                        f"parameter {module_name}.{pname} is preconditioned by {name} "
                        "but is not in the optimizer's param_groups"
                    )
        self.optimizer = optimizer
        self.maker = maker
        self._grad_scaler = grad_scaler
        # What torch.optim.Optimizer.__init__ sets besides the parameter groups,
        # which stay the wrapped optimizer's (see the properties below).
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._patch_step_function()
        self._warned_capturable_if_run_uncaptured = True
        self._closed = False
        self._hook_guards = ModuleHookGuards()
        weakref.finalize(self, self._hook_guards.release)
        self._arm()

    # -- the wrapped optimizer's fields -----------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer."""
        self.optimizer.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        return (
            f"PreconditionedOptimizer({type(self.maker).__name__}, {self.optimizer!r})"
        )

    def _lr_of(self, param: torch.Tensor) -> float:
        """The learning rate of the wrapped optimizer's group holding ``param``."""
        for group in self.optimizer.param_groups:
            if any(p is param for p in group["params"]):
                return float(group["lr"])
        raise ValueError("a preconditioned parameter is in no param group")

    # -- the step ------------------------------------------------------------------
    def _arm(self) -> None:
        """Record the model calls before the next step if it updates curvature."""
        if self._recorder is None or self._closed:
            return
        self._hook_guards.acquire()
        if self.maker.config.curvature_due(self.maker.step):
            self._recorder.start()
            # Monte-Carlo draws of a step the scaler skips are taken back.
            self._generator_state = self.maker.generators.get_state()
        else:
            self._recorder.stop()

    def _skip_step(self) -> None:
        """Leave no trace of this step: the recording and its Monte-Carlo draws
        are taken back, the maker's step stays, the wrapped optimizer does not
        step; record again before the next step if it is due."""
        if self._recorder is not None and self._recorder.recording:
            self._recorder.stop()
            self.maker.generators.set_state(self._generator_state)
        self._arm()

    # GradScaler.step(self) calls step() itself, with the scale and the inf check
    # as attributes (grad_scale, found_inf), instead of unscaling .grad first.
    _step_supports_amp_scaling = True

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Run ``closure`` (if given), precondition ``.grad``, step the optimizer.

        Called by ``GradScaler.step(optimizer)``: a step whose gradient is not
        finite is skipped with its recorded statistics (the maker's step does not
        advance); otherwise ``.grad`` is unscaled and the recorded output-gradients
        divided by the scale before the preconditioning.

        Returns:
            The closure's return value (``None`` without a closure).

        Raises:
            RuntimeError: a curvature step without a recorded model call,
                ``config.num_total_steps`` steps have run, or ``GradScaler.step``
                after ``GradScaler.unscale_`` without ``grad_scaler`` given here.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scale = 1.0
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None:  # GradScaler.step(self)
            if float(found_inf) > 0:  # the scaler skips this step: no trace of it
                self._skip_step()
                return loss
            grad_scale = getattr(self, "grad_scale", None)
            scale = amp_scale(self, grad_scale, self._grad_scaler)
        # The KL clip (config.kl_clip) takes each module's learning rate from the
        # wrapped optimizer; lent for the step only (the maker keeps no reference).
        self.maker._lr_of = self._lr_of
        try:
            check_trainable(self.maker)
            with torch.no_grad():
                finished = self.maker.finish_step(
                    scaled=found_inf is not None,
                    recorder=self._recorder,
                    loss_scale=scale,
                )
        except FloatingPointError:  # config.nonfinite="raise"
            self._skip_step()
            raise
        finally:
            self.maker._lr_of = None
        if not finished:  # a non-finite gradient: skipped as GradScaler would
            self._skip_step()
            return loss
        self._arm()
        self.optimizer.step()
        return loss

    # -- state -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped optimizer's state dict plus ``"preconditioner"``: the maker's."""
        state = dict(self.optimizer.state_dict())
        state["preconditioner"] = self.maker.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore a :meth:`state_dict` (optimizer and curvature).

        Raises:
            ValueError: ``state_dict`` has no ``"preconditioner"`` entry (a plain
                optimizer's state would leave the curvature at its start).
        """
        if not isinstance(state_dict, dict) or "preconditioner" not in state_dict:
            raise ValueError(
                "state_dict has no 'preconditioner' entry: it is not a "
                "PreconditionedOptimizer state (load a plain optimizer state into "
                ".optimizer instead, which keeps the curvature as it is)"
            )
        state = dict(state_dict)
        self.maker.load_state_dict(state.pop("preconditioner"))
        self.optimizer.load_state_dict(state)
        if self._recorder is not None:  # calls recorded before belong to no step
            self._recorder.stop()
        self._arm()

    def close(self) -> None:
        """Remove the hooks from the model and put dynamo's hook-guard option back
        as it was found (at the end of training; a later curvature step raises)."""
        if self._recorder is not None:
            self._recorder.stop()
        self._closed = True
        self._hook_guards.release()


def precondition_in_loop(
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    method: str = "kfac",
    *,
    config: dict[str, Any] | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
    **maker_kwargs: Any,
) -> PreconditionedOptimizer:
    """Wrap ``optimizer`` to precondition with registered ``method`` inside a loop.

    ``make_gradient_maker(method, model, config=config, **maker_kwargs)`` builds the
    maker with the method's defaults (``leantrain.precond.PRECOND_METHODS``).

    Args:
        optimizer: the optimizer the loop steps.
        model: the module whose call returns the logits.
        method: a key of :data:`IN_LOOP_METHODS`.
        config: ``PreconditioningConfig`` fields overriding the method's.
        grad_scaler: as for :class:`PreconditionedOptimizer`.
        **maker_kwargs: maker options overriding the method's (e.g.
            ``fisher_type="fisher_emp"``).

    Raises:
        ValueError: an unknown method, or one that cannot run in a loop (the
            message says why).

    Example:
        >>> import torch
        >>> from leantrain.precond import precondition_in_loop
        >>> model = torch.nn.Linear(4, 3)
        >>> opt = precondition_in_loop(
        ...     torch.optim.SGD(model.parameters(), lr=0.1), model, "shampoo")
        >>> type(opt.maker).__name__
        'ShampooGradientMaker'
    """
    if method not in IN_LOOP_METHODS:
        if method in PRECOND_METHODS:
            cls = PRECOND_METHODS[method].cls
            raise ValueError(
                f"method {method!r} cannot precondition inside a trainer's loop: "
                f"{REFUSED_IN_LOOP.get(cls, 'not supported')}. Supported: "
                f"{', '.join(IN_LOOP_METHODS)}."
            )
        raise ValueError(
            f"unknown preconditioning method {method!r}; in a loop: "
            f"{', '.join(IN_LOOP_METHODS)}"
        )
    if config is not None and not isinstance(config, dict):
        if dataclasses.is_dataclass(config):  # a PreconditioningConfig (no copies)
            config = {
                f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            }
        else:
            raise TypeError(f"config must be a dict of fields, got {config!r}")
    maker = make_gradient_maker(method, model, config=config, **maker_kwargs)
    return PreconditionedOptimizer(optimizer, maker, grad_scaler=grad_scaler)
