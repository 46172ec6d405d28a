"""The Fisher a Fisher-based maker takes, stated once: :class:`FisherOptions`.

K-FAC, EKFAC, the hook-based natural gradient, SMW-NG and SENG all take the Fisher
of the model's logits under a likelihood. Their constructors take
``fisher=FisherOptions(...)``; the six options are also accepted as keyword
arguments of the constructor (``KfacGradientMaker(model, fisher_type="fisher_emp")``,
the registry's ``kwargs``, ``precondition_in_loop(..., fisher_type=...)``), folded
into a :class:`FisherOptions` by :meth:`FisherOptions.resolve`, the one place that
does it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from torch import Tensor

from leantrain.precond._checks import check_choice

__all__ = ["FISHER_TYPES", "FisherOptions"]

FISHER_TYPES = ("fisher_mc", "fisher_exact", "fisher_emp")


@dataclass(frozen=True)
class FisherOptions:
    """The Fisher of the logits a maker preconditions with.

    Args:
        fisher_type: ``"fisher_mc"`` (``n_mc_samples`` targets drawn from the model,
            averaged), ``"fisher_exact"`` (one backward per class) or
            ``"fisher_emp"`` (the loss gradient itself, no extra backward vector).
        n_mc_samples: draws for ``"fisher_mc"``.
        loss_type: ``"cross_entropy"`` or ``"mse"``: the likelihood whose Fisher is
            taken (the loss you compute should be its negative log).
        loss_reduction: ``"mean"`` or ``"sum"``, as the loss you compute reduces.
        logits_fn: maps the model output to the logits (batch first); ``None``:
            the output itself, or its ``logits`` attribute / first element.
        seed: seeds the Monte-Carlo draws (and SENG's sketch; saved by
            ``state_dict``).

    Raises:
        ValueError / TypeError: an option out of its range or of the wrong type.

    Example:
        >>> import torch
        >>> from leantrain.precond import FisherOptions, KfacGradientMaker
        >>> model = torch.nn.Linear(4, 3)
        >>> gm = KfacGradientMaker(model, fisher=FisherOptions("fisher_emp"))
        >>> gm.fisher_type
        'fisher_emp'
    """

    fisher_type: Literal["fisher_mc", "fisher_exact", "fisher_emp"] = "fisher_mc"
    n_mc_samples: int = 1
    loss_type: Literal["cross_entropy", "mse"] = "cross_entropy"
    loss_reduction: Literal["mean", "sum"] = "mean"
    logits_fn: Callable[[Any], Tensor] | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        check_choice("fisher_type", self.fisher_type, FISHER_TYPES)
        check_choice("loss_type", self.loss_type, ("cross_entropy", "mse"))
        check_choice("loss_reduction", self.loss_reduction, ("mean", "sum"))
        n = self.n_mc_samples
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"n_mc_samples must be an int, got {n!r}")
        if n < 1:
            raise ValueError(f"n_mc_samples must be >= 1, got {n}")
        if self.logits_fn is not None and not callable(self.logits_fn):
            raise TypeError(f"logits_fn must be callable, got {self.logits_fn!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int, got {self.seed!r}")

    @classmethod
    def resolve(
        cls,
        fisher: FisherOptions | None,
        keywords: dict[str, Any],
        *,
        maker: str,
        fixed: dict[str, Any] | None = None,
    ) -> FisherOptions:
        """The options of a maker built with ``fisher=`` and/or the keyword form.

        Args:
            fisher: the ``fisher`` argument (``None``: the defaults).
            keywords: the constructor's other keyword arguments, each a field of
                this class; they override ``fisher``'s.
            maker: the maker's class name, for the messages.
            fixed: fields the method fixes (SMW-NG and SENG: the empirical
                Fisher), refused in ``keywords`` and checked in ``fisher``.

        Raises:
            TypeError: ``fisher`` is not a :class:`FisherOptions`, or a keyword
                is not one of its fields (or is fixed by the method).
            ValueError: ``fisher`` sets a fixed field to another value.
        """
        if fisher is not None and not isinstance(fisher, FisherOptions):
            raise TypeError(
                f"{maker}: fisher must be a FisherOptions, got {type(fisher).__name__}"
            )
        fixed = fixed or {}
        names = {f.name for f in dataclasses.fields(cls)} - set(fixed)
        for key in keywords:
            if key not in names:
                raise TypeError(f"{maker}() got an unexpected keyword argument {key!r}")
        options = cls() if fisher is None else fisher
        for key, value in fixed.items():
            if fisher is not None and getattr(fisher, key) != value:
                raise ValueError(
                    f"{maker} takes {key}={value!r}, got fisher.{key}="
                    f"{getattr(fisher, key)!r}"
                )
        return dataclasses.replace(options, **keywords, **fixed)
