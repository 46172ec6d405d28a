"""Registry of the preconditioning methods: one name, one tested setting.

``make_gradient_maker(name, model)`` builds the gradient maker of a registered
method with its documented defaults (damping, schedule, options), so benchmarks and
``leantrain compare --precond kfac,shampoo,...`` share one list. Classes are imported
lazily: a method whose module is missing (or fails to import) is reported by
:func:`available_methods` / raises :class:`MethodUnavailableError`, the others work.

The defaults (damping, SGD learning rate ``lr``) are those of ``benchmarks/precond.py``
on the 8x8 digits MLP; see ``docs/precond_methods_ng.md``.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from leantrain.precond.preconditioned import (
    PreconditionedGradientMaker,
    PreconditioningConfig,
)

__all__ = [
    "PRECOND_METHODS",
    "MethodSpec",
    "MethodUnavailableError",
    "available_methods",
    "make_gradient_maker",
]


class MethodUnavailableError(ImportError):
    """The module or class of a registered method cannot be imported."""


@dataclass(frozen=True)
class MethodSpec:
    """How to build one method.

    Attributes:
        module: module path of the maker class.
        cls: class name.
        config: ``PreconditioningConfig`` fields.
        kwargs: keyword arguments of the maker.
        lr: learning rate for ``torch.optim.SGD`` (momentum 0.9) on the benchmark.
        dense: forms a dense ``P x P`` matrix (small models only).
        note: one line for tables.
    """

    module: str
    cls: str
    config: dict[str, Any] = field(default_factory=dict)
    kwargs: dict[str, Any] = field(default_factory=dict)
    lr: float = 0.1
    dense: bool = False
    note: str = ""


# Schedules that amortise (docs/precond.md, "Schedules"). K-FAC refreshes factors
# and inverses every 20 steps: kfac-pytorch inverts every 10 (LM examples) to 100
# (ImageNet); on the digits MLP (3 seeds) 20 steps took as few steps to AdamW's loss
# as 10 (0.39-0.43x AdamW's) at a cheaper mean step (1.9x against 2.3x AdamW's),
# while updating the factors every step (kfac-pytorch's LM examples) cost 3.7x.
# EKFAC refreshes every 10. Shampoo accumulates its statistics every 10 steps and
# recomputes its inverse roots every 100 (Distributed Shampoo's README); its
# grafting from SGD gives it SGD's step size, so its lr is SGD's on the MLP.
_EVERY_10 = {"curvature_interval": 10, "preconditioner_interval": 10}
_EVERY_20 = {"curvature_interval": 20, "preconditioner_interval": 20}
_SHAMPOO_SCHEDULE = {"curvature_interval": 10, "preconditioner_interval": 100}
# The safeguard of each family, so a first try at the learning rates people start
# with (SGD 0.05 with momentum 0.9, AdamW 1e-3) does not diverge (measured in
# benchmarks/precond_stability.py; docs/precond.md, "Safeguards"):
# - K-FAC and EKFAC: kfac-pytorch's KL clipping at its default 1e-3. It keeps
#   K-FAC's longer steps while their predicted KL divergence is small, which is
#   where it gains on SGD; grafting to SGD's layer norms removed that gain (a d 128
#   GPT, 300 steps: 1.05x SGD's loss grafted, 0.89x clipped).
# - Shampoo and PSGD: Distributed Shampoo's grafting from SGD (each layer's step
#   takes its plain gradient's norm): their preconditioned gradients have no
#   learning-rate scale of their own, and the clip needs one.
_KL_CLIP = {"kl_clip": 1e-3}
_GRAFT = {"grafting": "sgd"}
# Kronecker makers: bias-corrected EMA of the factors; damping per family below.
_KFAC_CONFIG = {"damping": 1e-2, "ema_decay": 0.95, **_KL_CLIP}
# K-FAC itself: at 1e-2 its steps blow up on the digits MLP once the loss nears 0
# (300 steps of batch 64: every step diverged at step ~100, interval 10 at ~200);
# at 3e-2 both train stably for 600 steps (loss 0.005 at step 300).
_KFAC_DAMPING = 3e-2
_SHAMPOO_CONFIG = {"damping": 1e-4, "ema_decay": 0.95, **_GRAFT}


def _spec(module: str, cls: str, **rest: Any) -> MethodSpec:
    return MethodSpec(f"leantrain.precond.methods.{module}", cls, **rest)


def _kfac(*, every_step: bool = False) -> MethodSpec:
    # Every step (kfac_1), each batch's factors replace the last (ASDL's default
    # too), so they stay low-rank and wide layers are inverted through the batch's
    # Gram matrix (_gram.py, 1.2x faster).
    if every_step:
        config = {**_KFAC_CONFIG, "ema_decay": None, "damping": _KFAC_DAMPING}
    else:
        config = {**_KFAC_CONFIG, **_EVERY_20, "damping": _KFAC_DAMPING}
    return _spec(
        "kfac",
        "KfacGradientMaker",
        config=config,
        kwargs={"fisher_type": "fisher_mc"},
        lr=0.01,
        note="MC Fisher, every step" if every_step else "MC Fisher, every 20 steps",
    )


def _shampoo(*, every_step: bool = False) -> MethodSpec:
    schedule = {} if every_step else _SHAMPOO_SCHEDULE
    return _spec(
        "shampoo",
        "ShampooGradientMaker",
        config={**_SHAMPOO_CONFIG, **schedule},
        # Grafted, its step is SGD's size: on the digits MLP (2 seeds) lr 0.1 took
        # 0.51x AdamW's steps to its loss, 0.05 0.75x, 0.01 did not reach it in 300
        # steps. The every-step form keeps its earlier tuning.
        lr=0.01 if every_step else 0.1,
        note="every step"
        if every_step
        else "statistics every 10 steps, roots every 100",
    )


def _ng(shape: str) -> MethodSpec:
    # Full and layer-wise Fisher blocks are dense P x P (or per-layer) matrices.
    return _spec(
        "natural_gradient",
        "NaturalGradientMaker",
        config={"damping": 1e-1},
        kwargs={"fisher_type": "fisher_mc", "shape": shape},
        lr=0.03,
        dense=shape in ("full", "layer"),
    )


PRECOND_METHODS: dict[str, MethodSpec] = {
    # K-FAC family: the settings of docs/precond_methods_kron.md (tuned on the MLP).
    "kfac": _kfac(),
    "kfac_1": _kfac(every_step=True),
    "ekfac": _spec(
        "ekfac",
        "EkfacGradientMaker",
        # At 1e-2 EKFAC is on the edge of stability on the MLP (a change of
        # Monte-Carlo draws made it diverge); 3e-2 reaches the target.
        config={**_KFAC_CONFIG, **_EVERY_10, "damping": _KFAC_DAMPING},
        kwargs={"fisher_type": "fisher_mc"},
        lr=0.01,
        note="MC Fisher, every 10 steps",
    ),
    "shampoo": _shampoo(),
    "shampoo_1": _shampoo(every_step=True),
    # SOAP's own defaults (nikhilvyas/SOAP): bases refreshed every 10 steps (one
    # power iteration + QR), factors every step with shampoo_beta = beta2 = 0.95,
    # Adam's eps 1e-8 as the damping. Its direction is already Adam's (momentum,
    # normalisation): wrap SGD without momentum at an Adam-sized lr. For the
    # benchmark's SGD with momentum 0.9 (digits MLP, 100 steps, final loss): 0.42 at
    # 3e-4, 0.074 at 1e-3, 0.14 at 2e-3, 0.32 at 3e-3 (AdamW 3e-3: 0.053; SOAP
    # through SGD without momentum: 0.29 at 3e-3, 0.0018 at 1e-2, 0.012 at 3e-2).
    "soap": _spec(
        "soap",
        "SoapGradientMaker",
        config={"damping": 1e-8, "ema_decay": 0.95, "preconditioner_interval": 10},
        kwargs={"betas": (0.95, 0.95), "max_precond_dim": 10000},
        lr=1e-3,
        note="Adam in Shampoo's eigenbasis, refreshed every 10 steps",
    ),
    "psgd": _spec(
        "psgd",
        "PsgdGradientMaker",
        config=dict(_GRAFT),
        lr=0.01,
        note="hvp, every step",
    ),
    "kbfgs": _spec(
        "kbfgs",
        "KbfgsGradientMaker",
        config={"damping": 1e-2, "ema_decay": 0.95},
        lr=0.01,
    ),
    # This file's methods: damping / lr from a grid on 60 steps (see the docs page).
    "seng": _spec(
        "seng",
        "SengGradientMaker",
        config={"damping": 1.0},
        kwargs={"sketching_size": 64, "truncated_rank": 16},
        lr=0.1,
    ),
    "smw_ng": _spec("smw_ng", "SmwNgGradientMaker", config={"damping": 1.0}, lr=0.1),
    "hessian_free": _spec(
        "hessian_free",
        "HessianFreeGradientMaker",
        config={"damping": 1e-1},
        kwargs={"curvature": "ggn", "max_iters": 10},
        lr=0.03,
        note="GGN, 10 CG iterations",
    ),
    "newton": _spec(
        "newton",
        "NewtonGradientMaker",
        config={"damping": 1.0},
        kwargs={"absolute": True},
        lr=0.03,
        dense=True,
        note="|H|, dense Hessian",
    ),
    **{f"ng_{shape}": _ng(shape) for shape in ("full", "layer", "unit", "diag")},
}


def _load(name: str) -> type:
    if name not in PRECOND_METHODS:
        raise ValueError(
            f"unknown preconditioning method {name!r}; registered: "
            f"{', '.join(PRECOND_METHODS)}"
        )
    spec = PRECOND_METHODS[name]
    try:
        return getattr(importlib.import_module(spec.module), spec.cls)
    except (ImportError, AttributeError) as err:
        raise MethodUnavailableError(
            f"method {name!r}: cannot import {spec.module}.{spec.cls} ({err})"
        ) from err


def available_methods() -> dict[str, str | None]:
    """Every registered name -> ``None`` if it can be built, else the reason."""
    out: dict[str, str | None] = {}
    for name in PRECOND_METHODS:
        try:
            _load(name)
            out[name] = None
        except MethodUnavailableError as err:
            out[name] = str(err)
    return out


def make_gradient_maker(
    name: str,
    model: nn.Module,
    *,
    config: dict[str, Any] | None = None,
    lr: float | Callable[[], float] | None = None,
    **kwargs: Any,
) -> PreconditionedGradientMaker:
    """Build method ``name`` for ``model`` with its defaults, updated by the overrides.

    Args:
        name: a key of :data:`PRECOND_METHODS`.
        model: the module to train (plain or ``DistributedDataParallel``).
        config: ``PreconditioningConfig`` fields overriding the method's.
        lr: the optimizer's learning rate (a float or a callable returning the
            current one), which the KL clip of K-FAC and EKFAC assumes
            (``maker.lr``); :func:`~leantrain.precond.precondition_in_loop` reads
            it from the optimizer instead.
        **kwargs: maker keyword arguments overriding the method's.

    Raises:
        ValueError: an unknown name (the message lists the registered ones).
        MethodUnavailableError: the method's class cannot be imported.

    Example:
        >>> import torch
        >>> from leantrain.precond.registry import make_gradient_maker
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3))
        >>> gm = make_gradient_maker("ng_diag", model, config={"damping": 1e-3})
        >>> type(gm).__name__, gm.config.damping, gm.shape
        ('NaturalGradientMaker', 0.001, 'diag')
    """
    cls = _load(name)
    spec = PRECOND_METHODS[name]
    cfg = dataclasses.replace(
        PreconditioningConfig(), **{**spec.config, **(config or {})}
    )
    maker = cls(model, cfg, **{**spec.kwargs, **kwargs})
    maker.lr = lr
    return maker
