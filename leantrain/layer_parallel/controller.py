r"""Online convergence control: measure MGRIT's convergence factor, react in place.

Every ``every`` batches (batch 0, ``every``, ``2 every``, ...) the :class:`Controller`
runs one training batch with doubled forward and adjoint iteration counts, so each
solve records at least two residuals even with ``skip_downcycle`` (one skipped cycle
records none). From the residual histories it takes the convergence factor

.. math::
    \rho = \max_k \|r_{k+1}\| / \|r_k\| \quad \text{over } k \text{ with }
    \|r_k\| > \text{floor},

where the floor is ``100 eps ||u_C||`` (:attr:`~.mgrit.MGRITStats.floor`): float32
residuals stall near ``1e-6`` of the state norm and their ratios read about 1, which
is rounding noise, not divergence. A history entirely below the floor gives
``rho = 0``; a non-finite residual gives ``rho = inf``, except in a solve that
started from non-finite values (a GradScaler step that overflowed), which measures
nothing: the next batch becomes the check batch.

When ``rho > threshold`` the policy decides: ``"serial"`` switches every
:class:`~.module.LayerParallel` to exact serial execution in place (distributed: the
rank-to-rank relay); ``"iterations"`` adds ``step`` forward and adjoint cycles,
and switches to serial once ``max_iters`` (default ``N/(2 cf) + 1``, where MGRIT is
exact anyway) would be exceeded. Training goes on with the same module, parameters
and optimizer: no restart, no checkpoint conversion. On a model spread over a device
mesh by :func:`~.mesh.parallelize` the factors are max-reduced over that mesh (every
axis: the ``lp`` ranks and the ``dp`` replicas), so every rank of it takes the same
decision; ranks outside the mesh are not involved.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from torch import nn

from leantrain.layer_parallel._checks import check_float, check_int
from leantrain.layer_parallel.comm import all_reduce_max
from leantrain.layer_parallel.mgrit import MGRITStats
from leantrain.layer_parallel.module import LayerParallel

logger = logging.getLogger(__name__)

POLICIES = ("serial", "iterations")


def convergence_factor(stats: MGRITStats | None) -> float:
    """Worst ratio of consecutive residuals above the floor (0 if none, inf if NaN).

    Example:
        >>> s = MGRITStats(residuals=[1.0, 0.1], final_residual=0.02, floor=1e-9)
        >>> round(convergence_factor(s), 6)
        0.2
    """
    if stats is None:
        return 0.0
    history = stats.history
    if not all(math.isfinite(r) for r in history):
        return math.inf
    ratios = [
        b / a for a, b in zip(history, history[1:], strict=False) if a > stats.floor
    ]
    return max(ratios, default=0.0)


@dataclass
class Decision:
    """One check: what was measured and what was done.

    Attributes:
        batch: index of the check batch (0-based count of :meth:`Controller.step`).
        forward_factor, backward_factor: the reduced convergence factors.
        factor: their maximum, compared with ``threshold``.
        action: ``"keep"``, ``"more_iterations"`` or ``"serial"``.
        fwd_iters, bwd_iters: iteration counts in force after the decision.
        forward_history, backward_history: this rank's residual histories.
    """

    batch: int
    forward_factor: float
    backward_factor: float
    factor: float
    threshold: float
    action: str
    fwd_iters: int
    bwd_iters: int
    forward_history: list[float] = field(default_factory=list)
    backward_history: list[float] = field(default_factory=list)


class Controller:
    """Watches MGRIT convergence during training and switches in place.

    Call :meth:`step` once per batch, after ``backward()`` (like a scheduler).

    Args:
        model: a :class:`LayerParallel` or a module containing some.
        every: batches between checks (``K``; batch 0 is checked too).
        threshold: act when the convergence factor exceeds this.
        policy: ``"serial"`` or ``"iterations"`` (see the module docstring).
        step: cycles added per decision under ``"iterations"``.
        max_iters: most cycles before ``"iterations"`` falls back to serial
            (default ``N/(2 cf) + 1`` of each stack).
        mesh: the DeviceMesh whose ranks take each decision together (the factors
            are max-reduced over all its axes). Default: the mesh
            :func:`~.mesh.parallelize` bound the stacks to; none (each process
            decides alone) for stacks that were not parallelized. Pass one for
            data parallelism around in-process stacks (e.g. DDP's ranks).

    Raises:
        ValueError: if the stacks were parallelized over different meshes.

    Attributes:
        records: every :class:`Decision`, oldest first (also logged at INFO).
        switched: True once the stacks run serially.

    Example:
        >>> from leantrain.models.blocks import TransformerBlock
        >>> stack = LayerParallel([TransformerBlock(8, 2) for _ in range(8)], cf=2)
        >>> ctrl = Controller(stack, every=2)
        >>> for _ in range(3):
        ...     stack(torch.randn(1, 3, 8, requires_grad=True)).sum().backward()
        ...     _ = ctrl.step()
        >>> [d.action for d in ctrl.records], ctrl.switched
        (['keep', 'keep'], False)
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        every: int = 500,
        threshold: float = 1.0,
        policy: str = "serial",
        step: int = 1,
        max_iters: int | None = None,
        mesh=None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        self.stacks = [m for m in model.modules() if isinstance(m, LayerParallel)]
        if not self.stacks:
            raise ValueError(f"{type(model).__name__} contains no LayerParallel")
        self.every = check_int("every", every, 1)
        self.threshold = check_float("threshold", threshold, positive=True)
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self.iter_step = check_int("step", step, 1)
        self.max_iters = (
            None if max_iters is None else check_int("max_iters", max_iters, 1)
        )
        self._mesh = mesh
        self.records: list[Decision] = []
        self.batch = 0
        self._saved: list[tuple[int, int]] | None = None
        self._arm()

    @property
    def mesh(self):
        """The DeviceMesh the decisions are reduced over (None: this process alone).

        Read at every check, so a Controller made before :func:`~.mesh.parallelize`
        follows the mesh the stacks were bound to since.
        """
        if self._mesh is not None:
            return self._mesh
        meshes = {id(s.mesh): s.mesh for s in self.stacks if s.mesh is not None}
        if len(meshes) > 1:
            raise ValueError(
                "the LayerParallel stacks were parallelized over different meshes; "
                "pass the one to decide over: Controller(model, mesh=...)"
            )
        return next(iter(meshes.values()), None)

    def _reduce_max(self, values: list[float]) -> list[float]:
        # The max over a mesh is the max over each axis in turn: after the reduction
        # over axis 0 every rank holds its axis-0 line's max, the next axis combines
        # those lines.
        mesh = self.mesh
        if mesh is None:
            return values
        for axis in range(mesh.ndim):
            values = all_reduce_max(values, mesh.get_group(axis))
        return values

    @property
    def switched(self) -> bool:
        """True once every stack runs serially."""
        return all(s.mode == "serial" for s in self.stacks)

    def _limit(self, stack: LayerParallel) -> int:
        if self.max_iters is not None:
            return self.max_iters
        return len(stack.steps) // (2 * stack.fwd_options.cf) + 1

    def _arm(self) -> None:
        # Double the iterations for the coming batch if it is a check batch.
        if self.switched or self.batch % self.every:
            return
        self._saved = [
            (s.fwd_options.iterations, s.bwd_options.iterations) for s in self.stacks
        ]
        for s, (f, b) in zip(self.stacks, self._saved, strict=True):
            s.set_iterations(2 * f, 2 * b)

    def step(self) -> Decision | None:
        """Account for the batch just trained; decide if it was a check batch."""
        decision = None
        if self._saved is not None and self.switched:
            # switched to serial by the user during a check batch: nothing measured
            for s, (f, b) in zip(self.stacks, self._saved, strict=True):
                s.set_iterations(f, b)
            self._saved = None
        elif self._saved is not None:
            if self._unmeasured():
                # The check batch's solves started from non-finite values (a
                # GradScaler step that overflowed): nothing was measured, so the
                # next batch, still with doubled iterations, is the check batch.
                self.batch += 1
                return None
            decision = self._decide()
        self.batch += 1
        self._arm()
        return decision

    def state_dict(self) -> dict:
        """What resuming needs: the batch count, a check in progress, and each
        stack's mode and iteration counts (the decision records are not kept)."""
        return {
            "batch": self.batch,
            "saved": None if self._saved is None else [list(t) for t in self._saved],
            "stacks": [
                {
                    "mode": s.mode,
                    "fwd_iters": s.fwd_options.iterations,
                    "bwd_iters": s.bwd_options.iterations,
                }
                for s in self.stacks
            ],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`: the stacks switch to the saved mode and counts.

        Raises:
            ValueError: if ``state`` has other keys or another number of stacks.
        """
        if not isinstance(state, dict) or set(state) != {"batch", "saved", "stacks"}:
            raise ValueError(
                "state must be a dict with the keys ['batch', 'saved', 'stacks'], "
                f"got {state!r}"
            )
        if len(state["stacks"]) != len(self.stacks):
            raise ValueError(
                f"state holds {len(state['stacks'])} stacks, the model has "
                f"{len(self.stacks)}"
            )
        self.batch = check_int("state['batch']", state["batch"], 0)
        saved = state["saved"]
        self._saved = None if saved is None else [tuple(t) for t in saved]
        for s, entry in zip(self.stacks, state["stacks"], strict=True):
            s.set_iterations(entry["fwd_iters"], entry["bwd_iters"])
            if entry["mode"] == "serial":
                s.serial()
            else:
                s.parallel()

    def _unmeasured(self) -> bool:
        void = any(
            _nonfinite_start(stats)
            for s in self.stacks
            for stats in (s.stats.forward, s.stats.backward)
        )
        return self._reduce_max([float(void)])[0] > 0

    def _decide(self) -> Decision:
        saved, self._saved = self._saved, None
        fwd = max(convergence_factor(s.stats.forward) for s in self.stacks)
        bwd = max(convergence_factor(s.stats.backward) for s in self.stacks)
        fwd, bwd = self._reduce_max([fwd, bwd])
        factor = max(fwd, bwd)
        action = "keep"
        for s, (f, b) in zip(self.stacks, saved, strict=True):
            s.set_iterations(f, b)  # the doubled counts were for measuring only
        if factor > self.threshold:
            action = self._act(saved)
        first = self.stacks[0]
        decision = Decision(
            batch=self.batch,
            forward_factor=fwd,
            backward_factor=bwd,
            factor=factor,
            threshold=self.threshold,
            action=action,
            fwd_iters=first.fwd_options.iterations,
            bwd_iters=first.bwd_options.iterations,
            forward_history=_history(first.stats.forward),
            backward_history=_history(first.stats.backward),
        )
        self.records.append(decision)
        logger.info(
            "layer-parallel check at batch %d: convergence factor fwd %.3g bwd %.3g "
            "(threshold %.3g) -> %s (fwd_iters=%d, bwd_iters=%d)",
            decision.batch,
            fwd,
            bwd,
            self.threshold,
            action,
            decision.fwd_iters,
            decision.bwd_iters,
        )
        return decision

    def _act(self, saved: list[tuple[int, int]]) -> str:
        if self.policy == "iterations":
            raised = [(f + self.iter_step, b + self.iter_step) for f, b in saved]
            fits = all(
                max(f, b) <= self._limit(s)
                for s, (f, b) in zip(self.stacks, raised, strict=True)
            )
            if fits:
                for s, (f, b) in zip(self.stacks, raised, strict=True):
                    s.set_iterations(f, b)
                return "more_iterations"
        for s in self.stacks:
            s.serial()
        return "serial"


def _nonfinite_start(stats: MGRITStats | None) -> bool:
    # mgrit_solve's verdict on a solve from a non-finite start: None, not False
    return (
        stats is not None
        and stats.converged is None
        and not all(math.isfinite(r) for r in stats.history)
    )


def _history(stats: MGRITStats | None) -> list[float]:
    return [] if stats is None else list(stats.history)
