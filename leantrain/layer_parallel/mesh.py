"""Data parallel x layer parallel on a 2-D device mesh (``dp`` x ``lp``).

In the style of torchtitan, parallelism is applied by a function that takes the mesh
explicitly: :func:`parallelize` binds every :class:`~.module.LayerParallel` in a model
to the mesh's ``lp`` axis (one contiguous chunk of layers per rank) and averages the
gradients over the ``dp`` axis at the end of every backward pass.

Mesh layout (``init_device_mesh(device, (dp, lp), mesh_dim_names=("dp", "lp"))``):
global rank ``d * lp + r`` is layer chunk ``r`` of data replica ``d``, so an ``lp``
group is ``lp`` consecutive ranks (the rank-to-rank relay stays on neighbouring
devices, usually one node) and a ``dp`` group is every ``lp``-th rank. The ranks of
one ``lp`` group must see the same batch; each ``dp`` replica sees its own.

What each rank averages over ``dp``: the parameters outside the layer-parallel stacks
(embeddings, head: replicated on every rank, identical within an ``lp`` group) and the
parameters of its own layers. The other ranks' layers get no gradient and are never
touched.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from leantrain.layer_parallel._checks import check_int
from leantrain.layer_parallel.module import LayerParallel


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the ``dp`` and ``lp`` mesh axes (validated).

    Args:
        dp: data-parallel replicas.
        lp: layer-parallel ranks per replica (layer chunks).

    Example:
        >>> ParallelDims(dp=2, lp=2).world_size
        4
    """

    dp: int = 1
    lp: int = 1

    def __post_init__(self) -> None:
        check_int("dp", self.dp, 1)
        check_int("lp", self.lp, 1)

    @property
    def world_size(self) -> int:
        """``dp * lp``: the number of processes the mesh needs."""
        return self.dp * self.lp

    def build_mesh(self, device_type: str = "cpu"):
        """The ``(dp, lp)`` DeviceMesh over the initialised default group.

        Raises:
            RuntimeError: without an initialised ``torch.distributed`` process group.
            ValueError: if ``dp * lp`` is not the world size.
        """
        from torch.distributed.device_mesh import init_device_mesh

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "a layer-parallel mesh needs an initialised torch.distributed process "
                "group (torch.distributed.init_process_group, e.g. under torchrun)"
            )
        world = dist.get_world_size()
        if world != self.world_size:
            raise ValueError(
                f"dp * lp = {self.dp} * {self.lp} = {self.world_size} must equal the "
                f"world size {world}"
            )
        return init_device_mesh(
            device_type, (self.dp, self.lp), mesh_dim_names=("dp", "lp")
        )


@dataclass(frozen=True)
class LayerParallelConfig:
    """How :func:`parallelize` applies layer and data parallelism.

    Args:
        timeout: seconds any layer-parallel wait may take before it raises
            (None: 300).
        average_gradients: average gradients over ``dp`` after each backward.
    """

    timeout: float | None = None
    average_gradients: bool = True


class GradientAverager:
    """Averages the gradients of ``params`` over ``group`` once per backward pass.

    A post-accumulate-grad hook on every parameter queues one callback at the end
    of the backward pass; it flattens all gradients (zeros for a parameter that got
    none), does one ``all_reduce`` and divides by the group size. Every rank of the
    group must hold the same list of parameters (same shapes, same order).

    Args:
        params: the parameters to average (those this rank trains).
        group: the data-parallel process group.

    Example:
        >>> avg = GradientAverager(model.parameters(), dp_group)  # doctest: +SKIP
        >>> loss.backward()  # doctest: +SKIP
    """

    def __init__(self, params: Iterable[nn.Parameter], group) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.size = dist.get_world_size(group)
        self._queued = False
        self._handles = [
            p.register_post_accumulate_grad_hook(self._hook) for p in self.params
        ]

    def _hook(self, _param: torch.Tensor) -> None:
        if not self._queued:
            self._queued = True
            engine = torch.autograd.Variable._execution_engine
            engine.queue_callback(self.average)

    def average(self) -> None:
        """All-reduce and average the gradients now (the end-of-backward callback)."""
        self._queued = False
        if not self.params:
            return
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        flat /= self.size
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n

    def remove(self) -> None:
        """Stop averaging (removes the hooks)."""
        for h in self._handles:
            h.remove()
        self._handles = []


def _groups(mesh) -> tuple[object | None, object]:
    names = tuple(mesh.mesh_dim_names or ())
    if "lp" not in names:
        raise ValueError(f"the mesh needs an 'lp' axis, got axes {names}")
    extra = set(names) - {"dp", "lp"}
    if extra:
        raise ValueError(f"only 'dp' and 'lp' axes are supported, got {names}")
    lp = mesh["lp"].get_group() if len(names) > 1 else mesh.get_group()
    dp = mesh["dp"].get_group() if "dp" in names else None
    return dp, lp


def parallelize(
    model: nn.Module, mesh, *, config: LayerParallelConfig | None = None
) -> nn.Module:
    """Apply layer parallelism over ``mesh['lp']`` and data parallelism over ``dp``.

    Args:
        model: a module containing one or more :class:`LayerParallel` stacks.
        mesh: a DeviceMesh with axes ``("dp", "lp")`` or just ``("lp",)``.
        config: timeouts and gradient averaging.

    This is the one way to run a layer-parallel model over several processes; a
    :class:`~leantrain.layer_parallel.controller.Controller` on the model then decides
    over the same mesh. With every rank on the ``lp`` axis the mesh is
    ``ParallelDims(lp=world_size).build_mesh()``.

    Returns:
        ``model`` itself (changed in place); each stack's ``mesh`` is ``mesh``, and
        ``model.gradient_averager`` holds the :class:`GradientAverager` when
        ``dp > 1``.

    Raises:
        ValueError: if the model has no LayerParallel or the mesh lacks ``lp``.
        TypeError: if ``model`` is not an ``nn.Module``.

    Example:
        >>> mesh = ParallelDims(dp=2, lp=2).build_mesh()  # doctest: +SKIP
        >>> model.stack = LayerParallel(model.stack, cf=4)  # doctest: +SKIP
        >>> parallelize(model, mesh)  # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    config = config if config is not None else LayerParallelConfig()
    stacks = [m for m in model.modules() if isinstance(m, LayerParallel)]
    if not stacks:
        raise ValueError(
            f"{type(model).__name__} contains no LayerParallel module; replace its "
            "stack first (model.stack = LayerParallel(model.stack, ...))"
        )
    dp, lp = _groups(mesh)
    timeout = config.timeout
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    for stack in stacks:
        stack._distribute(lp, mesh, timeout=timeout)
    if dp is not None and dist.get_world_size(dp) > 1 and config.average_gradients:
        in_stacks = {id(p) for s in stacks for p in s.parameters()}
        params = [p for p in model.parameters() if id(p) not in in_stacks]
        params += [p for s in stacks for p in s.local_parameters()]
        model.gradient_averager = GradientAverager(params, dp)
    return model
