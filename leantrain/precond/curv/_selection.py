"""Which modules a curvature computation tracks, and their ops.

:func:`resolve_ignored` turns ``ignore_modules`` (instances, classes or names) into
the set of module names to skip; :func:`build_ops` makes one
:class:`~leantrain.precond.curv.modules.ModuleOp` per remaining module that owns
trainable parameters, refusing partially frozen modules and tied weights (whose
curvature one op cannot own).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from .modules import BatchNormOp, ModuleOp, make_op

__all__ = ["build_ops", "resolve_ignored"]


def resolve_ignored(model: nn.Module, ignore_modules: Iterable) -> set[str]:
    """Names of the modules to skip: each entry's whole subtree.

    Entries may be module instances, module classes, or qualified names (as in
    ``model.named_modules()``; a name also covers its dotted descendants).
    """
    if isinstance(ignore_modules, (str, nn.Module, type)):
        ignore_modules = (ignore_modules,)
    entries = list(ignore_modules)
    names = dict(model.named_modules())
    roots: set[str] = set()
    for entry in entries:
        if isinstance(entry, str):
            if entry not in names:
                raise ValueError(
                    f"ignore_modules entry {entry!r} is not a module name of the model"
                )
            roots.add(entry)
        elif isinstance(entry, type) and issubclass(entry, nn.Module):
            roots.update(n for n, m in names.items() if isinstance(m, entry))
        elif isinstance(entry, nn.Module):
            found = [n for n, m in names.items() if m is entry]
            if not found:
                raise ValueError(
                    f"ignore_modules entry {type(entry).__name__} is not in the model"
                )
            roots.update(found)
        else:
            raise TypeError(
                "ignore_modules entries must be nn.Module instances, nn.Module classes "
                f"or module names; got {type(entry).__name__}"
            )
    return {
        n
        for n in names
        if any(n == r or r == "" or n.startswith(r + ".") for r in roots)
    }


def build_ops(
    model: nn.Module, ignored: set[str], *, allow_batch_coupling: bool = False
) -> dict[str, ModuleOp]:
    """One op per non-ignored module owning trainable parameters."""
    ops: dict[str, ModuleOp] = {}
    owner: dict[int, str] = {}
    for name, module in model.named_modules():
        if name in ignored or name in ops:
            continue
        direct = list(module.named_parameters(recurse=False))
        trainable = [p.requires_grad for _, p in direct]
        if not any(trainable):
            continue
        if not all(trainable):
            frozen = [n for n, p in direct if not p.requires_grad]
            raise ValueError(
                f"module {name!r} is partially frozen (requires_grad=False: {frozen}); "
                "freeze all its parameters or list it in ignore_modules"
            )
        for _, p in direct:
            if id(p) in owner and owner[id(p)] != name:
                raise ValueError(
                    f"modules {owner[id(p)]!r} and {name!r} share a parameter (tied "
                    "weights); list one of them in ignore_modules"
                )
            owner[id(p)] = name
        op = make_op(name, module)
        if isinstance(op, BatchNormOp):
            op.allow_batch_coupling = allow_batch_coupling
        ops[name] = op
    return ops
