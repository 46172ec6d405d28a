"""Layer-parallel training: the residual stack as an ODE, solved with MGRIT.

Forward and adjoint are multigrid-reduction-in-time solves over the layers (FAS, FCF
relaxation, injection, tau correction, serial coarsest level); ``LayerParallel`` wraps
them as a drop-in ``nn.Module`` for a model's ``.stack``; ``distribute`` /
``parallelize`` spread it over ranks (a ``dp`` x ``lp`` mesh), ``Controller`` watches
convergence online, ``simulate`` projects step times. See docs/layer_parallel.md.
"""

from leantrain.layer_parallel.adjoint import AdjointPropagator, adjoint_solve, vjp
from leantrain.layer_parallel.comm import (
    DistExchange,
    LayerParallelCommError,
    all_reduce_max,
)
from leantrain.layer_parallel.controller import (
    Controller,
    Decision,
    convergence_factor,
)
from leantrain.layer_parallel.mesh import (
    GradientAverager,
    LayerParallelConfig,
    ParallelDims,
    parallelize,
)
from leantrain.layer_parallel.mgrit import (
    MGRITOptions,
    MGRITStats,
    Propagator,
    mgrit_solve,
    pipeline_solve,
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
from leantrain.layer_parallel.simulate import (
    CommModel,
    LayerTimes,
    OutsideTimes,
    SimResult,
    simulate,
)

__all__ = [
    "AdjointPropagator",
    "ChunkLayout",
    "CommModel",
    "Controller",
    "Decision",
    "DistExchange",
    "Exchange",
    "GradientAverager",
    "LayerParallel",
    "LayerParallelCommError",
    "LayerParallelConfig",
    "LayerParallelStats",
    "LayerTimes",
    "ParallelDims",
    "SimResult",
    "LayerRNG",
    "LocalExchange",
    "MGRITDivergenceError",
    "MGRITOptions",
    "MGRITStats",
    "OutsideTimes",
    "Propagator",
    "State",
    "Step",
    "StepPropagator",
    "adjoint_solve",
    "all_reduce_max",
    "convergence_factor",
    "mgrit_solve",
    "parallelize",
    "pipeline_solve",
    "serial_forward",
    "serial_solve",
    "simulate",
    "skipped_cycle_work",
    "solve_time",
    "vcycle_work",
    "vjp",
]
