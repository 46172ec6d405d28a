"""Which modules a curvature computation tracks, and their ops.

:func:`resolve_ignored` turns ``ignore_modules`` (instances, classes or names) into
the set of module names to skip; :func:`build_ops` makes one
:class:`~leantrain.precond.curv.modules.ModuleOp` per remaining module that owns
trainable parameters, refusing partially frozen modules; modules sharing a
parameter (tied weights) become one :class:`~._tied.TiedOp`.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from ._tied import TiedOp
from .modules import BatchNormOp, ModuleOp, is_supported_module, make_op

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
    owner: dict[int, str] = {}  # parameter id -> the first module owning it
    tied: dict[str, list[str]] = {}  # first owner -> every module sharing with it
    supported_owner = {
        id(p)
        for name, m in model.named_modules()
        if name not in ignored and is_supported_module(m)
        for p in m.parameters(recurse=False)
    }
    for name, module in model.named_modules():
        if name in ignored or name in ops:
            continue
        direct = list(module.named_parameters(recurse=False))
        trainable = [p.requires_grad for _, p in direct]
        if not any(trainable):
            continue
        if not is_supported_module(module) and all(
            id(p) in supported_owner for _, p in direct if p.requires_grad
        ):
            # A container that also registers a parameter of a supported module
            # (BERT's prediction head holds its decoder's bias): that module owns it.
            continue
        if not all(trainable):
            frozen = [n for n, p in direct if not p.requires_grad]
            raise ValueError(
                f"module {name!r} is partially frozen (requires_grad=False: {frozen}); "
                "freeze all its parameters or list it in ignore_modules"
            )
        shared = {owner[id(p)] for _, p in direct if id(p) in owner}
        for _, p in direct:
            owner.setdefault(id(p), name)
        op = make_op(name, module)
        if isinstance(op, BatchNormOp):
            op.allow_batch_coupling = allow_batch_coupling
        ops[name] = op
        for first in shared:
            tied.setdefault(first, [first]).append(name)
    return _tie(ops, tied)


def _tie(ops: dict[str, ModuleOp], tied: dict[str, list[str]]) -> dict[str, ModuleOp]:
    """Replace the ops of modules sharing a parameter by one :class:`TiedOp`,
    under the first module's name (see ``_tied.py``)."""
    if not tied:
        return ops
    groups: dict[str, list[str]] = {}
    for first, names in tied.items():
        root = next((g for g, ns in groups.items() if first in ns), first)
        members = groups.setdefault(root, [root])
        members += [n for n in names if n not in members]
    out: dict[str, ModuleOp] = {}
    merged = {n for names in groups.values() for n in names}
    for name, op in ops.items():
        if name in groups:
            out[name] = TiedOp(name, [ops[n] for n in groups[name]])
        elif name not in merged:
            out[name] = op
    return out
