"""GradientMaker: the maker owns forward + backward; the user states the calls once.

A training step is *make a gradient*, then *apply it* (``optimizer.step()``). The
plain :class:`GradientMaker` makes the gradient with autograd, exactly like
``loss.backward()``; preconditioned makers (:mod:`leantrain.precond.preconditioned`)
run the same calls with curvature work around them. Because the maker must be free to
run the model its own way, the user does not call the model: ``setup_model_call``
records the call and returns a :class:`~leantrain.precond.stand_in.StandIn` for the
output, and ``setup_loss_call`` / ``setup_loss_repr`` say how the loss is computed
from it.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor, nn

from leantrain.precond import stand_in as _si
from leantrain.precond._checks import check_callable, check_module
from leantrain.precond.stand_in import StandIn

__all__ = ["GradientMaker", "unwrap_model"]


def compiled_original(model_or_fn: Any) -> Any:
    """The module/function ``torch.compile`` wrapped; None if not compiled."""
    if isinstance(model_or_fn, torch._dynamo.eval_frame.OptimizedModule):
        return model_or_fn._orig_mod
    return getattr(model_or_fn, "_torchdynamo_orig_callable", None)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside ``DistributedDataParallel`` / ``DataParallel`` wrappers."""
    wrappers = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    while isinstance(model, wrappers):
        model = model.module
    return model


class GradientMaker:
    """Makes the gradient of a recorded loss with plain autograd.

    ``forward_and_backward()`` runs the model call, evaluates the loss and calls
    ``loss.backward()``: ``.grad`` is *accumulated* as with ``loss.backward()``, so
    zero it between steps as usual. Preconditioned makers share this interface.

    Args:
        model: the module whose parameters receive gradients (it may be wrapped in
            ``DistributedDataParallel``).

    Raises:
        TypeError: if ``model`` is not an ``nn.Module``.

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from leantrain.precond import GradientMaker
        >>> model = torch.nn.Linear(4, 3)
        >>> x, t = torch.randn(8, 4), torch.randint(0, 3, (8,))
        >>> gm = GradientMaker(model)
        >>> y = gm.setup_model_call(model, x)  # a stand-in, the model has not run
        >>> gm.setup_loss_call(F.cross_entropy, y, t)
        >>> output, loss = gm.forward_and_backward()
        >>> output.shape, model.weight.grad.shape
        (torch.Size([8, 3]), torch.Size([3, 4]))
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = check_module("model", model)
        self._origin: _si.Origin | None = None
        self._model_call: tuple[Any, tuple, dict] | None = None
        self._loss_call: tuple[Any, tuple, dict] | None = None
        self._calls = 0  # numbers the model calls, for error messages

    # -- setup -------------------------------------------------------------------
    def setup_model_call(
        self, model_or_fn: Any, /, *args: Any, **kwargs: Any
    ) -> StandIn:
        """Record ``model_or_fn(*args, **kwargs)``; return a stand-in for its output.

        Any previously set loss is cleared: it referred to the previous call's
        stand-in, so set the loss again after this.

        Raises:
            TypeError: if ``model_or_fn`` is not callable.
            ValueError: if a stand-in appears in the arguments (the model call must
                not depend on its own output), or ``model_or_fn`` is the module inside
                the DDP wrapper given to the maker.
        """
        check_callable("model_or_fn", model_or_fn)
        inner = unwrap_model(self.model)
        if model_or_fn is inner and inner is not self.model:
            raise ValueError(
                "setup_model_call: the model is wrapped (e.g. DistributedDataParallel) "
                "but the call goes to the inner module, which skips the wrapper's "
                "gradient synchronisation; pass the wrapper itself."
            )
        if _si.contains_stand_in((args, kwargs)):
            raise ValueError(
                "setup_model_call: the arguments contain a stand-in (a recorded model "
                "output); pass real tensors to the model call."
            )
        self._calls += 1
        self._origin = _si.Origin(f"setup_model_call #{self._calls}")
        self._model_call = (self._eager_if_compiled(model_or_fn), args, kwargs)
        self._loss_call = None
        return _si.root(self._origin)

    # Whether the maker may call a torch.compile'd module as compiled. Makers that read
    # activations or output-gradients through module hooks, or take Hessian-vector
    # products through the call, cannot: hooks do not fire inside a compiled graph.
    runs_compiled_calls: bool = True

    def _eager_if_compiled(self, model_or_fn: Any) -> Any:
        """``model_or_fn``, or the original module/function of a compiled one."""
        original = compiled_original(model_or_fn)
        if original is None or self.runs_compiled_calls:
            return model_or_fn
        if not getattr(self, "_warned_compiled", False):
            self._warned_compiled = True
            warnings.warn(
                f"{type(self).__name__}: the model call goes to a torch.compile'd "
                "module or function; module hooks do not fire inside a compiled "
                "graph, so this maker calls the original one eagerly (the same "
                "results as an uncompiled model, without the compile speed-up). "
                "GradientMaker and ShampooGradientMaker run compiled calls as given.",
                stacklevel=3,
            )
        return original

    def setup_loss_call(self, fn: Any, /, *args: Any, **kwargs: Any) -> None:
        """The loss is ``fn(*args, **kwargs)`` with stand-ins replaced by real values.

        Stand-ins may appear anywhere in the arguments, nested in lists, tuples,
        dicts and sets. ``fn`` must return a scalar tensor.

        Raises:
            RuntimeError: if ``setup_model_call`` was not called first.
            TypeError: if ``fn`` is not callable.
            ValueError: if no argument holds a stand-in of the current model call
                (the loss would not see the model output), or one comes from another
                model call.
        """
        origin = self._require_model_call("setup_loss_call")
        check_callable("fn", fn)
        if not _si.contains_stand_in((args, kwargs)):
            raise ValueError(
                "setup_loss_call: no argument is a stand-in, so the loss would not "
                "depend on the model output; pass the stand-in returned by "
                "setup_model_call (or an expression on it, e.g. y.logits) as an "
                "argument."
            )
        _si.check_origin((args, kwargs), origin, "setup_loss_call")
        self._loss_call = (fn, args, kwargs)

    def setup_loss_repr(self, stand_in: StandIn) -> None:
        """The loss is the recorded expression ``stand_in`` (e.g. ``y.loss``, ``y[1]``).

        Raises:
            RuntimeError: if ``setup_model_call`` was not called first.
            TypeError: if ``stand_in`` is not a stand-in.
            ValueError: if it comes from another model call.
        """
        origin = self._require_model_call("setup_loss_repr")
        if not isinstance(stand_in, StandIn):
            raise TypeError(
                "setup_loss_repr expects a stand-in expression such as y.loss or "
                f"y[1], got {type(stand_in).__name__}; use setup_loss_call(fn, ...) "
                "to name a loss function instead."
            )
        _si.check_origin(stand_in, origin, "setup_loss_repr")
        self._loss_call = (None, (stand_in,), {})

    def _require_model_call(self, where: str) -> _si.Origin:
        if self._origin is None:
            raise RuntimeError(f"{where}: call setup_model_call(model, *inputs) first.")
        return self._origin

    # -- running -----------------------------------------------------------------
    def forward_and_backward(
        self, *, grad_scaler: torch.amp.GradScaler | None = None
    ) -> tuple[Any, Tensor]:
        """Run the model call and the loss, then ``loss.backward()``.

        Args:
            grad_scaler: back-propagate ``grad_scaler.scale(loss)`` (mixed precision
                loss scaling); ``.grad`` then holds the scaled gradient, for
                ``grad_scaler.step(optimizer)`` to unscale.

        Returns:
            ``(output, loss)``: the real model output and the (unscaled) loss.

        Raises:
            RuntimeError: if the model call or the loss has not been set up, or the
                loss does not require grad.
            TypeError: if the loss is not a tensor (or is a stand-in).
            ValueError: if the loss is not a scalar.
        """
        self._check_ready()
        self._scaling(grad_scaler)
        try:
            output, loss = self._forward_backward()
        finally:
            self._scaling(None)
        return output, unscaled(loss, grad_scaler)

    # The GradScaler of the running forward_and_backward(grad_scaler=...) and its
    # scale: the loss is back-propagated as grad_scaler.scale(loss).
    _grad_scaler: Any = None
    _loss_scale: float = 1.0

    def _scaling(self, grad_scaler: Any) -> None:
        """Scale the losses of the following passes by ``grad_scaler`` (or not)."""
        self._loss_scale = loss_scale(grad_scaler)
        enabled = grad_scaler is not None and grad_scaler.is_enabled()
        self._grad_scaler = grad_scaler if enabled else None

    def _check_ready(self) -> None:
        if self._model_call is None:
            raise RuntimeError(
                "forward_and_backward: nothing to run; call setup_model_call(model, "
                "*inputs) and then setup_loss_call(fn, ...) or setup_loss_repr(expr)."
            )
        if self._loss_call is None:
            raise RuntimeError(
                "forward_and_backward: no loss; after setup_model_call, call "
                "setup_loss_call(fn, ...) or setup_loss_repr(expr) (setup_model_call "
                "clears the previous loss)."
            )

    def _forward_backward(self) -> tuple[Any, Tensor]:
        """Forward, loss and backward with plain autograd (accumulates ``.grad``)."""
        output = self._call_model()
        loss = self._loss_from_output(output)
        loss.backward()
        return output, loss

    def _call_model(self, fn: Any = None, leaf: Any = None) -> Any:
        """Run the recorded model call.

        Args:
            fn: call this instead of the recorded callable (e.g. the unwrapped model).
            leaf: applied to every argument leaf (per-example makers swap batched
                tensors for one example).
        """
        assert self._model_call is not None  # internal: _check_ready ran
        model_or_fn, args, kwargs = self._model_call
        if leaf is not None:
            args, kwargs = _si.replay((args, kwargs), None, leaf=leaf)
        return (model_or_fn if fn is None else fn)(*args, **kwargs)

    def _loss_from_output(self, output: Any, leaf: Any = None) -> Tensor:
        """Replay the loss on the real ``output`` and check it is a scalar tensor.

        ``leaf`` is applied to every argument leaf, as in :meth:`_call_model`.
        """
        assert self._loss_call is not None  # internal: _check_ready ran
        fn, args, kwargs = self._loss_call
        args, kwargs = _si.replay((args, kwargs), output, leaf=leaf)
        loss = check_loss(args[0] if fn is None else fn(*args, **kwargs))
        return loss if self._grad_scaler is None else self._grad_scaler.scale(loss)

    @property
    def loss_call_arguments(self) -> tuple[tuple, dict]:
        """The recorded ``(args, kwargs)`` of the loss call (stand-ins included)."""
        self._check_ready()
        assert self._loss_call is not None
        return self._loss_call[1], self._loss_call[2]

    @property
    def model_call(self) -> tuple[Any, tuple, dict]:
        """The recorded ``(model_or_fn, args, kwargs)`` of the model call."""
        self._check_ready()
        assert self._model_call is not None
        return self._model_call


def loss_scale(grad_scaler: Any) -> float:
    """The current scale of ``grad_scaler`` (1.0 for ``None`` or a disabled one).

    Raises:
        TypeError: ``grad_scaler`` is not a ``torch.amp.GradScaler``.
    """
    if grad_scaler is None:
        return 1.0
    if not isinstance(grad_scaler, torch.amp.GradScaler):
        raise TypeError(
            f"grad_scaler must be a torch.amp.GradScaler, got {grad_scaler!r}"
        )
    return float(grad_scaler.get_scale()) if grad_scaler.is_enabled() else 1.0


def unscaled(loss: Tensor, grad_scaler: Any) -> Tensor:
    """The loss a scaled pass returns, divided by the scale again."""
    scale = loss_scale(grad_scaler)
    return loss if scale == 1.0 else loss.detach() / scale


def check_loss(loss: Any) -> Tensor:
    """Return ``loss`` if it is a one-element float tensor that requires grad.

    Raises:
        TypeError: a stand-in, a non-tensor or a non-float tensor.
        ValueError: more than one element.
        RuntimeError: the loss does not require grad.
    """
    if _si.contains_stand_in(loss):
        raise TypeError(
            "the loss function returned a stand-in instead of a tensor: it used a "
            "stand-in it did not receive as an argument (e.g. a closure over y). Pass "
            "stand-ins as arguments of setup_loss_call, or use setup_loss_repr(expr)."
        )
    if not isinstance(loss, Tensor):
        raise TypeError(
            f"the loss must be a scalar torch.Tensor, got {type(loss).__name__}; make "
            "the loss function return the loss tensor (not a tuple, dict or float)."
        )
    if loss.numel() != 1:
        raise ValueError(
            f"the loss must be a scalar tensor, got shape {tuple(loss.shape)}; reduce "
            "it (e.g. .mean() or reduction='mean')."
        )
    if not loss.requires_grad:
        raise RuntimeError(
            "the loss does not require grad: was the model called under "
            "torch.no_grad(), or are all parameters frozen (requires_grad=False)?"
        )
    if not torch.is_floating_point(loss) and not loss.is_complex():
        raise TypeError(f"the loss must be a floating-point tensor, got {loss.dtype}")
    return loss
