"""Optimizer state memory, measured from the tensors an optimizer actually holds.

Works for any ``torch.optim.Optimizer`` (Gefen, AdamW, SGD, ...): it walks
``optimizer.state`` and counts the bytes of every tensor storage once, so a tensor
shared by many parameters (Gefen's codebook) or two views of one buffer are not
counted twice, and 0-dim bookkeeping tensors (``step``) are counted like torch
allocates them.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator

from torch import Tensor
from torch.optim import Optimizer

__all__ = ["bytes_per_param", "optimizer_state_nbytes"]


def _tensors(value: object) -> Iterator[Tensor]:
    """Yields every tensor inside a state value (tensors, dicts, lists, tuples)."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _storage_key(tensor: Tensor) -> tuple:
    storage = tensor.untyped_storage()
    # data_ptr identifies a live allocation on its device; empty storages all
    # have pointer 0 and size 0, so merging them changes nothing.
    return (str(tensor.device), storage.data_ptr())


def optimizer_state_nbytes(optimizer: Optimizer) -> int:
    """Bytes of every state tensor ``optimizer`` holds, each storage counted once.

    Args:
        optimizer: any torch optimizer.

    Returns:
        The total ``nbytes`` of the distinct storages under ``optimizer.state``.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.

    Example:
        >>> import torch
        >>> p = torch.nn.Parameter(torch.zeros(1000))
        >>> opt = torch.optim.AdamW([p])
        >>> p.grad = torch.ones(1000)
        >>> opt.step()
        >>> optimizer_state_nbytes(opt)  # exp_avg + exp_avg_sq (fp32) + step
        8004
    """
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    sizes: dict[tuple, int] = {}
    for tensor in _tensors(list(optimizer.state.values())):
        sizes[_storage_key(tensor)] = tensor.untyped_storage().nbytes()
    return sum(sizes.values())


def _unique_params(groups: Iterable[dict]) -> Iterator[Tensor]:
    seen: set[int] = set()
    for group in groups:
        for param in group["params"]:
            if id(param) not in seen:
                seen.add(id(param))
                yield param


def bytes_per_param(optimizer: Optimizer) -> float:
    """State bytes per parameter element: ``optimizer_state_nbytes / numel``.

    Every parameter in the optimizer's groups counts, stepped or not, so call it
    after a step in which every parameter had a gradient. Optimizers create their
    state lazily, at a parameter's first step (Gefen's layout even depends on that
    first gradient), so parameters without state yet count as zero bytes and a
    ``UserWarning`` says how many elements that is.

    Raises:
        ValueError: the optimizer holds no parameter elements.
    """
    params = list(_unique_params(optimizer.param_groups))
    numel = sum(p.numel() for p in params)
    if numel == 0:
        raise ValueError("bytes_per_param: the optimizer holds no parameter elements")
    stateless = sum(p.numel() for p in params if not optimizer.state.get(p))
    if stateless:
        when = "before the first step" if stateless == numel else "so far"
        warnings.warn(
            f"bytes_per_param: {stateless} of {numel} parameter elements have no "
            f"optimizer state yet ({when}; state is created at a parameter's first "
            "step), so they count as 0 bytes: call it after a step in which every "
            "parameter had a gradient",
            UserWarning,
            stacklevel=2,
        )
    return optimizer_state_nbytes(optimizer) / numel
