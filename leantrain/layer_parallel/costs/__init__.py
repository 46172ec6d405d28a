"""What a layer-parallel step costs: cost models, simulators and measurement tools.

Tooling built on the solver (the solver never imports it): the ideal V-cycle work
(:mod:`.cycle_work`), the critical-path simulators of a training step for MGRIT
(:func:`simulate`, which runs the real solver on a clock) and for pipeline schedules
(:func:`simulate_pipeline`), the projection of both over ranks and depth
(:func:`project`), the measured inputs they take (:mod:`.timing`: layer-step samples,
message costs, a two-process step), the launcher they run on (:func:`run_on_gloo`)
and a phase-by-phase timer of a real step (:func:`profile_phases`). See
docs/layer_parallel.md, "Chunks and the cost model".
"""

from leantrain.layer_parallel.costs.cycle_work import (
    skipped_cycle_work,
    solve_time,
    vcycle_work,
)
from leantrain.layer_parallel.costs.launch import free_port, run_on_gloo
from leantrain.layer_parallel.costs.phase_timer import (
    PhaseTimer,
    charged,
    profile_phases,
)
from leantrain.layer_parallel.costs.projection import (
    Cell,
    MGRITSetting,
    best_pipeline,
    crossover,
    project,
    projection_table,
)
from leantrain.layer_parallel.costs.simulate import (
    CommModel,
    LayerTimes,
    OutsideTimes,
    SimResult,
    simulate,
)
from leantrain.layer_parallel.costs.simulate_pipeline import (
    PipelineResult,
    bubble_fraction,
    simulate_pipeline,
)
from leantrain.layer_parallel.costs.timing import (
    LayerSampler,
    OutsideSampler,
    StackSpec,
    TwoProcessTiming,
    layer_times,
    measure_comm,
    measure_two_process,
    ping,
)

__all__ = [
    "Cell",
    "CommModel",
    "LayerSampler",
    "LayerTimes",
    "MGRITSetting",
    "OutsideSampler",
    "OutsideTimes",
    "PhaseTimer",
    "PipelineResult",
    "SimResult",
    "StackSpec",
    "TwoProcessTiming",
    "best_pipeline",
    "bubble_fraction",
    "charged",
    "crossover",
    "free_port",
    "layer_times",
    "measure_comm",
    "measure_two_process",
    "ping",
    "profile_phases",
    "project",
    "projection_table",
    "run_on_gloo",
    "simulate",
    "simulate_pipeline",
    "skipped_cycle_work",
    "solve_time",
    "vcycle_work",
]
