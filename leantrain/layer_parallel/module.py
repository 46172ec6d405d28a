"""LayerParallel: a residual stack whose forward and backward are MGRIT solves.

A drop-in for a model's ``.stack``: ``forward(state) -> state``. In parallel mode the
forward runs MGRIT on ``u_{n+1} = u_n + h F_n(u_n)``, keeps the final sweep's per-layer
graphs, and a custom autograd function runs the adjoint MGRIT in ``backward``, returning
the input gradient and every parameter's gradient to autograd (so ``.grad`` accumulates
across micro-batches and any optimizer works). ``.serial()`` switches the same module,
same parameters, to exact layer-by-layer autograd; ``.parallel()`` switches back.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from leantrain.layer_parallel._checks import (
    check_float,
    check_on_divergence,
    check_state,
)
from leantrain.layer_parallel.adjoint import adjoint_solve
from leantrain.layer_parallel.mgrit import MGRITOptions, MGRITStats, mgrit_solve
from leantrain.layer_parallel.ode import (
    LayerRNG,
    State,
    StepPropagator,
    as_tuple,
    detach,
    like,
    serial_forward,
)
from leantrain.layer_parallel.schedule import ChunkLayout


class MGRITDivergenceError(RuntimeError):
    """MGRIT residuals did not fall (raised when ``on_divergence="raise"``)."""


@dataclass
class LayerParallelStats:
    """What the last call did.

    Attributes:
        mode: ``"parallel"`` or ``"serial"``.
        forward: the forward solve's stats (None in serial mode).
        backward: the adjoint solve's stats (None before ``backward`` / in serial).
        serial_steps: layer steps of the serial execution (serial mode only).
    """

    mode: str
    forward: MGRITStats | None = None
    backward: MGRITStats | None = None
    serial_steps: int = 0

    @property
    def layer_steps(self) -> int:
        """Layer steps counted so far in this call (forward plus adjoint)."""
        solves = [s for s in (self.forward, self.backward) if s is not None]
        return self.serial_steps + sum(s.total_work for s in solves)


class LayerParallel(nn.Module):
    r"""A stack of residual steps run as an ODE with MGRIT forward and adjoint.

    Args:
        steps: modules with ``forward(state, dt) -> state`` (a list, ``nn.ModuleList``
            or anything with a ``.steps`` list such as ``ResidualStack``).
        t_final: ODE end time ``T``; the step is ``h = T / N``. The default 1 gives
            ``h = 1/N``, for which MGRIT converges fast; ``t_final = N`` (``h = 1``,
            a plain ResNet) typically does not converge.
        levels: MGRIT grid levels (>= 2).
        cf: coarsening factor (>= 2).
        fwd_iters: forward V-cycles.
        bwd_iters: adjoint V-cycles.
        relax: CF-sweeps per non-coarsest level (1 = FCF, 0 = F-relaxation only).
        skip_downcycle: first cycle of a cold start is only a coarse solve.
        tol: absolute residual at which a solve stops early (0: run all cycles).
        warm_start: start each solve from the previous call's trajectory.
        chunks: contiguous layer chunks ("ranks"); ``N/chunks`` must be a multiple of
            ``cf**(levels-1)``.
        on_divergence: ``"warn"``, ``"raise"`` or ``"ignore"`` when residuals do not
            fall.

    Raises:
        ValueError: for invalid options or an unsplittable number of steps.

    Example:
        >>> from leantrain.models.blocks import TransformerBlock
        >>> blocks = [TransformerBlock(16, 2, causal=True) for _ in range(8)]
        >>> stack = LayerParallel(blocks, cf=2, fwd_iters=3)
        >>> x = torch.randn(2, 5, 16, requires_grad=True)
        >>> stack(x).sum().backward()
        >>> stack.stats.forward.iterations, x.grad.shape
        (3, torch.Size([2, 5, 16]))
        >>> exact = stack.serial()(x)  # same module, same weights, exact autograd
    """

    def __init__(
        self,
        steps: Sequence[nn.Module] | nn.Module,
        *,
        t_final: float = 1.0,
        levels: int = 2,
        cf: int = 4,
        fwd_iters: int = 2,
        bwd_iters: int = 1,
        relax: int | Sequence[int] = 1,
        skip_downcycle: bool = True,
        tol: float = 0.0,
        warm_start: bool = False,
        chunks: int = 1,
        on_divergence: str = "warn",
    ) -> None:
        super().__init__()
        if isinstance(steps, nn.Module) and not isinstance(steps, nn.ModuleList):
            if not hasattr(steps, "steps"):
                raise TypeError(
                    f"steps must be a sequence of modules or have .steps, got "
                    f"{type(steps).__name__}"
                )
            steps = steps.steps
        self.steps = nn.ModuleList(steps)
        self.t_final = check_float("t_final", t_final, positive=True)
        self.layout = ChunkLayout(len(self.steps), chunks, cf, levels)
        relax = tuple(relax) if not isinstance(relax, int) else relax
        self.fwd_options = MGRITOptions(
            levels, cf, fwd_iters, relax, skip_downcycle, tol
        )
        self.bwd_options = MGRITOptions(
            levels, cf, bwd_iters, relax, skip_downcycle, tol
        )
        self.warm_start = bool(warm_start)
        self.on_divergence = check_on_divergence(on_divergence)
        self.mode = "parallel"
        self.stats = LayerParallelStats(self.mode)
        self._warm: dict[str, list[State]] = {}

    @property
    def dt(self) -> float:
        """The fine step ``h = t_final / N``."""
        return self.t_final / len(self.steps)

    def serial(self) -> LayerParallel:
        """Switch in place to exact layer-by-layer execution; returns self."""
        self.mode = "serial"
        return self

    def parallel(self) -> LayerParallel:
        """Switch in place to MGRIT forward and adjoint; returns self."""
        self.mode = "parallel"
        return self

    def forward(self, state: State) -> State:
        state = check_state(state)
        rng = LayerRNG.draw(state, enabled=self.training)
        if self.mode == "serial":
            self.stats = LayerParallelStats("serial", serial_steps=len(self.steps))
            return serial_forward(self.steps, state, self.dt, rng)
        self.stats = LayerParallelStats("parallel")
        params = [p for p in self.parameters() if p.requires_grad]
        tensors = as_tuple(state)
        grad = torch.is_grad_enabled() and (
            bool(params) or any(t.requires_grad for t in tensors)
        )
        if not grad:
            return self._solve_forward(state, rng, record=False)[1][-1]
        is_tuple = isinstance(state, tuple)
        out = _MGRITFunction.apply(self, rng, is_tuple, len(tensors), *tensors, *params)
        return like(state, out)

    # ------------------------------------------------------------- used by autograd
    def _solve_forward(self, state: State, rng: LayerRNG, *, record: bool):
        prop = StepPropagator(self.steps, self.dt, self.layout.cf, rng, record=record)
        state = detach(state)
        init = self._warm_guess("forward", state)
        traj, stats = mgrit_solve(prop, state, self.layout, self.fwd_options, init=init)
        self._finish("forward", traj, stats)
        return prop, traj

    def _solve_adjoint(self, prop: StepPropagator, grad_output: State):
        params = [[p for p in s.parameters() if p.requires_grad] for s in self.steps]
        init = self._warm_guess("backward", grad_output)
        grad_in, grads, traj, stats = adjoint_solve(
            prop, grad_output, self.layout, self.bwd_options, params, init=init
        )
        self._finish("backward", traj, stats)
        return grad_in, grads

    def _warm_guess(self, which: str, u0: State) -> list[State] | None:
        guess = self._warm.get(which) if self.warm_start else None
        if guess is None:
            return None
        shapes = [(t.shape, t.dtype, t.device) for t in as_tuple(u0)]
        if shapes != [(t.shape, t.dtype, t.device) for t in as_tuple(guess[0])]:
            return None  # a batch of another shape starts cold
        return [u0, *guess[1:]]

    def _finish(self, which: str, traj: list[State], stats: MGRITStats) -> None:
        setattr(self.stats, which, stats)
        if self.warm_start:
            self._warm[which] = [detach(x) for x in traj]
        if stats.converged is False and self.on_divergence != "ignore":
            msg = (
                f"MGRIT {which} solve did not converge: residuals "
                f"{[f'{r:.3g}' for r in stats.history]} (h = {self.dt:.3g}); use a "
                "smaller t_final, more iterations, or .serial()"
            )
            if self.on_divergence == "raise":
                raise MGRITDivergenceError(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=3)

    def extra_repr(self) -> str:
        o = self.fwd_options
        return (
            f"N={len(self.steps)}, t_final={self.t_final}, levels={o.levels}, "
            f"cf={o.cf}, fwd_iters={o.iterations}, "
            f"bwd_iters={self.bwd_options.iterations}, chunks={self.layout.chunks}, "
            f"mode={self.mode}"
        )


class _MGRITFunction(torch.autograd.Function):
    """Forward MGRIT with recorded final sweep; backward = adjoint MGRIT."""

    @staticmethod
    def forward(ctx, module, rng, is_tuple, n_state, *args):
        template = tuple(args[:n_state]) if is_tuple else args[0]
        state = like(template, args[:n_state])
        prop, traj = module._solve_forward(state, rng, record=True)
        ctx.module, ctx.prop = module, prop
        ctx.template = (None,) * n_state if is_tuple else torch.empty(0)
        ctx.n_state, ctx.params = n_state, args[n_state:]
        return tuple(as_tuple(traj[-1]))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grad_outputs):
        outs = as_tuple(ctx.prop.outputs[len(ctx.module.steps) - 1])
        grad_out = like(
            ctx.template,
            [
                torch.zeros_like(o) if g is None else g
                for g, o in zip(grad_outputs, outs, strict=True)
            ],
        )
        grad_in, grads = ctx.module._solve_adjoint(ctx.prop, grad_out)
        param_grads = [grads.get(id(p)) for p in ctx.params]
        return (None, None, None, None, *as_tuple(grad_in), *param_grads)
