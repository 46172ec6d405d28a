"""Module hooks that collect per-module curvature statistics.

:class:`CurvatureCollector` is the reusable machinery behind
:func:`~leantrain.precond.curv.curvature`, meant to be driven from inside a training
step as well::

    collector = CurvatureCollector(model, shapes=("kron",))
    with collector:                                   # registers the hooks
        output = model(inputs)                        # forward hooks save inputs
        loss = loss_fn(output, targets)
        loss.backward()                               # ordinary gradient, not collected
        collector.accumulate(output, vectors)         # one backward per vector
    stats = collector.statistics()                    # per-module tensors
    collector.reset()                                 # before the next forward

The forward hook of each tracked module records its input features and registers a
gradient hook on its output tensor, so every call of a module gets exactly its own
output-gradient (a module called twice in one forward sees its calls as extra
positions). Gradient hooks only record while :meth:`CurvatureCollector.backward_pass`
runs, so the user's own ``loss.backward()`` costs nothing extra. Module hooks do not
run under ``torch.compile``: run the curvature forward eagerly.

Evaluations marked :func:`leantrain.evaluation.auxiliary` (a layer-parallel solver's
relaxation sweeps, residuals and adjoint re-evaluations) are not recorded, and neither
are the gradients that reach tensors in them, so every layer is seen once, at the
point its gradient is taken. After a :func:`leantrain.evaluation.detached` evaluation
(a graph of its own, joined to the caller's by the solver's backward) the
output-gradients are taken from the tensor hooks during a backward to the parameters.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from functools import partial

import torch
from torch import nn

from leantrain import evaluation
from leantrain.precond._denormal import autocast_off

from ._broadcast import ForwardShapes, broadcast_embedding
from ._mha import mha_forward
from ._recompute import records_evaluation
from ._selection import build_ops, resolve_ignored
from ._tied import TiedOp

__all__ = [
    "SHAPES",
    "CurvatureCollector",
    "check_shape",
    "resolve_ignored",
]

SHAPES = ("full", "layer", "kron", "unit", "diag")
_FULL_CHUNK = 1 << 22


def check_shape(shape: str) -> str:
    """Validate a representation name."""
    if shape not in SHAPES:
        raise ValueError(
            f"Invalid curvature shape {shape!r}; allowed: {', '.join(SHAPES)}"
        )
    return shape


class CurvatureCollector:
    """Collect per-module curvature statistics from forward and gradient hooks.

    Args:
        model: the network; every module owning trainable parameters must be
            supported (see :mod:`.modules`) or covered by ``ignore_modules``.
        shapes: representations to accumulate, any of ``"full"``, ``"layer"``,
            ``"kron"``, ``"unit"``, ``"diag"``.
        ignore_modules: instances, classes or names of modules to skip (subtrees).
        allow_batch_coupling: accept BatchNorm in training mode, treating its batch
            statistics as constants (not exact; off for :func:`curvature`).
        check_gradients: on the first pass after a forward, compare the sum of the
            per-example gradients with autograd's parameter gradients and raise if a
            module's parameters also receive gradient from outside its forward.

    Example:
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> collector = CurvatureCollector(model, shapes=("kron", "diag"))
        >>> with collector:
        ...     out = model(torch.randn(5, 3))
        ...     collector.accumulate(out, [torch.ones(5, 2)])
        >>> stats = collector.statistics()
        >>> stats["0"]["A"][0].shape, stats["0"]["diag"].shape
        (torch.Size([4, 4]), torch.Size([4, 4]))
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        shapes: Iterable[str] = ("kron",),
        ignore_modules: Iterable = (),
        allow_batch_coupling: bool = False,
        check_gradients: bool = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        self.shapes = tuple(check_shape(s) for s in shapes)
        if not self.shapes:
            raise ValueError("shapes must name at least one representation")
        self.model = model
        ignored = resolve_ignored(model, ignore_modules)
        self.ops = build_ops(model, ignored, allow_batch_coupling=allow_batch_coupling)
        self.check_gradients = check_gradients
        self.params = [p for p in model.parameters() if p.requires_grad]
        offsets, start = {}, 0
        for p in self.params:
            offsets[id(p)] = start
            start += p.numel()
        self.numel = start
        self.index = {
            name: torch.cat(
                [
                    torch.arange(p.numel(), device=p.device) + offsets[id(p)]
                    for p in op.params
                ]
            )
            for name, op in self.ops.items()
        }
        tracked = set(self.ops)
        self._mha = [
            name
            for name, m in model.named_modules()
            if isinstance(m, nn.MultiheadAttention)
            and (name in tracked or f"{name}.out_proj" in tracked)
        ]
        self._handles: list = []
        self._hooked: set[int] = set()  # ids of this model's modules
        self._in_pass = False
        # Set by a recorder whose statistics come from the user's own backward:
        # returns the call records a reentrant checkpoint's re-run belongs to.
        self.reentrant_calls = None
        self.reset()

    # -- lifecycle ---------------------------------------------------------------
    def attach(self) -> CurvatureCollector:
        """Register the hooks (idempotent)."""
        if self._handles:
            return self
        modules = dict(self.model.named_modules())
        self._hooked = {id(m) for m in modules.values()}
        for name in self._mha:
            hook = eager(partial(self._on_mha_forward, name))
            self._handles.append(
                modules[name].register_forward_hook(hook, with_kwargs=True)
            )
        for name, op in self.ops.items():
            if name in self._mha:
                continue
            hook = eager(partial(self._on_forward, name))
            for module in op.hooked_modules():
                self._handles.append(
                    module.register_forward_hook(hook, with_kwargs=True)
                )
        return self

    def detach(self) -> None:
        """Remove every hook; accumulated statistics are kept."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> CurvatureCollector:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def reset(self) -> None:
        """Forget the recorded forward and every accumulated statistic."""
        self._calls: dict[str, list] = {name: [] for name in self.ops}
        # (name, call, slot, tensor, version) of every hooked output tensor.
        self._outputs: list[tuple] = []
        self._acc: dict[str, dict] = {name: {} for name in self.ops}
        self._full: torch.Tensor | None = None
        # The batch and sequence lengths of this forward: what an embedding call
        # on ids shared by the batch is expanded to (see _broadcast.py).
        self._shapes = ForwardShapes()
        self.n_passes = 0
        self._checked = False
        self._detached = False  # a call was recorded in a detached evaluation

    def next_call(self) -> None:
        """Record the following model call afresh (a user's loop: one call per
        micro-batch), keeping the statistics; the gradient hooks of the calls before
        keep writing into their own call records."""
        self._calls = {name: [] for name in self.ops}
        self._outputs = []
        self._shapes = ForwardShapes()

    # -- hooks -------------------------------------------------------------------
    @autocast_off()
    def _record(
        self, name: str, args: tuple, output: object, module: nn.Module | None = None
    ) -> None:
        calls = self._calls
        if self.reentrant_calls is not None and _reentrant_rerun():
            # A reentrant checkpoint's re-run, inside the backward of a recorded
            # call (a user's loop): the call that owns that backward takes it.
            calls = self.reentrant_calls()
        elif not records_evaluation(name):
            return
        if evaluation.in_detached():
            # autograd.grad from the output cannot ask for these tensors: their
            # gradient arrives only through the hooks (see backward_pass).
            self._detached = True
        op = self.ops[name]
        if module is None:
            feats, tensors = op.record(args, output)
        else:
            feats, tensors = op.record_module(module, args, output)
        call = (feats, [None] * len(tensors))
        calls[name].append(call)
        for slot, tensor in enumerate(tensors):
            if tensor.requires_grad:
                tensor.register_hook(partial(self._on_grad, name, call, slot))
                if calls is self._calls:
                    self._outputs.append((name, call, slot, tensor, tensor._version))

    def _on_forward(self, name, module, args, kwargs, output):
        if not args:  # input passed by keyword, e.g. linear(input=x)
            args = tuple(kwargs.values())
        if not torch.is_grad_enabled() or id(module) not in self._hooked:
            return None  # no gradient, or a deep copy of the model (its hooks too)
        expanded = broadcast_embedding(module, args, output, self._shapes)
        if expanded is not None:
            args, output = expanded
        else:
            self._shapes.see(module, args)
        self._record(name, args, output, module)
        return output if expanded is not None else None

    def _on_mha_forward(self, name, module, args, kwargs, output):
        if evaluation.is_auxiliary() or id(module) not in self._hooked:
            return None  # the module's own output: nothing recorded
        result, taps = mha_forward(module, *args, **kwargs)
        if name in self.ops:
            self._record(name, (), taps)
        return result  # replaces the module's output: the graph now runs through taps

    @autocast_off()
    def _on_grad(self, name: str, call: tuple, slot: int, grad: torch.Tensor) -> None:
        if self._in_pass and not evaluation.is_auxiliary():
            call[1][slot] = self.ops[name].grad_feature(slot, grad)

    # -- passes ------------------------------------------------------------------
    def accumulate(self, output: torch.Tensor, vectors: Iterable[torch.Tensor]) -> None:
        """Run :meth:`backward_pass` for every vector."""
        for vector in vectors:
            self.backward_pass(output, vector)

    @autocast_off()
    def backward_pass(self, output: torch.Tensor, vector: torch.Tensor) -> None:
        """Back-propagate ``vector`` from ``output`` and accumulate the statistics.

        The graph is retained, so several passes may follow one forward; parameter
        ``.grad`` fields are not touched.
        """
        if not self.ops:  # nothing tracked: the curvature is zero
            self.n_passes += 1
            return
        if not isinstance(output, torch.Tensor) or not output.requires_grad:
            raise ValueError("output must be a tensor attached to the autograd graph")
        if tuple(vector.shape) != tuple(output.shape):
            raise ValueError(
                f"vector shape {tuple(vector.shape)} != output shape "
                f"{tuple(output.shape)}"
            )
        for calls in self._calls.values():
            for _, grads in calls:
                grads[:] = [None] * len(grads)
        tracked = [p for op in self.ops.values() for p in op.params]
        check = self.check_gradients and not self._checked
        fast = not check and not self._detached
        if fast and all(t._version == v for *_, t, v in self._outputs):
            self._output_gradients(output, vector)
            grads: tuple = ()
        else:
            self._in_pass = True
            try:
                grads = torch.autograd.grad(
                    output,
                    tracked,
                    grad_outputs=vector.to(output.dtype),
                    retain_graph=True,
                    allow_unused=True,
                )
            finally:
                self._in_pass = False
        data = {name: self.ops[name].combine(self._calls[name]) for name in self.ops}
        batch = output.shape[0]
        for name, sites in data.items():
            if sites and self.ops[name].n_examples(sites) != batch:
                raise ValueError(
                    f"module {name!r} saw dim 0 of size "
                    f"{self.ops[name].n_examples(sites)} but the batch has {batch} "
                    "examples; every tracked module must see the batch in dim 0 "
                    "(expand broadcast inputs, e.g. positions, to (N, T))"
                )
        if check:
            self._check(data, tracked, grads)
            self._checked = True
        self._update(data)
        self.n_passes += 1

    def _output_gradients(self, output: torch.Tensor, vector: torch.Tensor) -> None:
        """Back-propagate ``vector`` to the hooked module outputs only.

        Asking autograd for the output-gradients instead of the parameter
        gradients skips every weight-gradient product (about half the backward);
        valid while no hooked output was modified in place after its hook (then its
        gradient would be the modified tensor's), which the caller checks.
        """
        if not self._outputs:
            return
        grads = torch.autograd.grad(
            output,
            [t for _, _, _, t, _ in self._outputs],
            grad_outputs=vector.to(output.dtype),
            retain_graph=True,
            allow_unused=True,
        )
        for (name, call, slot, _, _), grad in zip(self._outputs, grads, strict=True):
            if grad is not None:
                call[1][slot] = self.ops[name].grad_feature(slot, grad)

    def _check(self, data: dict, tracked: list, grads: tuple) -> None:
        by_param = {id(p): g for p, g in zip(tracked, grads, strict=True)}
        pairs = []
        for name, op in self.ops.items():
            auto = torch.cat(
                [
                    (
                        by_param[id(p)]
                        if by_param[id(p)] is not None
                        else torch.zeros_like(p)
                    )
                    .to_dense()
                    .reshape(-1)
                    for p in op.params
                ]
            )
            ours = torch.zeros_like(auto)
            if data[name]:
                flat_index = op.canon_index.reshape(-1)
                ours[flat_index] = op.summed(data[name]).reshape(-1).to(ours.dtype)
            pairs.append((name, auto, ours))
        scale = max(float(a.norm()) for _, a, _ in pairs) if pairs else 0.0
        for name, auto, ours in pairs:
            if float((auto - ours).norm()) > 1e-4 * scale + 1e-30:
                raise ValueError(
                    f"module {name!r}: its parameters receive gradient that its "
                    "forward hooks did not see (used outside the module's forward, "
                    "e.g. functionally or tied elsewhere); list it in ignore_modules"
                )

    def _wants_kron(self, name: str) -> bool:
        """Whether module ``name``'s Kronecker factors are formed (a subclass may
        keep what they are made of instead)."""
        return True

    def _update(self, data: dict) -> None:
        for name, op in self.ops.items():
            sites = data[name]
            if not sites:
                continue
            acc = self._acc[name]
            if "diag" in self.shapes:
                _add(acc, "diag", op.diag(sites))
            if "unit" in self.shapes or ("kron" in self.shapes and not op.kron_capable):
                _add(acc, "unit", op.unit(sites))
            if "kron" in self.shapes and op.kron_capable and self._wants_kron(name):
                for i, b in enumerate(op.kron_b(sites)):
                    _add(acc, f"B{i}", b)
            if "layer" in self.shapes:
                for sl in op.chunks(sites):
                    g = op.per_example_flat(sites, sl)
                    _add(acc, "layer", g.T @ g)
        if "full" in self.shapes:
            self._update_full(data)

    def _update_full(self, data: dict) -> None:
        live = {n: d for n, d in data.items() if d}
        if not live:
            return
        sizes = {self.ops[n].n_examples(d) for n, d in live.items()}
        if len(sizes) != 1:
            raise ValueError(f"modules saw different batch sizes {sorted(sizes)}")
        n = sizes.pop()
        step = max(1, _FULL_CHUNK // max(1, self.numel))
        for start in range(0, n, step):
            sl = slice(start, min(n, start + step))
            g = None
            for name, sites in live.items():
                part = self.ops[name].per_example_flat(sites, sl)
                if g is None:
                    g = part.new_zeros(part.shape[0], self.numel)
                g[:, self.index[name]] = part
            if self._full is None:
                self._full = g.new_zeros(self.numel, self.numel)
            self._full += g.T @ g

    # -- results -----------------------------------------------------------------
    @autocast_off()
    def statistics(self) -> dict[str, dict]:
        """Per-module accumulated tensors.

        Keys per module name: ``"diag"`` (canonical ``(R, U)``), ``"unit"``
        (``(R, U, U)``), ``"layer"`` (``(P_m, P_m)``), ``"A"`` / ``"B"`` (lists, one per
        site, for kron-capable modules) and ``"rows"`` (canonical rows per site).
        A key is missing when the module saw no gradient. The full matrix is
        :attr:`full`.
        """
        out: dict[str, dict] = {}
        for name, op in self.ops.items():
            stats = dict(self._acc[name])
            calls = self._calls[name]
            kron = "kron" in self.shapes and op.kron_capable and calls
            if kron and self._wants_kron(name):
                stats["A"] = op.kron_a(calls)
                stats["rows"] = op.site_rows(calls)
                stats["B"] = [stats.pop(f"B{i}", None) for i in range(len(stats["A"]))]
                if isinstance(op, TiedOp):
                    stats = op.finish_kron(stats)
            out[name] = stats
        return out

    @property
    def full(self) -> torch.Tensor | None:
        """The accumulated ``(P, P)`` matrix over ``self.params`` ("full" shape)."""
        return self._full


def eager(hook):
    """``hook``, run eagerly when a ``torch.compile``'d model calls it: dynamo then
    breaks the graph around it instead of tracing the collector's Python (only once
    dynamo is loaded, so a process that compiles nothing does not import it)."""
    dynamo = sys.modules.get("torch._dynamo")
    return hook if dynamo is None else dynamo.disable(hook)


def _reentrant_rerun() -> bool:
    return (
        torch.is_grad_enabled()
        and not evaluation.is_auxiliary()
        and evaluation.recomputation() == "reentrant"
    )


def _add(acc: dict, key: str, value: torch.Tensor) -> None:
    acc[key] = value if key not in acc else acc[key] + value
