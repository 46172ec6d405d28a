"""GefenMuon's parameter routing: which parameters Muon takes, which AdamW does.

:func:`muon_param_groups` splits a model for :class:`~leantrain.optim.GefenMuon`;
the helpers read the parameter lists torch accepts (tensors or ``(name, tensor)``
pairs, never sets).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor, nn

# The options of an AdamW-side group and the Muon-group key each one replaces.
ADAMW_KEYS = {"lr": "adamw_lr", "betas": "adamw_betas", "eps": "adamw_eps"}
ADAMW_KEYS["weight_decay"] = "adamw_weight_decay"


def muon_param_groups(
    model: nn.Module, *, adamw_modules: Iterable[nn.Module] = ()
) -> list[dict]:
    """Splits a model's parameters into a Muon group and an AdamW group.

    Muon is meant for hidden-layer matrices. The AdamW group gets every parameter
    that is not 2-D, the weights of every ``nn.Embedding``, and all parameters of the
    modules in ``adamw_modules`` (pass the output head here, e.g.
    ``[model.lm_head]``; a head cannot be recognized from its shape alone).

    Returns:
        ``[{"params": [...], "use_muon": True}, {"params": [...], "use_muon": False}]``
        (a group with no parameters is left out), for :class:`GefenMuon`.

    Example:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4))
        >>> groups = muon_param_groups(model)
        >>> [len(g["params"]) for g in groups]
        [1, 2]
    """
    adamw: dict[int, Tensor] = {}
    for module in list(adamw_modules) + [
        m for m in model.modules() if isinstance(m, nn.Embedding)
    ]:
        for p in module.parameters():
            adamw[id(p)] = p
    muon, other = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (other if id(p) in adamw or p.ndim != 2 else muon).append(p)
    groups = [{"params": muon, "use_muon": True}, {"params": other, "use_muon": False}]
    return [g for g in groups if g["params"]]


def items_of(params: object) -> list:
    if isinstance(params, Tensor):
        return [params]
    if isinstance(params, set):
        raise TypeError(
            "optimizer parameters need to be organized in ordered "
            "collections, but the ordering of tensors in sets will "
            "change between runs. Please use a list instead."
        )
    return list(params)


def tensor_of(item: object) -> object:
    # torch accepts (name, param) pairs; the tensor decides the routing.
    return item[1] if isinstance(item, tuple) else item
