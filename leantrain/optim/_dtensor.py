"""DTensor predicates, below every other module of ``leantrain.optim``.

Whether a tensor is a DTensor, its local tensor, and whether it is split across
ranks: ``_options`` (the "auto" second moment), the step's bookkeeping
(``_base``) and ``_dist`` (the collectives) all ask, so the answers live here,
importing nothing of leantrain (``_dist`` imports ``_sharded``, which imports the
step's math and its options).
"""

from __future__ import annotations

import sys

from torch import Tensor


def is_dtensor(t: object) -> bool:
    """True for a DTensor (FSDP2 parameters and gradients).

    A DTensor exists only once ``torch.distributed.tensor`` is imported, so this
    module never imports it itself (that import costs seconds at start-up).
    """
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local(t: Tensor) -> Tensor:
    """The rank's local tensor of a DTensor (shares storage), or ``t`` itself."""
    return t.to_local() if is_dtensor(t) else t


def dtensor_api():
    """``torch.distributed.tensor`` (DTensor, Shard, Replicate), imported on use."""
    import torch.distributed.tensor as api

    return api


def _check_layout(param: Tensor) -> None:
    api = dtensor_api()
    mesh, placements = param.device_mesh, tuple(param.placements)
    allowed = ((api.Shard(0),), (api.Replicate(),))
    ok = mesh.ndim == 1 and placements in allowed
    if not ok:
        raise ValueError(
            f"Gefen supports DTensor parameters on a 1-D mesh with placements "
            f"(Shard(dim=0),) (FSDP2) or (Replicate(),); got mesh shape "
            f"{tuple(mesh.shape)} and placements {placements}"
        )


def is_sharded(param: Tensor) -> bool:
    """True when ``param`` is a DTensor split across ranks (Shard(0))."""
    if not is_dtensor(param):
        return False
    _check_layout(param)
    shard0 = (dtensor_api().Shard(0),)
    return tuple(param.placements) == shard0 and param.device_mesh.size() > 1
