"""Argument validation shared by the gradient makers (one place, one message style).

Every check raises ``TypeError`` for a value of the wrong type and ``ValueError``
for a value out of range, naming the argument, the value and what is allowed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

__all__ = [
    "check_callable",
    "check_choice",
    "check_extra_state",
    "check_ignore_modules",
    "check_int",
    "check_module",
    "check_open_unit",
    "check_positive_float",
]


def check_int(name: str, value: Any, *, minimum: int) -> int:
    """An ``int`` (not ``bool``) that is ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{name} must be an int, got {value!r} ({type(value).__name__})"
        )
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")
    return value


def check_positive_float(name: str, value: Any) -> float:
    """A finite real number ``> 0``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{name} must be a float, got {value!r} ({type(value).__name__})"
        )
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite float > 0, got {value}")
    return float(value)


def check_open_unit(name: str, value: Any) -> float:
    """A real number strictly between 0 and 1."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{name} must be None or a float in (0, 1), got {value!r} "
            f"({type(value).__name__})"
        )
    if not 0.0 < value < 1.0:
        raise ValueError(f"{name} must be None or a float in (0, 1), got {value}")
    return float(value)


def check_choice(name: str, value: Any, allowed: tuple) -> Any:
    """One of ``allowed`` (compared with ``==``)."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value


def check_module(name: str, value: Any) -> nn.Module:
    """An ``nn.Module`` instance."""
    if not isinstance(value, nn.Module):
        raise TypeError(f"{name} must be a torch.nn.Module, got {type(value).__name__}")
    return value


def check_callable(name: str, value: Any) -> Callable[..., Any]:
    """Anything callable (a module, a function, a bound method)."""
    if not callable(value):
        raise TypeError(
            f"{name} must be callable, got {value!r} ({type(value).__name__})"
        )
    return value


def check_ignore_modules(value: Any) -> tuple[nn.Module | type[nn.Module] | str, ...]:
    """A sequence of module instances, ``nn.Module`` subclasses or name substrings."""
    if isinstance(value, (str, nn.Module, type)):
        value = (value,)  # a single entry is accepted for convenience
    try:
        entries = tuple(value)
    except TypeError:
        raise TypeError(
            "ignore_modules must be a sequence of nn.Module instances, nn.Module "
            f"classes or name substrings, got {value!r}"
        ) from None
    for entry in entries:
        if isinstance(entry, str):
            if not entry:
                raise ValueError(
                    "ignore_modules: an empty name substring matches every module"
                )
        elif isinstance(entry, type):
            if not issubclass(entry, nn.Module):
                raise TypeError(
                    f"ignore_modules: class {entry.__name__} is not an nn.Module "
                    "subclass"
                )
        elif not isinstance(entry, nn.Module):
            raise TypeError(
                "ignore_modules entries must be nn.Module instances, nn.Module "
                f"classes or name substrings, got {entry!r} ({type(entry).__name__})"
            )
    return entries


def check_extra_state(
    state: Any, keys: tuple[str, ...], *, tensor_maps: tuple[str, ...] = ()
) -> dict[str, Any]:
    """A maker's saved ``state['extra']``: a dict with exactly ``keys``, whose
    entries named in ``tensor_maps`` map names to tensors."""
    if not isinstance(state, dict) or set(state) != set(keys):
        listed = ", ".join(repr(k) for k in keys[:-1])
        listed = f"{listed} and {keys[-1]!r}" if listed else repr(keys[-1])
        raise ValueError(f"state['extra'] must hold {listed}")
    for key in tensor_maps:
        value = state[key]
        if not isinstance(value, dict) or not all(
            isinstance(v, Tensor) for v in value.values()
        ):
            raise TypeError(f"state['extra'][{key!r}] must map names to tensors")
    return state
