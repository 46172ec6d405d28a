"""The recorded stand-in for a model output.

``GradientMaker.setup_model_call`` cannot run the model when it is called: the maker
owns the forward pass and may run it differently (with module hooks, per example,
...). It returns a :class:`StandIn` instead. Every attribute access, indexing,
call, arithmetic operator and ``torch`` function applied to a stand-in is recorded
as a new stand-in; :func:`replay` evaluates the recording on the real output.

Anything that needs a real value *now* (``bool``, ``len``, iteration, ``float``,
``int``, ``in``, assignment into the stand-in) raises ``TypeError`` with a message
that says how to write the expression instead.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

__all__ = [
    "Origin",
    "StandIn",
    "check_origin",
    "contains_stand_in",
    "describe",
    "leaves",
    "replay",
    "root",
]


class Origin:
    """Identity token of one ``setup_model_call``: its stand-ins share it."""

    __slots__ = ("label",)

    def __init__(self, label: str) -> None:
        self.label = label


def _need_real(what: str) -> TypeError:
    return TypeError(
        f"{what} needs the real model output, but this is a stand-in recorded by "
        "setup_model_call; the model has not run yet. Do this inside the loss "
        "function passed to setup_loss_call (it receives real values), or write "
        "the expression with indexing/attributes/calls only (e.g. y[0], y.logits, "
        "y.view(-1, y.size(-1)))."
    )


class StandIn:
    """A recorded expression on the output of a model call that has not run yet.

    Created by :meth:`GradientMaker.setup_model_call`; do not construct it directly.
    Supported and recorded: ``y.attr``, ``y[key]``, ``y(...)``, arithmetic and
    comparison operators (``y.loss + 0.1 * y.aux``), and ``torch`` functions taking a
    stand-in (``F.cross_entropy(y, t)``, via ``__torch_function__``). Stand-ins may
    appear inside the arguments of recorded calls, nested in lists, tuples and dicts.

    Example:
        >>> import torch
        >>> from leantrain.precond import GradientMaker
        >>> model = torch.nn.Linear(3, 4)
        >>> gm = GradientMaker(model)
        >>> y = gm.setup_model_call(model, torch.randn(2, 3))
        >>> y.view(-1, y.size(-1))[0]
        <stand-in: y.view(-1, y.size(-1))[0]>
    """

    __slots__ = ("_si_origin", "_si_op", "_si_parent", "_si_payload")

    def __init__(self, origin: Origin, op: str, parent: Any, payload: Any) -> None:
        object.__setattr__(self, "_si_origin", origin)
        object.__setattr__(
            self, "_si_op", op
        )  # "output" | "attr" | "item" | "call" | "apply"
        object.__setattr__(self, "_si_parent", parent)
        object.__setattr__(self, "_si_payload", payload)

    # -- recording -------------------------------------------------------------
    def _derive(self, op: str, parent: Any, payload: Any) -> StandIn:
        _check_same_origin(self._si_origin, (parent, payload))
        return StandIn(self._si_origin, op, parent, payload)

    def __getattr__(self, name: str) -> StandIn:
        # Dunder probes (copy, pickle, numpy, IPython) must not get a stand-in back,
        # or they would treat it as implementing their protocol.
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return self._derive("attr", self, name)

    def __getitem__(self, key: Any) -> StandIn:
        return self._derive("item", self, key)

    def __call__(self, *args: Any, **kwargs: Any) -> StandIn:
        return self._derive("call", self, (args, kwargs))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = {} if kwargs is None else kwargs
        origin = _find_origin((args, kwargs))
        _check_same_origin(origin, (args, kwargs))
        return StandIn(origin, "apply", func, (tuple(args), dict(kwargs)))

    # -- what needs a real value ------------------------------------------------
    def __bool__(self) -> bool:
        raise _need_real("bool(stand-in) (an `if`, `and`, `or`, `not` or assert)")

    def __len__(self) -> int:
        raise _need_real("len(stand-in)")

    def __iter__(self):
        raise _need_real("Iterating over or unpacking a stand-in (use y[0], y[1])")

    def __contains__(self, item: Any) -> bool:
        raise _need_real("`in` on a stand-in")

    def __float__(self) -> float:
        raise _need_real("float(stand-in)")

    def __int__(self) -> int:
        raise _need_real("int(stand-in)")

    def __index__(self) -> int:
        raise _need_real("Using a stand-in as an index or size")

    def __complex__(self) -> complex:
        raise _need_real("complex(stand-in)")

    def __setattr__(self, name: str, value: Any) -> None:
        raise _need_real(f"Setting attribute {name!r} on a stand-in")

    def __setitem__(self, key: Any, value: Any) -> None:
        raise _need_real("Item assignment on a stand-in")

    def __delitem__(self, key: Any) -> None:
        raise _need_real("Item deletion on a stand-in")

    def __reduce_ex__(self, protocol: int):
        raise _need_real("Pickling or copying a stand-in")

    __hash__ = object.__hash__  # identity hashing; __eq__ below records

    def __repr__(self) -> str:
        return f"<stand-in: {describe(self)}>"


def _binary(fn: Callable[[Any, Any], Any], reflected: bool = False):
    def method(self: StandIn, other: Any) -> StandIn:
        args = (other, self) if reflected else (self, other)
        return self._derive("apply", fn, (args, {}))

    return method


def _unary(fn: Callable[[Any], Any]):
    def method(self: StandIn) -> StandIn:
        return self._derive("apply", fn, ((self,), {}))

    return method


# Arithmetic is recorded like any call: `y.loss + 0.1 * y.aux` replays on the real
# output. In-place operators (+=) fall back to these and rebind the name.
for _name, _fn in [
    ("add", operator.add),
    ("sub", operator.sub),
    ("mul", operator.mul),
    ("truediv", operator.truediv),
    ("floordiv", operator.floordiv),
    ("mod", operator.mod),
    ("pow", operator.pow),
    ("matmul", operator.matmul),
]:
    setattr(StandIn, f"__{_name}__", _binary(_fn))
    setattr(StandIn, f"__r{_name}__", _binary(_fn, reflected=True))
for _name, _fn in [
    ("lt", operator.lt),
    ("le", operator.le),
    ("gt", operator.gt),
    ("ge", operator.ge),
    ("eq", operator.eq),
    ("ne", operator.ne),
]:
    setattr(StandIn, f"__{_name}__", _binary(_fn))
for _name, _fn in [("neg", operator.neg), ("pos", operator.pos), ("abs", abs)]:
    setattr(StandIn, f"__{_name}__", _unary(_fn))


def _walk(obj: Any):
    """Yield every stand-in inside ``obj`` (lists, tuples, dicts, sets, nested)."""
    if isinstance(obj, StandIn):
        yield obj
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for item in obj:
            yield from _walk(item)
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _walk(key)
            yield from _walk(value)


def contains_stand_in(obj: Any) -> bool:
    """Whether ``obj`` is or holds (nested in lists/tuples/dicts/sets) a stand-in."""
    return next(_walk(obj), None) is not None


def _find_origin(obj: Any) -> Origin:
    first = next(_walk(obj), None)
    if first is None:  # pragma: no cover - torch only dispatches when one is present
        raise TypeError("no stand-in among the arguments")
    return first._si_origin


def _check_same_origin(origin: Origin, obj: Any) -> None:
    for s in _walk(obj):
        if s._si_origin is not origin:
            raise ValueError(
                f"stand-ins from different model calls are mixed ({describe(s)} comes "
                f"from {s._si_origin.label}, another from {origin.label}); use the "
                "stand-in returned by the latest setup_model_call only."
            )


def check_origin(obj: Any, origin: Origin, where: str) -> None:
    """Raise ``ValueError`` if a stand-in in ``obj`` is not from ``origin``."""
    for s in _walk(obj):
        if s._si_origin is not origin:
            raise ValueError(
                f"{where}: the stand-in {describe(s)} comes from {s._si_origin.label}, "
                f"not from the current model call ({origin.label}); pass the stand-in "
                "returned by the latest setup_model_call of this gradient maker."
            )


def root(origin: Origin) -> StandIn:
    """A new root stand-in: the model output itself."""
    return StandIn(origin, "output", None, None)


def leaves(obj: Any):
    """Yield the non-container values in ``obj``, inside recorded stand-ins too.

    Per-example makers use it to find the batched tensors a loss refers to, e.g. the
    targets ``t`` in ``setup_loss_repr(F.cross_entropy(y, t))``.
    """
    if isinstance(obj, StandIn):
        op, parent, payload = obj._si_op, obj._si_parent, obj._si_payload
        if op in ("attr", "item", "call"):
            yield from leaves(parent)
        if op in ("item", "call", "apply"):
            yield from leaves(payload)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for item in obj:
            yield from leaves(item)
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from leaves(key)
            yield from leaves(value)
    else:
        yield obj


def replay(
    obj: Any,
    output: Any,
    memo: dict[int, Any] | None = None,
    leaf: Callable[[Any], Any] | None = None,
) -> Any:
    """Evaluate ``obj`` with every stand-in replaced by its value on ``output``.

    Containers (lists, tuples incl. named tuples, dicts, sets) are rebuilt with their
    stand-ins replaced; anything else is returned unchanged, or passed through
    ``leaf`` if given (per-example makers swap batched tensors for one example).
    ``memo`` caches each stand-in's value so a sub-expression used twice (``y`` in
    ``y.view(-1, y.size(-1))``, a recorded dropout) is evaluated once.
    """
    memo = {} if memo is None else memo
    if isinstance(obj, StandIn):
        key = id(obj)
        if key not in memo:
            memo[key] = _evaluate(obj, output, memo, leaf)
        return memo[key]
    if isinstance(obj, list):
        return [replay(x, output, memo, leaf) for x in obj]
    if isinstance(obj, tuple):
        items = [replay(x, output, memo, leaf) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, (set, frozenset)):
        return type(obj)(replay(x, output, memo, leaf) for x in obj)
    if isinstance(obj, dict):
        items = [
            (replay(k, output, memo, leaf), replay(v, output, memo, leaf))
            for k, v in obj.items()
        ]
        if type(obj) is dict:
            return dict(items)
        new = obj.copy()  # keeps the subclass (OrderedDict, defaultdict, ...)
        new.clear()
        new.update(items)
        return new
    return obj if leaf is None else leaf(obj)


def _evaluate(s: StandIn, output: Any, memo: dict[int, Any], leaf: Any) -> Any:
    op, parent, payload = s._si_op, s._si_parent, s._si_payload
    if op == "output":
        return output
    try:
        if op == "attr":
            return getattr(replay(parent, output, memo, leaf), payload)
        if op == "item":
            return replay(parent, output, memo, leaf)[
                replay(payload, output, memo, leaf)
            ]
        args, kwargs = replay(payload, output, memo, leaf)
        fn = replay(parent, output, memo, leaf) if op == "call" else parent
        return fn(*args, **kwargs)
    except Exception as err:
        # Name the recorded expression: the traceback alone points into this module.
        if hasattr(err, "add_note"):
            err.add_note(f"(while replaying the recorded expression {describe(s)})")
        raise


def describe(obj: Any) -> str:
    """Source-like text of a recorded expression, e.g. ``y.view(-1, y.size(-1))``."""
    if isinstance(obj, StandIn):
        op, parent, payload = obj._si_op, obj._si_parent, obj._si_payload
        if op == "output":
            return "y"
        if op == "attr":
            return f"{describe(parent)}.{payload}"
        if op == "item":
            return f"{describe(parent)}[{describe(payload)}]"
        args, kwargs = payload
        text = ", ".join(
            [describe(a) for a in args]
            + [f"{k}={describe(v)}" for k, v in kwargs.items()]
        )
        name = describe(parent) if op == "call" else getattr(parent, "__name__", "fn")
        return f"{name}({text})"
    if isinstance(obj, list):
        return "[" + ", ".join(describe(x) for x in obj) + "]"
    if isinstance(obj, tuple):
        return (
            "("
            + ", ".join(describe(x) for x in obj)
            + ("," if len(obj) == 1 else "")
            + ")"
        )
    if isinstance(obj, dict):
        return (
            "{"
            + ", ".join(f"{describe(k)}: {describe(v)}" for k, v in obj.items())
            + "}"
        )
    text = repr(obj)
    return text if len(text) <= 40 else f"<{type(obj).__name__}>"
