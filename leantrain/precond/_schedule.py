"""When a preconditioned gradient maker updates its curvature and preconditioner.

:class:`PreconditioningConfig` holds the schedule (intervals, warm-up), the damping,
the EMA decay and the ignored modules, validated once; :func:`is_due` is the rule
both intervals follow. Re-exported by :mod:`leantrain.precond.preconditioned`.
"""

from __future__ import annotations

from dataclasses import dataclass

from leantrain.precond._checks import (
    check_choice,
    check_ignore_modules,
    check_int,
    check_open_unit,
    check_positive_float,
)

__all__ = ["PreconditioningConfig", "is_due"]


def is_due(step: int, interval: int, warmup_steps: int) -> bool:
    """Whether an update scheduled every ``interval`` steps runs at ``step`` (0-based).

    Every step during warm-up, then on steps ``warmup, warmup + interval, ...``.
    """
    return step < warmup_steps or (step - warmup_steps) % interval == 0


@dataclass(frozen=True)
class PreconditioningConfig:
    """When curvature and preconditioner are updated, and how they are damped.

    Frozen (use ``dataclasses.replace`` for a variant, which validates again).
    Rules (checked in ``__post_init__``, ``ValueError`` otherwise):

    - ``preconditioner_interval`` is a multiple of ``curvature_interval``, so every
      preconditioner update sees a curvature computed at that very step (a larger
      curvature interval would rebuild the same preconditioner from stale curvature).
    - With ``ema_decay=None`` (replace) the two intervals are equal: a curvature
      computed between preconditioner updates would be overwritten unused.

    Example:
        >>> from leantrain.precond import PreconditioningConfig
        >>> cfg = PreconditioningConfig(
        ...     curvature_interval=10, preconditioner_interval=100,
        ...     ema_decay=0.95, warmup_steps=5)
        >>> [cfg.curvature_due(s) for s in (0, 4, 5, 6, 15)]
        [True, True, True, False, True]
    """

    # Steps between curvature updates after warm-up.
    curvature_interval: int = 1
    # Steps between preconditioner updates; a multiple of curvature_interval.
    preconditioner_interval: int = 1
    # Steps at the start where both are updated every step.
    warmup_steps: int = 0
    # Added to the curvature before it is inverted; > 0.
    damping: float = 1e-7
    # None: each curvature replaces the last; in (0, 1): bias-corrected EMA.
    ema_decay: float | None = None
    # Module instances, nn.Module classes or name substrings (whole subtrees).
    ignore_modules: tuple = ()
    # If set, forward_and_backward raises once this many steps have run.
    num_total_steps: int | None = None
    # forward_and_backward calls (micro-batches) per step; their losses must sum to
    # the mean loss over their union. The k-th call updates and preconditions.
    accumulation_steps: int = 1
    # "sgd": each layer's preconditioned gradient is rescaled to the norm of its
    # plain gradient (the optimizer's step size, the preconditioner's direction);
    # None: the preconditioned gradient as the method defines it. See _safeguards.
    grafting: str | None = None
    # kfac-pytorch's KL clipping: the preconditioned gradient is scaled by
    # min(1, sqrt(kl_clip / sum_l lr^2 <P_l, G_l>)), bounding the step's predicted
    # KL divergence; needs the learning rate (the wrapped optimizer's in a loop,
    # maker.lr otherwise). None: off. See _safeguards.
    kl_clip: float | None = None
    # A step whose gradient is not finite, without a GradScaler (which skips such
    # steps itself): "skip" (nothing is updated and .grad is cleared, so
    # optimizer.step() changes nothing; warns each time) or "raise".
    nonfinite: str = "skip"

    def __post_init__(self) -> None:
        check_int("curvature_interval", self.curvature_interval, minimum=1)
        check_int("preconditioner_interval", self.preconditioner_interval, minimum=1)
        check_int("warmup_steps", self.warmup_steps, minimum=0)
        check_positive_float("damping", self.damping)
        check_int("accumulation_steps", self.accumulation_steps, minimum=1)
        check_choice("grafting", self.grafting, (None, "sgd"))
        if self.kl_clip is not None:
            check_positive_float("kl_clip", self.kl_clip)
        check_choice("nonfinite", self.nonfinite, ("skip", "raise"))
        if self.ema_decay is not None:
            check_open_unit("ema_decay", self.ema_decay)
        # Frozen: validated once, so normalise through object.__setattr__.
        entries = check_ignore_modules(self.ignore_modules)
        object.__setattr__(self, "ignore_modules", entries)
        if self.num_total_steps is not None:
            check_int("num_total_steps", self.num_total_steps, minimum=1)
            if self.warmup_steps > self.num_total_steps:
                raise ValueError(
                    f"warmup_steps={self.warmup_steps} exceeds "
                    f"num_total_steps={self.num_total_steps}"
                )
        if self.preconditioner_interval % self.curvature_interval:
            raise ValueError(
                f"preconditioner_interval={self.preconditioner_interval} must be a "
                f"multiple of curvature_interval={self.curvature_interval}: otherwise "
                "preconditioners are rebuilt from curvature that has not changed."
            )
        if (
            self.ema_decay is None
            and self.preconditioner_interval != self.curvature_interval
        ):
            raise ValueError(
                f"with ema_decay=None each curvature replaces the last, so curvature "
                f"computed every {self.curvature_interval} steps but used every "
                f"{self.preconditioner_interval} would be discarded unused; set "
                "curvature_interval == preconditioner_interval or give an ema_decay."
            )

    def curvature_due(self, step: int) -> bool:
        """Whether the curvature is updated at ``step``."""
        return is_due(step, self.curvature_interval, self.warmup_steps)

    def preconditioner_due(self, step: int) -> bool:
        """Whether the preconditioner is updated at ``step``."""
        return is_due(step, self.preconditioner_interval, self.warmup_steps)
