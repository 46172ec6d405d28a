r"""The functional entry point :func:`curvature`.

See ``docs/curvature.md`` for the conventions (scaling of each kind, Kronecker factors,
weight sharing).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ._selection import build_ops, resolve_ignored
from .extension import CurvatureCollector, check_shape
from .kinds import LossSpec, as_loss_spec, check_kind, loss_value, output_vectors
from .modules import ModuleOp
from .representations import Curvature, KronFactor, ModuleCurvature

__all__ = ["curvature", "user_loss"]


def user_loss(
    loss_fn: object, spec: LossSpec, output: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """The loss exactly as the user computes it.

    A loss module is called itself (cross-entropy on ``(N, ..., C)`` outputs with the
    positions flattened into the batch); a name uses the equivalent functional form.
    """
    if isinstance(loss_fn, nn.Module):
        loss_value(spec, output, targets)  # validates shapes with clear errors
        if spec.name == "cross_entropy":
            classes = output.shape[-1]
            return loss_fn(output.reshape(-1, classes), targets.reshape(-1))
        return loss_fn(output, targets)
    return loss_value(spec, output, targets)


def _call(model: nn.Module, inputs: object) -> torch.Tensor:
    out = model(*inputs) if isinstance(inputs, (tuple, list)) else model(inputs)
    if not isinstance(out, torch.Tensor):
        raise TypeError(
            "the model must return one tensor (the output the loss takes), got "
            f"{type(out).__name__}; wrap the model to select it"
        )
    return out


def curvature(
    model: nn.Module,
    loss_fn: nn.Module | str,
    inputs: torch.Tensor | tuple | list,
    targets: torch.Tensor,
    *,
    kind: str,
    shape: str,
    n_mc_samples: int = 1,
    generator: torch.Generator | None = None,
    ignore_modules: Iterable = (),
) -> Curvature:
    r"""Curvature of ``loss_fn(model(inputs), targets)`` w.r.t. the model parameters.

    Args:
        model: network returning one output tensor with the batch first. Modules that
            own trainable parameters must be supported (Linear and subclasses,
            Conv2d, Embedding, LayerNorm, BatchNorm1d/2d in eval mode,
            MultiheadAttention) or listed in ``ignore_modules``.
        loss_fn: ``nn.CrossEntropyLoss`` / ``nn.MSELoss`` (reduction "mean" or
            "sum"), or ``"cross_entropy"`` / ``"mse"`` (reduction "mean").
            Cross-entropy takes outputs ``(N, ..., C)`` and class-index targets
            ``(N, ...)``; positions are flattened into the batch.
        inputs: the model input, or a tuple/list of positional inputs.
        targets: the loss targets.
        kind: ``"fisher_exact"``, ``"fisher_mc"``, ``"fisher_emp"``, ``"ggn"`` or
            ``"hessian"``.
        shape: ``"full"``, ``"layer"``, ``"kron"``, ``"unit"`` or ``"diag"``.
        n_mc_samples: draws for ``"fisher_mc"`` (the result is their average).
        generator: random generator for ``"fisher_mc"``, on the output's device.
        ignore_modules: module instances, classes or names to skip (whole subtrees).

    Returns:
        A :class:`Curvature`; ``.to_dense()`` is ``(P, P)`` in ``model.parameters()``
        order over the parameters that require grad.

    Raises:
        ValueError / TypeError: bad kind, shape, loss, targets, ``n_mc_samples``,
            unsupported modules, BatchNorm in training mode (non-Hessian kinds), or
            ``kind="hessian"`` with ``shape="kron"``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    check_kind(kind)
    check_shape(shape)
    spec = as_loss_spec(loss_fn)
    if (
        not isinstance(n_mc_samples, int)
        or isinstance(n_mc_samples, bool)
        or (n_mc_samples < 1)
    ):
        raise ValueError(f"n_mc_samples must be an int >= 1, got {n_mc_samples!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            "generator must be a torch.Generator or None, got "
            f"{type(generator).__name__}"
        )
    if kind == "hessian":
        return _hessian(model, loss_fn, spec, inputs, targets, shape, ignore_modules)
    collector = CurvatureCollector(
        model, shapes=(shape,), ignore_modules=ignore_modules
    )
    with torch.enable_grad(), collector:
        output = _call(model, inputs)
        vectors = output_vectors(
            kind, spec, output, targets, n_mc_samples=n_mc_samples, generator=generator
        )
        collector.accumulate(output, vectors)
    stats = collector.statistics()
    parts = {}
    for name, op in collector.ops.items():
        index = collector.index[name]
        if shape == "full":
            full = collector.full
            if full is None:
                full = _zeros(collector.params, collector.numel)
            block = full[index.unsqueeze(-1), index.unsqueeze(-2)]
            parts[name] = ModuleCurvature(name, op.module, shape, index, block=block)
        else:
            parts[name] = _from_stats(op, shape, index, stats[name])
    full = None
    if shape == "full":
        full = collector.full
        if full is None:
            full = _zeros(collector.params, collector.numel)
    return Curvature(kind, shape, collector.params, parts, full)


def _zeros(params: list, numel: int) -> torch.Tensor:
    ref = params[0] if params else torch.zeros(())
    return ref.new_zeros(numel, numel)


def _module_zeros(op: ModuleOp) -> torch.Tensor:
    return op.params[0].new_zeros(())


def _from_stats(op: ModuleOp, shape: str, index: torch.Tensor, stats: dict):
    zero = _module_zeros(op)
    part = ModuleCurvature(op.name, op.module, shape, index)
    rows, units = op.canon_index.shape
    if shape == "diag":
        canon = stats.get("diag", zero.new_zeros(rows, units))
        diagonal = zero.new_zeros(op.numel)
        diagonal[op.canon_index.reshape(-1)] = canon.reshape(-1).to(zero.dtype)
        part.diagonal = diagonal
    elif shape == "layer":
        part.block = stats.get("layer", zero.new_zeros(op.numel, op.numel))
    elif shape == "unit" or (shape == "kron" and not op.kron_capable):
        part.units = stats.get("unit", zero.new_zeros(rows, units, units))
        part.unit_index = op.canon_index
    else:  # kron
        if "A" not in stats:  # the module never ran: its curvature is zero
            a = zero.new_zeros(units, units)
            part.kron = [KronFactor(a, zero.new_zeros(rows, rows), op.canon_index)]
            return part
        for a, b, sl in zip(stats["A"], stats["B"], stats["rows"], strict=True):
            size = sl.stop - sl.start
            b = b if b is not None else a.new_zeros(size, size)
            part.kron.append(KronFactor(a, b, op.canon_index[sl]))
    return part


def dense_to_parts(
    matrix: torch.Tensor, ops: dict[str, ModuleOp], index: dict, shape: str
) -> dict[str, ModuleCurvature]:
    """Cut the kept blocks of a dense ``(P, P)`` matrix into per-module parts."""
    parts = {}
    for name, op in ops.items():
        idx = index[name]
        block = matrix[idx.unsqueeze(-1), idx.unsqueeze(-2)]
        part = ModuleCurvature(name, op.module, shape, idx)
        if shape in ("full", "layer"):
            part.block = block
        elif shape == "diag":
            part.diagonal = block.diagonal().clone()
        else:
            ci = op.canon_index
            part.units = block[ci.unsqueeze(-1), ci.unsqueeze(-2)]
            part.unit_index = ci
        parts[name] = part
    return parts


def _hessian(model, loss_fn, spec, inputs, targets, shape, ignore_modules) -> Curvature:
    if shape == "kron":
        raise ValueError(
            "kind='hessian' has no Kronecker-factored form; allowed shapes: 'full', "
            "'layer', 'unit', 'diag' (or use kind='ggn' for 'kron')"
        )
    ignored = resolve_ignored(model, ignore_modules)
    ops = build_ops(model, ignored)
    params = [p for p in model.parameters() if p.requires_grad]
    offsets, start = {}, 0
    for p in params:
        offsets[id(p)] = start
        start += p.numel()
    index = {
        name: torch.cat(
            [
                torch.arange(p.numel(), device=p.device) + offsets[id(p)]
                for p in op.params
            ]
        )
        for name, op in ops.items()
    }
    tracked = [p for op in ops.values() for p in op.params]
    matrix = _zeros(params, start)
    if tracked:
        with torch.enable_grad():
            loss = user_loss(loss_fn, spec, _call(model, inputs), targets)
            grads = torch.autograd.grad(
                loss, tracked, create_graph=True, allow_unused=True
            )
            flat = torch.cat(
                [
                    (g if g is not None else torch.zeros_like(p)).reshape(-1)
                    for g, p in zip(grads, tracked, strict=True)
                ]
            )
            columns = _hessian_columns(flat, tracked)
        pos = torch.cat([index[name] for name in ops])
        matrix[pos.unsqueeze(-1), pos.unsqueeze(-2)] = columns
        # torch zeroes the gradient of padding rows (so their Hessian rows vanish but
        # not their columns): they are not trained, so drop both; then symmetrize.
        frozen = _frozen_entries(ops, index)
        matrix[frozen] = 0.0
        matrix[:, frozen] = 0.0
        matrix = 0.5 * (matrix + matrix.T)
    parts = dense_to_parts(matrix, ops, index, shape)
    return Curvature(
        "hessian", shape, params, parts, matrix if shape == "full" else None
    )


def _hessian_columns(flat_grad: torch.Tensor, tracked: list) -> torch.Tensor:
    """Rows ``d g_j / d theta`` of the Hessian of the tracked parameters.

    Hessian-vector products with unit vectors, batched through ``is_grads_batched``
    (vmap over the double backward); a plain loop when an op has no batching rule.
    """
    n = flat_grad.numel()
    if not flat_grad.requires_grad:  # the loss is linear in the parameters
        return flat_grad.new_zeros(n, n)

    def flat(hv: tuple, lead: tuple) -> torch.Tensor:
        return torch.cat(
            [
                (h if h is not None else p.new_zeros(*lead, *p.shape)).reshape(
                    *lead, -1
                )
                for h, p in zip(hv, tracked, strict=True)
            ],
            dim=-1,
        )

    eye = torch.eye(n, dtype=flat_grad.dtype, device=flat_grad.device)
    rows = []
    try:
        for start in range(0, n, 64):
            chunk = eye[start : start + 64]
            hv = torch.autograd.grad(
                flat_grad,
                tracked,
                grad_outputs=chunk,
                retain_graph=True,
                allow_unused=True,
                is_grads_batched=True,
            )
            rows.append(flat(hv, (chunk.shape[0],)))
    except RuntimeError:
        rows = []
        for j in range(n):
            hv = torch.autograd.grad(
                flat_grad,
                tracked,
                grad_outputs=eye[j],
                retain_graph=True,
                allow_unused=True,
            )
            rows.append(flat(hv, ()).unsqueeze(0))
    return torch.cat(rows, dim=0)


def _frozen_entries(ops: dict, index: dict) -> torch.Tensor:
    """Global positions torch never updates: Embedding rows at ``padding_idx``."""
    frozen = []
    for name, op in ops.items():
        module = op.module
        if isinstance(module, nn.Embedding) and module.padding_idx is not None:
            dim = module.embedding_dim
            start = module.padding_idx * dim
            frozen.append(index[name][start : start + dim])
    return torch.cat(frozen) if frozen else torch.empty(0, dtype=torch.long)
