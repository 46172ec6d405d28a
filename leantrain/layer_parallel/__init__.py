"""Layer-parallel training: the residual stack as an ODE, solved with MGRIT.

Forward and adjoint are multigrid-reduction-in-time solves over the layers (FAS, FCF
relaxation, injection, tau correction, serial coarsest level); ``LayerParallel`` wraps
them as a drop-in ``nn.Module`` for a model's ``.stack``. See docs/layer_parallel.md.
"""

from leantrain.layer_parallel.adjoint import AdjointPropagator, adjoint_solve, vjp
from leantrain.layer_parallel.mgrit import (
    MGRITOptions,
    MGRITStats,
    Propagator,
    mgrit_solve,
    serial_solve,
)
from leantrain.layer_parallel.module import (
    LayerParallel,
    LayerParallelStats,
    MGRITDivergenceError,
)
from leantrain.layer_parallel.ode import (
    LayerRNG,
    State,
    Step,
    StepPropagator,
    serial_forward,
)
from leantrain.layer_parallel.schedule import (
    ChunkLayout,
    Exchange,
    LocalExchange,
    skipped_cycle_work,
    solve_time,
    vcycle_work,
)

__all__ = [
    "AdjointPropagator",
    "ChunkLayout",
    "Exchange",
    "LayerParallel",
    "LayerParallelStats",
    "LayerRNG",
    "LocalExchange",
    "MGRITDivergenceError",
    "MGRITOptions",
    "MGRITStats",
    "Propagator",
    "State",
    "Step",
    "StepPropagator",
    "adjoint_solve",
    "mgrit_solve",
    "serial_forward",
    "serial_solve",
    "skipped_cycle_work",
    "solve_time",
    "vcycle_work",
    "vjp",
]
