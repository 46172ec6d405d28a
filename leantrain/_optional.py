"""Optional dependencies: import one, or say which extra of leantrain installs it.

The core of leantrain needs torch and numpy only. ``leantrain compare`` (its
progress bar, its plots) and the data helpers that read the digits or sample images
need packages of the ``compare`` extra; :func:`optional_import` turns their absence
into an ImportError that names the install command.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# The distribution that provides an import name, where the two differ.
_DISTRIBUTIONS = {"sklearn": "scikit-learn"}


def optional_import(module: str, extra: str) -> ModuleType:
    """Import ``module`` (e.g. ``"matplotlib.pyplot"``) from an optional dependency.

    Args:
        module: the dotted module name.
        extra: the extra of leantrain that installs it (``"compare"``).

    Returns:
        The module.

    Raises:
        ImportError: the package is not installed (or does not import); the message
            names it and ``pip install "leantrain[<extra>]"``.
    """
    top = module.partition(".")[0]
    try:
        # The top-level package first: a submodule cached in sys.modules would
        # otherwise hide a package that is gone.
        importlib.import_module(top)
        return importlib.import_module(module)
    except ImportError as err:
        package = _DISTRIBUTIONS.get(top, top)
        raise ImportError(
            f"{module} is needed here, but {package} is not installed (or does not "
            f'import: {err}); install it with: pip install "leantrain[{extra}]"'
        ) from err
