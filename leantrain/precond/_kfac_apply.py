r"""How K-FAC writes a preconditioned gradient into ``.grad``, and saves its inverses.

The output-gradient shortcut of
:class:`~leantrain.precond.methods.kfac.KfacGradientMaker`: a plain ``nn.Linear``
whose weight gradient was skipped (``_output_grad_shortcut.py``) gets
``(B^{-1} E^T)([X, 1] A^{-1})`` from its output-gradients ``E`` and inputs ``X``,
with cached inverses, Cholesky factors (:func:`write_shortcut`) or the inverse
operators of low-rank factors (:func:`write_operators`, ``_gram.py``).
:func:`inverse_state` / :func:`inverses_from_state` flatten the maker's inverses
for ``state_dict`` and back.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from leantrain.precond._gram import GramInverse, right_solve

__all__ = [
    "inverse_state",
    "inverses_from_state",
    "split_inverse",
    "write_shortcut",
    "write_operators",
]


def split_inverse(a: Tensor, k: int) -> tuple[Tensor, ...]:
    """``A^{-1}`` of a layer with ``k`` inputs and a bias, cut once into contiguous
    pieces: ``(A^{-1}[:k, :k], A^{-1}[k, :k], A^{-1}[:k, k], A^{-1}[k, k])``.

    The weight block as a strided view of the ``(k+1)``-wide inverse made every
    step's matmuls slower, and the slicing itself cost a few calls a step; a
    preconditioner is reused for ``preconditioner_interval`` steps.
    """
    return (
        a[:k, :k].contiguous(),
        a[k, :k].contiguous(),
        a[:k, k].contiguous(),
        a[k, k].clone(),
    )


def write_shortcut(
    op: Any,
    x: Tensor,
    e: Tensor,
    a: Tensor | None = None,
    b: Tensor | None = None,
    *,
    cholesky: bool = False,
    a_parts: tuple[Tensor, ...] | None = None,
) -> None:
    r"""``.grad`` of a Linear from its inputs ``x`` ``(N, J)`` and output-gradients
    ``e`` ``(N, R)``: ``(B^{-1} E^T)([X, 1] A^{-1})`` split into weight and bias, or
    the plain ``E^T [X, 1]`` without ``a`` and ``b``. Equals ``B^{-1} G A^{-1}``
    with ``G = E^T [X, 1]``
    (see :func:`~leantrain.precond._output_grad_shortcut.shortcut_is_cheaper`).
    ``a`` and ``b`` are the damped inverses, or with ``cholesky`` their lower
    Cholesky factors (applied by triangular solves). ``a_parts``: ``a`` already
    cut by :func:`split_inverse` (layers with a bias), in ``x``'s dtype.
    """
    params = op.params
    dtype = params[0].dtype
    x, e = x.to(dtype), e.to(dtype)
    k = x.shape[1]
    if a is None or b is None:
        left, right = e.T, x
        bias = e.sum(0)
    elif cholesky:
        if len(params) == 2:
            x = torch.cat([x, x.new_ones(x.shape[0], 1)], dim=1)
        left = right_solve(e, b).T  # (R, N)
        right = right_solve(x, a)  # (N, U)
        bias = left @ right[:, k] if len(params) == 2 else None
        right = right[:, :k]
    else:
        left = b.to(dtype) @ e.T  # (R, N)
        if len(params) == 2:  # [X, 1] A^{-1} = X A^{-1}[:k] + 1 A^{-1}[k]
            a_w, a_row, a_col, a_kk = a_parts or split_inverse(a.to(dtype), k)
            right = torch.addmm(a_row, x, a_w)
            bias = left @ torch.addmv(a_kk.expand(x.shape[0]), x, a_col)
        else:
            right = x @ a.to(dtype)
    params[0].grad = left @ right
    if len(params) == 2:
        params[1].grad = bias


def write_operators(op: Any, x: Tensor, e: Tensor, a_inv: Any, b_inv: Any) -> None:
    r"""``.grad`` of a Linear from its inputs ``x`` ``(N, J)`` and output-gradients
    ``e`` ``(N, R)`` with inverse operators (``_gram.py``): ``(B^{-1} E^T)([X, 1]
    A^{-1})``. A Gram-matrix ``A^{-1}`` was built from these very inputs (the
    curvature pass is the step's own pass), so ``[X, 1] A^{-1}`` is its
    :meth:`~leantrain.precond._gram.GramInverse.rows_times_inverse`."""
    params = op.params
    dtype = params[0].dtype
    k = x.shape[1]
    left = b_inv.left(e.to(dtype).T)  # (R, N)
    if isinstance(a_inv, GramInverse):
        if a_inv.n_rows != x.shape[0]:
            raise RuntimeError("the low-rank input factor is not this pass's inputs")
        right = a_inv.rows_times_inverse().to(dtype)
    else:
        x = x.to(dtype)
        if len(params) == 2:
            x = torch.cat([x, x.new_ones(x.shape[0], 1)], dim=1)
        right = a_inv.right(x)  # (N, U)
    params[0].grad = left @ right[:, :k]
    if len(params) == 2:
        params[1].grad = left @ right[:, k]


def inverse_state(inverses_by_module: dict[str, dict[str, Any]]) -> dict[str, Tensor]:
    """The preconditioner as a flat ``{key: tensor}`` map for ``state_dict``."""
    inverses: dict[str, Tensor] = {}
    for name, inv in inverses_by_module.items():
        if inv.get("operators"):
            # Rebuilt from this step's batch before every use (interval 1):
            # nothing of them is needed to resume.
            continue
        if "unit" in inv:
            inverses[f"{name}/U"] = inv["unit"]
            continue
        suffix = "/cholesky" if inv.get("cholesky") else ""
        for key in ("A", "B"):
            for i, item in enumerate(inv[key]):
                if isinstance(item, tuple):
                    inverses[f"{name}/{key}{i}/values"] = item[0]
                    inverses[f"{name}/{key}{i}/vectors"] = item[1]
                else:
                    inverses[f"{name}/{key}{i}{suffix}"] = item
    return inverses


def inverses_from_state(tensors: dict[str, Tensor]) -> dict[str, dict[str, Any]]:
    """Inverse of :func:`inverse_state` (tensors are copied)."""
    inverses: dict[str, dict[str, Any]] = {}
    pending: dict[tuple[str, str, int], dict[str, Tensor]] = {}
    for key, value in tensors.items():
        parts = key.split("/")
        if parts[-1] == "cholesky":  # a Cholesky factor (preconditioner interval 1)
            parts = parts[:-1]
            inverses.setdefault("/".join(parts[:-1]), {"A": {}, "B": {}})[
                "cholesky"
            ] = True
        if parts[-1] in ("values", "vectors"):
            name, slot, which = "/".join(parts[:-2]), parts[-2], parts[-1]
            pending.setdefault((name, slot[0], int(slot[1:])), {})[which] = value
            continue
        name, slot = "/".join(parts[:-1]), parts[-1]
        if slot == "U":
            inverses[name] = {"unit": value.clone()}
        else:
            entry = inverses.setdefault(name, {"A": {}, "B": {}})
            entry[slot[0]][int(slot[1:])] = value.clone()
    for (name, side, i), pair in pending.items():
        entry = inverses.setdefault(name, {"A": {}, "B": {}})
        entry[side][i] = (pair["values"].clone(), pair["vectors"].clone())
    for entry in inverses.values():
        for side in ("A", "B"):
            if side in entry:
                entry[side] = [entry[side][i] for i in range(len(entry[side]))]
    return inverses
