r"""The adjoint of the residual ODE, solved backward in layers by the same MGRIT.

With ``u_{n+1} = \Phi_n(u_n)`` and a loss gradient ``g = dL/du_N``, the adjoint states

.. math::
    \lambda_N = g, \qquad \lambda_n = (\partial\Phi_n/\partial u)^T(u_n)\,\lambda_{n+1},
    \qquad \nabla_{\theta_n} L = (\partial\Phi_n/\partial\theta_n)^T(u_n)\,\lambda_{n+1}

run from ``n = N`` down to 0. Reversing the index (``m = N - n``) turns this into a
forward recursion ``\mu_m = A_m(\mu_{m-1})`` that :func:`~.mgrit.mgrit_solve` solves
unchanged. Level 0 applies vector-Jacobian products through the graphs recorded in the
forward's final sweep. Coarse level ``l`` is the exact adjoint of the forward coarse
step: the VJP of the fine layer at the coarse interval's start, ``n = J cf^l``,
recomputed at its stored input with ``dt = cf^l h``. Parameter gradients are taken only
in the final sweep (each layer exactly once) and summed per parameter; the autograd
function returns them so autograd *accumulates* them into ``.grad``. Every other
vector-Jacobian product and coarse recomputation runs under
:func:`leantrain.evaluation.auxiliary`, so tensor hooks on a layer's outputs (curvature
collectors) fire for the final sweep only: its output-gradients are the exact adjoint
ones when MGRIT has converged.

Chunks: adjoint chunk ``q`` is forward chunk ``P - 1 - q`` (reversed order), which owns
the same layers in both directions, so no layer or graph ever moves between chunks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from leantrain import evaluation
from leantrain.layer_parallel.layout import ChunkLayout, Exchange
from leantrain.layer_parallel.mgrit import (
    MGRITOptions,
    MGRITStats,
    mgrit_solve,
    sequential_solve,
)
from leantrain.layer_parallel.ode import (
    State,
    StepPropagator,
    as_tuple,
    leaf,
    like,
    run_step,
)

REENTRANT_CHECKPOINT = (
    "LayerParallel takes each layer's vector-Jacobian product with "
    "torch.autograd.grad, which reentrant activation checkpointing "
    "(torch.utils.checkpoint.checkpoint(..., use_reentrant=True)) inside a layer "
    "does not support; checkpoint the layer with use_reentrant=False (or run the "
    "stack with .serial(), plain autograd)"
)


def vjp(
    outputs: State,
    inputs: State,
    cotangent: State,
    params: Sequence[torch.nn.Parameter] = (),
    *,
    retain_graph: bool = True,
) -> tuple[State, list[torch.Tensor | None]]:
    """``(J_u^T w, [J_theta^T w])`` for one recorded layer; unused inputs give zeros."""
    pairs = [
        (y, w)
        for y, w in zip(as_tuple(outputs), as_tuple(cotangent), strict=True)
        if y.requires_grad
    ]
    xs = list(as_tuple(inputs))
    wanted = [x for x in xs if x.requires_grad] + list(params)
    if pairs and wanted:
        try:
            grads = torch.autograd.grad(
                [y for y, _ in pairs],
                wanted,
                [w for _, w in pairs],
                retain_graph=retain_graph,
                allow_unused=True,
            )
        except RuntimeError as err:
            if "use_reentrant" in str(err):
                raise RuntimeError(REENTRANT_CHECKPOINT) from err
            raise
    else:
        grads = (None,) * len(wanted)
    it = iter(grads)
    gx = []
    for x in xs:
        g = next(it) if x.requires_grad else None
        gx.append(torch.zeros_like(x) if g is None else g)
    return like(inputs, gx), list(it)


class AdjointPropagator:
    """Reversed-index adjoint steps over a forward :class:`StepPropagator`'s record.

    Args:
        forward: the forward propagator after a recorded final sweep.
        params: per layer, the parameters whose gradients the final sweep returns.

    After the final sweep :attr:`param_grads` maps ``id(param)`` to its gradient.

    Example:
        >>> from leantrain.layer_parallel import (
        ...     ChunkLayout, LayerRNG, MGRITOptions, StepPropagator, mgrit_solve)
        >>> lin = torch.nn.Linear(2, 2)
        >>> steps = [lambda u, dt: u + dt * torch.tanh(lin(u))] * 4
        >>> rng = LayerRNG(0, enabled=False)
        >>> fwd = StepPropagator(steps, 0.25, 2, rng, record=True)
        >>> layout, opts = ChunkLayout(4, 1, 2, 2), MGRITOptions(2, 2, 2)
        >>> _ = mgrit_solve(fwd, torch.ones(2), layout, opts)
        >>> g, grads, _, _ = adjoint_solve(fwd, torch.ones(2), layout, opts, [[]] * 4)
        >>> g.shape
        torch.Size([2])
    """

    def __init__(
        self, forward: StepPropagator, params: Sequence[Sequence[torch.nn.Parameter]]
    ) -> None:
        self.fwd, self.params = forward, params
        self.n_steps = len(forward.steps)
        self.param_grads: dict[int, torch.Tensor] = {}

    def __call__(self, level: int, m: int, w: State, *, final: bool = False) -> State:
        fwd = self.fwd
        if level == 0:
            n = self.n_steps - m
            if not final:
                with evaluation.auxiliary():  # hooks see only the final sweep
                    return vjp(fwd.outputs[n], fwd.inputs[n], w)[0]
            gx, gp = vjp(fwd.outputs[n], fwd.inputs[n], w, self.params[n])
            for p, g in zip(self.params[n], gp, strict=True):
                if g is not None:
                    old = self.param_grads.get(id(p))
                    self.param_grads[id(p)] = g if old is None else old + g
            return gx
        scale = fwd.cf**level
        n = (self.n_steps // scale - m) * scale
        x = leaf(fwd.inputs[n])
        with evaluation.auxiliary():
            with torch.enable_grad():
                y = run_step(fwd.steps[n], x, scale * fwd.h, n, fwd.rng)
            return vjp(y, x, w, retain_graph=False)[0]


def adjoint_solve(
    forward: StepPropagator,
    grad_output: State,
    layout: ChunkLayout,
    options: MGRITOptions,
    params: Sequence[Sequence[torch.nn.Parameter]],
    *,
    exchange: Exchange | None = None,
    init: Sequence[State] | None = None,
    serial: bool = False,
) -> tuple[State, dict[int, torch.Tensor], list[State], MGRITStats | None]:
    """Adjoint MGRIT: ``(dL/du_0, {id(p): grad}, adjoint trajectory, stats)``.

    The adjoint trajectory is in reversed index order (``[lambda_N, ..., lambda_0]``),
    the form ``init`` takes for a warm start. With an exchange, ``dL/du_0`` is valid
    on the process holding the last adjoint chunk (forward chunk 0). ``serial``
    replaces MGRIT by exact serial stepping, relayed chunk after chunk (stats None).
    """
    local = len(exchange.local_chunks) if exchange is not None else layout.chunks
    expected = layout.per_chunk(0) * local  # this process's layers only
    if len(forward.inputs) != expected:
        raise ValueError(
            "the forward propagator holds no recorded final sweep "
            f"({len(forward.inputs)} of {expected} local layers recorded)"
        )
    prop = AdjointPropagator(forward, params)
    if serial:
        traj = sequential_solve(prop, grad_output, layout, exchange)
        stats = None
    else:
        traj, stats = mgrit_solve(
            prop, grad_output, layout, options, exchange=exchange, init=init
        )
    return traj[-1], prop.param_grads, traj, stats
