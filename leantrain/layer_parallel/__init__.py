"""Layer-parallel training: the residual stack as an ODE, solved with MGRIT.

Forward and adjoint are multigrid-reduction-in-time solves over the layers (FAS, FCF
relaxation, injection, tau correction, serial coarsest level); ``LayerParallel`` wraps
them as a drop-in ``nn.Module`` for a model's ``.stack``; ``parallelize(model, mesh)``
spreads it over ranks (a ``dp`` x ``lp`` mesh), ``Controller`` watches convergence
online. The cost models and measurement tools (step-time simulation, timers,
projections) are :mod:`leantrain.layer_parallel.costs`. See docs/layer_parallel.md.
"""

from leantrain.layer_parallel.adjoint import adjoint_solve
from leantrain.layer_parallel.comm import LayerParallelCommError
from leantrain.layer_parallel.controller import (
    Controller,
    Decision,
    convergence_factor,
)
from leantrain.layer_parallel.layout import ChunkLayout
from leantrain.layer_parallel.mesh import (
    GradientAverager,
    LayerParallelConfig,
    ParallelDims,
    parallelize,
)
from leantrain.layer_parallel.mgrit import (
    MGRITOptions,
    MGRITStats,
    mgrit_solve,
    sequential_solve,
    serial_solve,
)
from leantrain.layer_parallel.module import (
    LayerParallel,
    LayerParallelStats,
    MGRITDivergenceError,
)
from leantrain.layer_parallel.ode import LayerRNG, StepPropagator, serial_forward

# The functional solvers take a ChunkLayout and a propagator (StepPropagator over a
# list of blocks, with its LayerRNG), so those are public too; the exchanges and
# other plumbing stay importable from their modules.
__all__ = [
    "ChunkLayout",
    "Controller",
    "Decision",
    "GradientAverager",
    "LayerParallel",
    "LayerParallelCommError",
    "LayerParallelConfig",
    "LayerParallelStats",
    "LayerRNG",
    "MGRITDivergenceError",
    "MGRITOptions",
    "MGRITStats",
    "ParallelDims",
    "StepPropagator",
    "adjoint_solve",
    "convergence_factor",
    "mgrit_solve",
    "parallelize",
    "sequential_solve",
    "serial_forward",
    "serial_solve",
]
