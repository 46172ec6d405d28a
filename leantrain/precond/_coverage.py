"""What a maker preconditions, and one warning for what it leaves plain.

A module owning trainable parameters is *covered* when the maker preconditions its
parameters: it is selected (supported and not ignored), or every one of its
trainable parameters is also a parameter of a selected module (a tied weight,
preconditioned where it is selected). It is *ignored* when ``ignore_modules``
excludes it, and *not covered* otherwise: its gradient is used as it is. Makers warn
once, at construction, naming the modules that are not covered.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

from torch import nn

from leantrain.precond.curv.modules import is_supported_module

__all__ = [
    "Coverage",
    "check_one_site",
    "coverage_of",
    "hidden_parameters",
    "shared_parameters",
    "warn_uncovered",
]


@dataclass(frozen=True)
class Coverage:
    """Modules owning trainable parameters, by what the maker does with them.

    Attributes:
        covered: name -> trainable parameter count, preconditioned.
        not_covered: name -> count, supported by no rule of the maker (plain
            gradient).
        ignored: name -> count, excluded by ``ignore_modules`` (plain gradient).
        types: name -> the module's class name, for every module above.
    """

    covered: dict[str, int] = field(default_factory=dict)
    not_covered: dict[str, int] = field(default_factory=dict)
    ignored: dict[str, int] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)

    @property
    def fraction(self) -> float:
        """Share of the trainable parameters (each counted once) preconditioned."""
        total = sum(self.covered.values()) + sum(self.not_covered.values())
        total += sum(self.ignored.values())
        return sum(self.covered.values()) / total if total else 1.0


def coverage_of(
    model: nn.Module, selected: set[str], not_ignored: set[str]
) -> Coverage:
    """Sort the modules of ``model`` owning trainable parameters (see module doc).

    Args:
        model: the unwrapped model.
        selected: names of the modules the maker preconditions.
        not_ignored: names of the modules ``ignore_modules`` does not exclude.
    """
    modules = dict(model.named_modules())
    covered_params = {
        id(p)
        for name in selected
        for p in modules[name].parameters(recurse=False)
        if p.requires_grad
    }
    report = Coverage()
    counted: set[int] = set()
    for name, module in modules.items():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if not own:
            continue
        # Each parameter counted once: a tied weight under its first module.
        count = sum(p.numel() for p in own if id(p) not in counted)
        counted.update(id(p) for p in own)
        if name in selected or all(id(p) in covered_params for p in own):
            bucket = report.covered
        elif name not in not_ignored:
            bucket = report.ignored
        else:
            bucket = report.not_covered
        bucket[name or "<root>"] = count
        report.types[name or "<root>"] = type(module).__name__
    return report


def user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first caller outside
    ``leantrain.precond`` (makers warn from deep in their ``__init__`` chain)."""
    frame, level = sys._getframe(1), 1
    package = os.path.dirname(os.path.abspath(__file__))
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(
        package
    ):
        frame, level = frame.f_back, level + 1
    return level


def warn_uncovered(maker: str, report: Coverage) -> None:
    """One UserWarning naming the modules that are not covered (if any)."""
    if not report.not_covered:
        return
    parts = [
        f"{name} ({report.types[name]}, {count} parameters)"
        for name, count in report.not_covered.items()
    ]
    total = sum(report.not_covered.values())
    warnings.warn(
        f"{maker} does not precondition {len(parts)} module(s) with trainable "
        f"parameters ({total} parameters; their gradient is used as it is): "
        f"{', '.join(parts)}. List them in ignore_modules to accept this (see "
        "maker.coverage()).",
        UserWarning,
        stacklevel=user_stacklevel(),
    )


def shared_parameters(model: nn.Module) -> dict[str, list[str]]:
    """Parameters used by several modules (tied weights): the parameter's name in
    ``model.named_parameters()`` -> the names of the modules owning it."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(name or "<root>")
    return {
        pname: owners[id(p)]
        for pname, p in model.named_parameters()
        if len(owners.get(id(p), ())) > 1
    }


def check_one_site(
    maker: str, model: nn.Module, chosen: set[str], *, warn: str | None
) -> None:
    """For makers without a tying rule, whose ops are the ``chosen`` modules.

    Raises ValueError when two chosen modules share a parameter (its gradient would
    be preconditioned twice); otherwise warns ``warn`` (if given) for each tied
    parameter that one chosen module preconditions.
    """
    modules = dict(model.named_modules())
    for pname, owners in shared_parameters(model).items():
        # A container registering a parameter of its child (BERT's prediction head
        # holds its decoder's bias) is no second site.
        owners = [
            n
            for n in owners
            if is_supported_module(modules["" if n == "<root>" else n])
        ]
        if len(owners) < 2:
            continue
        mine = [n for n in owners if n in chosen]
        if len(mine) > 1:
            raise ValueError(
                f"{maker}: parameter {pname!r} is used by the modules {mine} (tied "
                "weights), and this method has no rule for several sites; list all "
                "but one of them in ignore_modules, or use K-FAC / EKFAC"
            )
        if mine and warn is not None:
            warnings.warn(
                f"{maker}: parameter {pname!r} is used by the modules {owners} (tied "
                f"weights); {warn.format(site=repr(mine[0]))}",
                UserWarning,
                stacklevel=user_stacklevel(),
            )


@contextlib.contextmanager
def hidden_parameters(model: nn.Module, selected: set[str]) -> Iterator[None]:
    """Set ``requires_grad=False`` on the trainable parameters that no ``selected``
    module owns, for the duration of the block (a curvature collector built inside
    then tracks exactly the selected modules); restored on exit.

    A parameter owned by a selected module stays visible even when another module
    also owns it (a head's bias registered on its container too).
    """
    modules = dict(model.named_modules())
    keep = {id(p) for name in selected for p in modules[name].parameters(recurse=False)}
    hidden = [p for p in model.parameters() if p.requires_grad and id(p) not in keep]
    for p in hidden:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in hidden:
            p.requires_grad_(True)
