"""``leantrain compare``: leantrain's optimizers, preconditioners and depth
parallelism measured against their baselines, as tables and plots.

The benchmark application behind the ``leantrain compare`` command (its packages,
tqdm, matplotlib and scikit-learn, are the ``compare`` extra:
``pip install "leantrain[compare]"``). Its modules, one concept each:

* :mod:`~leantrain.compare.cli`: the command's options and dispatch;
* :mod:`~leantrain.compare.optimizers`: every optimizer compared, one name each
  (:data:`OPTIMIZERS`), and the lists the command offers (:data:`VARIANTS`,
  :data:`PEERS`); :mod:`~leantrain.compare.measure`: state bytes and step memory;
  :mod:`~leantrain.compare.optimizer_step`: one optimizer step of several
  contenders timed over a model's parameter shapes, CPU or CUDA (what
  ``benchmarks/gefen_step.py`` prints and the GPU check's optimizer-step section);
  :mod:`~leantrain.compare.precond_step`: a preconditioned step that refreshes
  nothing, the steps that refresh, and the mean step of a run on the registry's
  schedule (``benchmarks/precond_step.py`` and the GPU check's preconditioning
  section);
* :mod:`~leantrain.compare.tasks`: the seeded models and data (:data:`TASKS`);
  :mod:`~leantrain.compare.training`: the training loop (:func:`train_one`);
  :mod:`~leantrain.compare.lr`: the warm-up and cosine decay of the learning rate;
* the single-model comparisons: :mod:`~leantrain.compare.single_model`,
  :mod:`~leantrain.compare.peers` (``--peers``), :mod:`~leantrain.compare.precond`
  (``--precond``);
* the axes: :mod:`~leantrain.compare.axes` (:data:`AXES`) over
  :mod:`~leantrain.compare.memory`, :mod:`~leantrain.compare.curvature` and
  :mod:`~leantrain.compare.depth` (on one GPU timed by
  :mod:`~leantrain.compare.depth_device`), their runs launched on worker processes
  by :mod:`~leantrain.compare.jobs`; :mod:`~leantrain.compare.devices`: the device
  (``--device``), the clock that waits for it, and the axes' sizes on it;
* :mod:`~leantrain.compare.report`: the printed table and the files;
  :mod:`~leantrain.compare.stats`: the seed-to-seed interval of paired ratios.
"""

from leantrain.compare.axes import AXES, run_axes
from leantrain.compare.lr import warmup_cosine
from leantrain.compare.measure import measured_step, state_nbytes
from leantrain.compare.optimizers import (
    OPTIMIZERS,
    PEERS,
    VARIANTS,
    OptimizerEntry,
)
from leantrain.compare.single_model import run_compare
from leantrain.compare.stats import ratio_interval
from leantrain.compare.tasks import TASKS, Task, TaskSpec, evaluate, resolve_defaults
from leantrain.compare.training import RunResult, train_one

__all__ = [
    "AXES",
    "OPTIMIZERS",
    "PEERS",
    "TASKS",
    "VARIANTS",
    "OptimizerEntry",
    "RunResult",
    "Task",
    "TaskSpec",
    "evaluate",
    "measured_step",
    "ratio_interval",
    "resolve_defaults",
    "run_axes",
    "run_compare",
    "state_nbytes",
    "train_one",
    "warmup_cosine",
]
