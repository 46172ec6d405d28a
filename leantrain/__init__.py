"""leantrain: cheaper deep-network training on three axes (memory, curvature, depth).

The axes are subpackages: ``leantrain.optim`` (memory), ``leantrain.precond``
(curvature), ``leantrain.layer_parallel`` (depth), beside ``leantrain.models`` and
``leantrain.data``. ``import leantrain`` loads none of them; each is imported on
first use as an attribute (``leantrain.optim.Gefen``), as ``import leantrain.optim``
would.
"""

import importlib

__version__ = "0.1.0"

_SUBPACKAGES = (
    "data",
    "evaluation",
    "integrations",
    "layer_parallel",
    "models",
    "optim",
    "precond",
)

__all__ = ["__version__", *_SUBPACKAGES]


def __getattr__(name: str):
    # PEP 562: subpackages on first use, so `leantrain --version` and the
    # command line's start stay light.
    if name in _SUBPACKAGES:
        return importlib.import_module(f"leantrain.{name}")
    raise AttributeError(f"module 'leantrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_SUBPACKAGES))
