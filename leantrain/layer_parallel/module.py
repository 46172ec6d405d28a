"""LayerParallel: a residual stack whose forward and backward are MGRIT solves.

A drop-in for a model's ``.stack``: ``forward(state) -> state``. In parallel mode the
forward runs MGRIT on ``u_{n+1} = u_n + h F_n(u_n)``, keeps the final sweep's per-layer
graphs, and a custom autograd function runs the adjoint MGRIT in ``backward``, returning
the input gradient and every parameter's gradient to autograd (so ``.grad`` accumulates
across micro-batches and any optimizer works). ``.serial()`` switches the same module,
same parameters, to exact layer-by-layer autograd; ``.parallel()`` switches back.
``forward_solver="serial"`` keeps the forward exact (layer after layer, chunk after
chunk) and runs only the adjoint with MGRIT.

:func:`~leantrain.layer_parallel.mesh.parallelize` spreads the chunks over the ranks of
a device mesh's ``lp`` axis, one contiguous chunk of layers per rank (see
docs/layer_parallel.md, "Distributed"): every rank calls the module on the same input,
only its own layers run and receive gradients, the output is broadcast from the last
rank and the input gradient from the first, so the code around the stack is the same on
every rank.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from leantrain import evaluation
from leantrain.layer_parallel._checks import (
    check_blocks,
    check_float,
    check_int,
    check_on_divergence,
    check_stack_dt,
    check_state,
)
from leantrain.layer_parallel.adjoint import adjoint_solve
from leantrain.layer_parallel.layout import ChunkLayout, Exchange
from leantrain.layer_parallel.mgrit import (
    CONVERGENCE_RTOL,
    MGRITOptions,
    MGRITStats,
    mgrit_solve,
    sequential_solve,
)
from leantrain.layer_parallel.ode import (
    LayerRNG,
    State,
    StepPropagator,
    as_tuple,
    detach,
    like,
    serial_forward,
)

FORWARD_SOLVERS = ("mgrit", "serial")


class MGRITDivergenceError(RuntimeError):
    """MGRIT residuals did not fall (raised when ``on_divergence="raise"``)."""


NO_SECOND_DERIVATIVE = (
    "LayerParallel computes its backward as an adjoint MGRIT solve, which has no "
    "derivative of its own: double backward (create_graph=True; Hessian-vector "
    "products, e.g. PsgdGradientMaker, HessianFreeGradientMaker, "
    "NewtonGradientMaker, curvature(kind='hessian'/'ggn')) and torch.func transforms "
    "(e.g. DiagonalEmpiricalFisherGradientMaker's per-example pass) need exact "
    "layer-by-layer autograd: call .serial() on the LayerParallel stack (one "
    "process) for them, or use a maker built on first derivatives (K-FAC, EKFAC, "
    "K-BFGS, Shampoo, SENG, SMW-NG, NaturalGradientMaker)"
)


@dataclass
class LayerParallelStats:
    """What the last call did.

    Attributes:
        mode: ``"parallel"`` or ``"serial"``.
        forward: the forward solve's stats (None when the forward ran serially: in
            serial mode and with ``forward_solver="serial"``).
        backward: the last adjoint solve's stats (None before ``backward`` / in
            serial).
        backwards: every adjoint solve of this call, in order: a curvature maker
            back-propagates several vectors through one forward (the loss gradient,
            then its Fisher vectors), each an adjoint solve with its own residuals.
        serial_steps: layer steps run serially: ``N`` in serial mode and for the
            exact forward of ``forward_solver="serial"``, else 0.
    """

    mode: str
    forward: MGRITStats | None = None
    backward: MGRITStats | None = None
    serial_steps: int = 0
    backwards: list[MGRITStats] = field(default_factory=list)

    @property
    def layer_steps(self) -> int:
        """Layer steps counted so far in this call (forward plus every adjoint)."""
        solves = [s for s in (self.forward, *self.backwards) if s is not None]
        return self.serial_steps + sum(s.total_work for s in solves)


class LayerParallel(nn.Module):
    r"""A stack of residual steps run as an ODE with MGRIT forward and adjoint.

    A block is an ``nn.Module`` called as ``block(x, dt)`` that returns a state of
    ``x``'s shape: one residual step ``x + dt * F(x)``. The container and each
    block's forward signature are checked here; that a block keeps the state's shape
    is checked where it runs (a shape comparison per evaluation, no synchronisation),
    because the width is known only at the first call and a Hugging Face block
    cannot be probed without that call's masks.

    Args:
        steps: the blocks: a list, ``nn.ModuleList`` or ``nn.Sequential`` of them
            (a container only; its own forward is never called), or a module holding
            them in ``.steps`` such as ``ResidualStack`` (``model.stack``), whose
            step size ``dt`` must then equal ``t_final / N``.
        t_final: ODE end time ``T``; the step is ``h = T / N``. The default 1 gives
            ``h = 1/N``, for which MGRIT converges fast; ``t_final = N`` (``h = 1``,
            a plain ResNet) typically does not converge (``converged`` is False and
            ``on_divergence`` acts).
        levels: MGRIT grid levels (>= 2).
        cf: coarsening factor (>= 2).
        fwd_iters: forward V-cycles (unused with ``forward_solver="serial"``).
        bwd_iters: adjoint V-cycles.
        relax: CF-sweeps per non-coarsest level (1 = FCF, 0 = F-relaxation only).
        skip_downcycle: first cycle of a cold start is only a coarse solve.
        tol: absolute residual at which a solve stops early (0: run all cycles).
        warm_start: start each solve from the previous call's trajectory.
        chunks: contiguous layer chunks ("ranks"); ``N/chunks`` must be a multiple of
            ``cf**(levels-1)``.
        on_divergence: ``"warn"`` (a ``RuntimeWarning``, once per module and
            direction), ``"raise"`` (:class:`MGRITDivergenceError`) or ``"ignore"``
            when the forward did not converge (``stats.forward.converged`` is False:
            a residual grew or is not finite, or the last is above
            ``mgrit.CONVERGENCE_RTOL`` of the state norm) or the adjoint diverged
            (``stats.backward.diverged``: a residual grew or is not finite; its
            level is left to ``bwd_iters``, inexact by design).
        forward_solver: ``"mgrit"`` (default) or ``"serial"``: the forward is exact
            serial stepping, chunk after chunk (rank to rank when distributed), and
            only the adjoint is an MGRIT solve. The output is the serial network's;
            the gradient is as exact as ``bwd_iters`` makes it.

    Raises:
        TypeError: if ``steps`` is not one of the containers above, or a block's
            forward cannot be called as ``block(x, dt)``.
        ValueError: for invalid options, an unsplittable number of steps, or a
            ``.steps`` stack whose ``dt`` is not ``t_final / N``; at a call, for a
            block that changes the state's shape.

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
        forward_solver: str = "mgrit",
    ) -> None:
        super().__init__()
        self.steps = nn.ModuleList(check_blocks(steps))
        self.t_final = check_float("t_final", t_final, positive=True)
        check_stack_dt(steps, len(self.steps), self.t_final)
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
        self.forward_solver = forward_solver
        self.mode = "parallel"
        self.stats = LayerParallelStats(self.mode)
        self._warm: dict[str, list[State]] = {}
        self._exchanges: tuple[Exchange, Exchange] | None = None  # (forward, adjoint)
        self._mesh = None  # the DeviceMesh parallelize bound the stack to
        self._warned: set[str] = set()  # "forward"/"backward": warned once already

    @property
    def forward_solver(self) -> str:
        """``"mgrit"`` or ``"serial"`` (exact forward, MGRIT adjoint); settable."""
        return self._forward_solver

    @forward_solver.setter
    def forward_solver(self, value: str) -> None:
        if value not in FORWARD_SOLVERS:
            raise ValueError(
                f"forward_solver must be one of {FORWARD_SOLVERS}, got {value!r}"
            )
        self._forward_solver = value

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

    def set_iterations(self, fwd: int | None = None, bwd: int | None = None) -> None:
        """Change the forward and/or adjoint V-cycle counts in place."""
        o = self.fwd_options
        if fwd is not None:
            fwd = check_int("fwd_iters", fwd, 1)
            self.fwd_options = MGRITOptions(
                o.levels, o.cf, fwd, o.relax, o.skip_downcycle, o.tol
            )
        if bwd is not None:
            bwd = check_int("bwd_iters", bwd, 1)
            self.bwd_options = MGRITOptions(
                o.levels, o.cf, bwd, o.relax, o.skip_downcycle, o.tol
            )

    @property
    def mesh(self):
        """The DeviceMesh :func:`~leantrain.layer_parallel.mesh.parallelize` bound this
        stack to (None before): its ranks train the model together."""
        return self._mesh

    def _distribute(self, group, mesh, *, timeout: float | None = None) -> None:
        """Run one chunk per rank of ``group`` (``mesh``'s ``lp`` axis).

        :func:`~leantrain.layer_parallel.mesh.parallelize` is the way in: it takes the
        group from the mesh and sets up data parallelism around the stacks.

        Rank ``r`` of the group owns layers ``r N/P .. (r+1) N/P - 1`` and computes
        and receives gradients only for those; ``N/P`` must be a multiple of
        ``cf**(levels-1)``. Each rank keeps the full module (the other layers stay
        untouched and get no gradient). Every wait times out after ``timeout``
        seconds (default 300) with :class:`~.comm.LayerParallelCommError`.

        Raises:
            ValueError: if the layers do not split over the group's ranks.
        """
        from leantrain.layer_parallel.comm import DistExchange

        fwd = DistExchange(group, timeout=timeout)
        o = self.fwd_options
        self.layout = ChunkLayout(len(self.steps), fwd.size, o.cf, o.levels)
        self._exchanges = (fwd, DistExchange(group, reverse=True, timeout=timeout))
        self._mesh = mesh
        self._warm.clear()

    @property
    def is_distributed(self) -> bool:
        """True once parallelized over more than one ``lp`` rank."""
        return self._exchanges is not None and self._exchanges[0].size > 1

    @property
    def owned_layers(self) -> range:
        """Indices of the layers this process runs (all of them unless distributed)."""
        if not self.is_distributed:
            return range(len(self.steps))
        n0, c = self.layout.per_chunk(0), self._exchanges[0].chunk
        return range(c * n0, (c + 1) * n0)

    def synchronize_layers(self) -> None:
        """Give every rank the current weights of every layer (from their owners).

        Each rank trains only its own layers; call this before saving a full
        checkpoint from one rank or evaluating the whole stack in one process. One
        broadcast per parameter and buffer; a no-op unless distributed.
        """
        if not self.is_distributed:
            return
        fwd, n0 = self._exchanges[0], self.layout.per_chunk(0)
        with torch.no_grad():
            for n, step in enumerate(self.steps):
                for t in [*step.parameters(), *step.buffers()]:
                    t.copy_(fwd.broadcast(t, n // n0))

    def local_parameters(self) -> list[nn.Parameter]:
        """Parameters of :attr:`owned_layers` (the ones this process trains)."""
        return [p for n in self.owned_layers for p in self.steps[n].parameters()]

    def forward(self, state: State) -> State:
        state = check_state(state)
        # Under torch.func (vmap, grad) only exact autograd can run: no MGRIT, and no
        # per-layer streams (they draw a seed with .item()); vmap's randomness holds.
        transformed = torch._C._functorch.peek_interpreter_stack() is not None
        if transformed and (self.mode != "serial" or self.is_distributed):
            raise RuntimeError(NO_SECOND_DERIVATIVE)
        rng = LayerRNG.draw(state, enabled=self.training and not transformed)
        if self.is_distributed and rng.enabled:
            # Every rank must run its layers with the first rank's batch seed.
            rng.batch_seed = self._exchanges[0].broadcast_int(rng.batch_seed, 0)
        if self.is_distributed:  # only this rank's layers run here
            evaluation.note_partial()
        if self.mode == "serial" and not self.is_distributed:
            self.stats = LayerParallelStats("serial", serial_steps=len(self.steps))
            return serial_forward(self.steps, state, self.dt, rng)
        self.stats = LayerParallelStats(self.mode)
        params = [p for p in self.local_parameters() if p.requires_grad]
        tensors = as_tuple(state)
        grad = torch.is_grad_enabled() and (
            bool(params) or any(t.requires_grad for t in tensors)
        )
        if not grad:
            return self._output(self._solve_forward(state, rng, record=False)[1][-1])
        is_tuple = isinstance(state, tuple)
        out = _MGRITFunction.apply(self, rng, is_tuple, len(tensors), *tensors, *params)
        return like(state, out)

    def _output(self, last: State) -> State:
        # The last rank holds u_N; every rank returns it, so the head and the loss
        # run (identically) everywhere and the user's loop needs no rank checks.
        if not self.is_distributed:
            return last
        fwd = self._exchanges[0]
        return fwd.broadcast(last, fwd.size - 1)

    # ------------------------------------------------------------- used by autograd
    def _solve_forward(self, state: State, rng: LayerRNG, *, record: bool):
        prop = StepPropagator(self.steps, self.dt, self.layout.cf, rng, record=record)
        state = detach(state)
        ex = self._exchanges[0] if self.is_distributed else None
        if self.mode == "serial" or self.forward_solver == "serial":
            # Exact stepping chunk after chunk (rank after rank when distributed);
            # a recording propagator keeps every graph for the adjoint.
            traj = sequential_solve(prop, state, self.layout, ex)
            self.stats.serial_steps = len(self.steps)
            return prop, traj
        init = self._warm_guess("forward", state)
        traj, stats = mgrit_solve(
            prop, state, self.layout, self.fwd_options, exchange=ex, init=init
        )
        self._finish("forward", traj, stats, self.stats, ex)
        return prop, traj

    def _solve_adjoint(
        self, prop: StepPropagator, grad_output: State, record: LayerParallelStats
    ):
        params = [[p for p in s.parameters() if p.requires_grad] for s in self.steps]
        ex = self._exchanges[1] if self.is_distributed else None
        serial = record.mode == "serial"
        init = None if serial else self._warm_guess("backward", grad_output)
        grad_in, grads, traj, stats = adjoint_solve(
            prop,
            grad_output,
            self.layout,
            self.bwd_options,
            params,
            exchange=ex,
            init=init,
            serial=serial,
        )
        if not serial:
            self._finish("backward", traj, stats, record, ex)
        if ex is not None:  # dL/du_0 lives on the first forward rank (adjoint last)
            grad_in = ex.broadcast(grad_in, ex.size - 1)
        return grad_in, grads

    def _warm_guess(self, which: str, u0: State) -> list[State] | None:
        guess = self._warm.get(which) if self.warm_start else None
        if guess is None:
            return None
        shapes = [(t.shape, t.dtype, t.device) for t in as_tuple(u0)]
        if shapes != [(t.shape, t.dtype, t.device) for t in as_tuple(guess[0])]:
            return None  # a batch of another shape starts cold
        return [u0, *guess[1:]]

    def _finish(
        self,
        which: str,
        traj: list[State],
        stats: MGRITStats,
        record: LayerParallelStats,
        exchange: Exchange | None = None,
    ) -> None:
        # ``record`` is the stats object of the forward call this solve belongs to
        # (several forwards may run before their backwards).
        setattr(record, which, stats)
        if which == "backward":
            record.backwards.append(stats)
        if self.warm_start:
            self._warm[which] = self._global_trajectory(traj, exchange)
        # One or two adjoint cycles leave the gradient inexact by design (the README's
        # GPT: residual ~23 % of the adjoint's norm after bwd_iters=1), so the adjoint
        # acts only when it diverges; the forward also when its residual stays large.
        failed = stats.converged is False and (which == "forward" or stats.diverged)
        if not failed or self.on_divergence == "ignore":
            return
        msg = self._not_converged(which, stats)
        if self.on_divergence == "raise":
            raise MGRITDivergenceError(msg)
        # Once per module and direction: every training step would repeat it.
        if which not in self._warned:
            self._warned.add(which)
            msg += "; warned once per module (on_divergence='ignore' silences it)"
            warnings.warn(msg, RuntimeWarning, stacklevel=3)

    def _not_converged(self, which: str, stats: MGRITStats) -> str:
        forward = which == "forward"
        more = "fwd_iters" if forward else "bwd_iters"
        options = self.fwd_options if forward else self.bwd_options
        exact = ', forward_solver="serial" (exact forward)' if forward else ""
        history = ", ".join(f"{r:.3g}" for r in stats.history)
        return (
            f"MGRIT {which} solve did not converge after {stats.iterations} V-cycles "
            f"({more}={options.iterations}): final residual "
            f"{stats.final_residual:.3g} is {stats.relative_residual:.1%} of the state "
            f"norm (converged means at most {CONVERGENCE_RTOL:.0%} and no growth; "
            f"residuals by cycle [{history}]), so the "
            f"{'output' if forward else 'gradient'} is not the serial network's. "
            f"h = {self.dt:.3g} (t_final / N = {self.t_final:g} / {len(self.steps)}): "
            "MGRIT converges for h well below 1 (t_final=1.0 gives h = 1/N). Use a "
            f"smaller t_final, more {more}{exact}, or .serial() (exact autograd)"
        )

    def _global_trajectory(
        self, traj: list[State], exchange: Exchange | None
    ) -> list[State | None]:
        # All N+1 points in global order; a distributed rank fills only its own
        # chunk (the solver reads no other point of a warm start).
        traj = [detach(x) for x in traj]
        if exchange is None:
            return traj
        out: list[State | None] = [None] * (self.layout.n_steps + 1)
        out[0] = traj[0]
        n0 = self.layout.per_chunk(0)
        for k, chunk in enumerate(exchange.local_chunks):
            start = self.layout.offset(chunk, 0) + 1
            out[start : start + n0] = traj[1 + k * n0 : 1 + (k + 1) * n0]
        return out

    def extra_repr(self) -> str:
        o = self.fwd_options
        return (
            f"N={len(self.steps)}, t_final={self.t_final}, levels={o.levels}, "
            f"cf={o.cf}, fwd_iters={o.iterations}, "
            f"bwd_iters={self.bwd_options.iterations}, chunks={self.layout.chunks}, "
            f"distributed={self.is_distributed}, mode={self.mode}, "
            f"forward_solver={self.forward_solver}"
        )


class _MGRITFunction(torch.autograd.Function):
    """Forward MGRIT with recorded final sweep; backward = adjoint MGRIT."""

    @staticmethod
    def forward(ctx, module, rng, is_tuple, n_state, *args):
        template = tuple(args[:n_state]) if is_tuple else args[0]
        state = like(template, args[:n_state])
        prop, traj = module._solve_forward(state, rng, record=True)
        ctx.module, ctx.prop, ctx.stats = module, prop, module.stats
        ctx.template = (None,) * n_state if is_tuple else torch.empty(0)
        ctx.n_state, ctx.params = n_state, args[n_state:]
        out = tuple(as_tuple(module._output(traj[-1])))
        ctx.out_meta = [(o.shape, o.dtype, o.device) for o in out]
        return out

    @staticmethod
    def backward(ctx, *grad_outputs):
        if torch.is_grad_enabled():  # create_graph=True: a second derivative
            raise RuntimeError(NO_SECOND_DERIVATIVE)
        grad_out = like(
            ctx.template,
            [
                torch.zeros(shape, dtype=dtype, device=device) if g is None else g
                for g, (shape, dtype, device) in zip(
                    grad_outputs, ctx.out_meta, strict=True
                )
            ],
        )
        with torch.no_grad():
            grad_in, grads = ctx.module._solve_adjoint(ctx.prop, grad_out, ctx.stats)
        param_grads = [grads.get(id(p)) for p in ctx.params]
        return (None, None, None, None, *as_tuple(grad_in), *param_grads)
