r"""Shampoo: Kronecker-factored full-matrix AdaGrad (Gupta, Koren & Singer, 2018).

For a gradient matrix ``G`` (a weight of shape ``(out, ...)`` is viewed as
``(out, prod(...))``) Shampoo keeps ``L = sum_t G_t G_t^T`` and
``R = sum_t G_t^T G_t`` and preconditions with

.. math::  \tilde G = (L + \epsilon I)^{-1/4}\, G\, (R + \epsilon I)^{-1/4},

the inverse fourth roots computed from ``eigh`` (with an fp64 retry) on the
preconditioner steps. ``ε`` is ``config.damping``, added to the eigenvalues of a
fresh copy each time: unlike ASDL it never accumulates into the statistics. A 1-D
parameter (a bias, a norm scale) is one-sided: ``(L + ε I)^{-1/2} g`` with
``L = sum g g^T`` (the order-1 case of Shampoo's ``-1/(2k)`` exponent). Dimensions
larger than ``block_size`` are cut into blocks of at most ``block_size``, each its
own Shampoo block (so the statistics stay ``block_size``-sized).

Between curvature steps a plain ``nn.Linear`` wider than the batch never forms its
weight gradient: its preconditioned weight gradient is ``(L^{-1/4} E^T)(X R^{-1/4})``
from the layer's output-gradients ``E`` and inputs ``X`` (the same value with less
arithmetic; single process, ``.grad`` ``None`` before the step).

Statistics: with ``config.ema_decay=None`` they are accumulated (summed, Shampoo's
AdaGrad form); with an ``ema_decay`` they are a bias-corrected EMA. They come from
the averaged gradient of the ordinary backward pass, so under
``DistributedDataParallel`` every rank sees the union-batch gradient (weights and
biases alike) and needs no extra communication.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from leantrain.precond._checks import check_extra_state, check_int
from leantrain.precond._coverage import shared_parameters
from leantrain.precond._output_grad_shortcut import LinearCapture
from leantrain.precond._safeguards import PlainGradient
from leantrain.precond.curv import robust_eigh
from leantrain.precond.gradient_maker import unwrap_model
from leantrain.precond.preconditioned import (
    PreconditionedGradientMaker,
    PreconditioningConfig,
)

__all__ = ["ShampooGradientMaker", "inverse_root", "inverse_roots", "matrix_blocks"]


def inverse_root(stat: Tensor, exponent: float, damping: float) -> Tensor:
    r"""``(S + damping I)^{-1/exponent}`` of a symmetric PSD ``S`` through ``eigh``.

    Eigenvalues are clamped at 0 before the damping is added (rounding can make the
    smallest slightly negative); ``S`` itself is not modified.
    """
    vals, vecs = robust_eigh(stat)
    scale = (vals.clamp(min=0) + damping).pow(-1.0 / exponent)
    return (vecs * scale.unsqueeze(0)) @ vecs.T


def inverse_roots(
    stats: list[Tensor], exponents: list[float], damping: float
) -> list[Tensor]:
    """:func:`inverse_root` of every statistic, one batched ``eigh`` per group of
    the same shape, dtype, device and exponent.

    A transformer's layers repeat a handful of shapes, so a refresh is a few
    decompositions of stacks instead of one per statistic: on a GPU each ``eigh``
    call (and the check of its result for the fp64 retry) waits for the device, so
    the calls, not the arithmetic, set a refresh's cost there. A group is retried in
    float64 as a whole when one of its members fails in float32.
    """
    groups: dict[tuple, list[int]] = {}
    for i, (s, e) in enumerate(zip(stats, exponents, strict=True)):
        groups.setdefault((s.shape, s.dtype, s.device, e), []).append(i)
    out: list[Tensor] = [stats[0]] * len(stats)
    for (*_, exponent), members in groups.items():
        stack = torch.stack([stats[i] for i in members])
        vals, vecs = robust_eigh(stack)
        scale = (vals.clamp(min=0) + damping).pow(-1.0 / exponent)
        # the products one by one: a batched GEMM rounds differently from
        # inverse_root's, and a refresh should not depend on its neighbours
        for i, v, c in zip(members, vecs.unbind(), scale.unbind(), strict=True):
            out[i] = (v * c.unsqueeze(0)) @ v.T
    return out


def matrix_blocks(shape: tuple[int, ...], block_size: int) -> list[tuple[slice, slice]]:
    """Row and column slices cutting a ``(rows, cols)`` matrix into blocks."""
    rows, cols = shape
    return [
        (slice(i, min(rows, i + block_size)), slice(j, min(cols, j + block_size)))
        for i in range(0, rows, block_size)
        for j in range(0, cols, block_size)
    ]


def _precondition_block(g: Tensor, roots: list[Tensor]) -> None:
    """``g ← roots[0] @ g (@ roots[1])`` in place; ``g`` is a 2-D view."""
    left = roots[0].to(g.dtype) @ g
    if len(roots) == 1:
        g.copy_(left)
    else:
        torch.mm(left, roots[1].to(g.dtype), out=g)


class ShampooGradientMaker(PreconditionedGradientMaker):
    r"""Shampoo preconditioning of every trainable parameter of the selected modules.

    Args:
        model: the module to train (plain or ``DistributedDataParallel``).
        config: schedule, ``damping`` (ε, added to the eigenvalues), ``ema_decay``
            (``None``: accumulate), ignored modules.
        block_size: the largest side of a Shampoo block; bigger dimensions are cut.

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from leantrain.precond import PreconditioningConfig
        >>> from leantrain.precond.methods.shampoo import ShampooGradientMaker
        >>> model = torch.nn.Linear(4, 3)
        >>> gm = ShampooGradientMaker(model, PreconditioningConfig(damping=1e-4))
        >>> y = gm.setup_model_call(model, torch.randn(16, 4))
        >>> gm.setup_loss_call(F.cross_entropy, y, torch.randint(0, 3, (16,)))
        >>> _ = gm.forward_and_backward()
        >>> [tuple(s.shape) for s in gm.statistics["weight"][0]]  # L, R
        [(3, 3), (4, 4)]
    """

    runs_compiled_calls = True  # it reads only the gradients

    def __init__(
        self,
        model: nn.Module,
        config: PreconditioningConfig | None = None,
        *,
        block_size: int = 1024,
    ) -> None:
        self.block_size = check_int("block_size", block_size, minimum=1)
        # Per parameter name, per block: [L, R] (2-D) or [L] (1-D).
        self.statistics: dict[str, list[list[Tensor]]] = {}
        self.roots: dict[str, list[list[Tensor]]] = {}
        super().__init__(model, config)
        # Resolved once: walking the module tree every step costs more than the
        # preconditioning of a small layer.
        # A parameter shared by several modules (tied weights) is preconditioned
        # once, under its first name: Shampoo's statistics are of the gradient
        # itself, the sum over the modules that use it, so no tying rule is needed.
        self._params = {}
        seen: set[int] = set()
        for name, module in self.modules():
            for pname, p in module.named_parameters(recurse=False):
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    self._params[f"{name}.{pname}" if name else pname] = p
        # Between curvature steps a wide nn.Linear skips its weight gradient: its
        # preconditioned weight gradient is formed as (L^{-1/4} E^T)(X R^{-1/4}) from
        # the output-gradients E and inputs X (see
        # _output_grad_shortcut.shortcut_is_cheaper).
        inner = unwrap_model(model)
        shared = shared_parameters(inner)
        tied = {id(p) for pname, p in inner.named_parameters() if pname in shared}
        self._capture = LinearCapture(
            {
                name: module
                for name, module in self.modules()
                if type(module) is nn.Linear
                and module.weight.requires_grad
                # A tied weight's gradient also comes from its other modules.
                and id(module.weight) not in tied
                and max(module.weight.shape) <= block_size
            },
            bias_column=False,
        )
        self._done: set[str] = set()  # weights preconditioned during the backward
        # Their plain gradients, never formed: module name -> (X, E).
        self._shortcut_inputs: dict[str, tuple[Tensor, Tensor]] = {}

    def is_supported(self, module: nn.Module) -> bool:
        """Any module owning trainable parameters."""
        return any(p.requires_grad for p in module.parameters(recurse=False))

    scales_loss = True  # its statistics are the (unscaled) gradient itself

    def _accumulation_refusal(self) -> str | None:
        return None  # the statistics are the accumulated gradient

    def _matrix(self, grad: Tensor) -> Tensor:
        if grad.ndim <= 1:
            return grad.reshape(-1, 1)  # one-sided: only L
        return grad.reshape(grad.shape[0], -1)

    # -- the passes -------------------------------------------------------------
    def _curvature_pass(self) -> tuple[Any, Tensor]:
        # The statistics need G itself: always the plain backward here.
        return super()._forward_backward()

    def _forward_backward(self) -> tuple[Any, Tensor]:
        self._shortcut_inputs = {}
        if (
            not self._capture.modules
            or self._loss_scale != 1.0  # its statistics must see the unscaled G
            or self._process_group() is not None
            or isinstance(self.model, nn.parallel.DistributedDataParallel)
        ):
            return super()._forward_backward()
        with self._capture:
            output = self._call_model()
            loss = self._loss_from_output(output)
        captured = {
            name: xy
            for name, xy in self._capture.usable().items()
            if self._weight_name(name) in self.roots
        }
        if not captured:  # nothing to skip: exactly loss.backward()
            loss.backward()
            return output, loss
        # As on K-FAC's capturing steps, only the model's parameters get gradient.
        skip = {id(self._capture.modules[name].weight) for name in captured}
        params = [
            p
            for p in unwrap_model(self.model).parameters()
            if p.requires_grad and id(p) not in skip
        ]
        grads = torch.autograd.grad(
            loss, params + [y for _, y in captured.values()], allow_unused=True
        )
        for p, g in zip(params, grads[: len(params)], strict=True):
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)
        with torch.no_grad():
            rest = grads[len(params) :]
            for (name, (x, _)), e in zip(captured.items(), rest, strict=True):
                weight = self._capture.modules[name].weight
                key = self._weight_name(name)
                if e is None:
                    weight.grad = torch.zeros_like(weight)
                    continue
                left, right = (r.to(weight.dtype) for r in self.roots[key][0])
                weight.grad = (left @ e.T.to(weight.dtype)) @ (
                    x.to(weight.dtype) @ right
                )
                self._done.add(key)
                self._shortcut_inputs[name] = (x, e)
        return output, loss

    def _plain_gradient(self, *, keep: bool, norms: bool = True) -> PlainGradient:
        # A weight preconditioned during the backward already holds P in .grad:
        # its plain gradient E^T X enters as its (X, E), as K-FAC's captured layers
        # do (grafting's norms and the KL clip's inner products need it).
        index = {name: i for i, (name, _) in enumerate(self.modules())}
        factored = {
            index[name]: (x, e, self._capture.modules[name].bias is not None)
            for name, (x, e) in self._shortcut_inputs.items()
        }
        return PlainGradient(self._layer_gradients(), factored, keep=keep, norms=norms)

    @staticmethod
    def _weight_name(module_name: str) -> str:
        return f"{module_name}.weight" if module_name else "weight"

    def update_curvature(self) -> None:
        """Add ``G G^T`` and ``G^T G`` of every block (EMA or accumulate)."""
        decay = self.config.ema_decay
        for name, p in self._params.items():
            if p.grad is None:
                continue
            g = self._matrix(p.grad.detach())
            one_sided = p.ndim <= 1
            new = []
            for k, (rs, cs) in enumerate(matrix_blocks(g.shape, self.block_size)):
                block = g[rs, cs]
                stats = (
                    [block @ block.T]
                    if one_sided
                    else [block @ block.T, block.T @ block]
                )
                if decay is None:  # AdaGrad form: accumulate
                    old = self.statistics.get(name)
                    if old is not None:
                        stats = [o + s for o, s in zip(old[k], stats, strict=True)]
                else:
                    stats = [
                        self._ema_update(f"{name}/{k}/{side}", s)
                        for side, s in zip("LR", stats, strict=False)  # 1-D: only L
                    ]
                new.append(stats)
            self.statistics[name] = new

    def update_preconditioner(self) -> None:
        """Inverse roots ``(S + ε I)^{-1/4}`` (``-1/2`` one-sided) via ``eigh``,
        batched over the statistics of one shape (:func:`inverse_roots`)."""
        where, stats, exponents = [], [], []
        for name, blocks in self.statistics.items():
            for k, block in enumerate(blocks):
                for side, s in enumerate(block):
                    where.append((name, k, side))
                    stats.append(s)
                    exponents.append(2.0 if len(block) == 1 else 4.0)
        roots: dict[str, list[list[Tensor]]] = {
            name: [[None] * len(block) for block in blocks]
            for name, blocks in self.statistics.items()
        }
        if stats:
            for (name, k, side), root in zip(
                where, inverse_roots(stats, exponents, self.config.damping), strict=True
            ):
                roots[name][k][side] = root
        self.roots = roots

    @torch.no_grad()
    def precondition(self) -> None:
        """``.grad`` ← ``L^{-1/4} G R^{-1/4}`` per block (``L^{-1/2} g`` for 1-D)."""
        done, self._done = self._done, set()
        for name, p in self._params.items():
            grad = p.grad
            if grad is None or name not in self.roots or name in done:
                continue
            roots = self.roots[name]
            if len(roots) == 1 and grad.is_contiguous():
                # One block (the usual case): two matmuls, the last written straight
                # into .grad (no temporary copy of the gradient).
                _precondition_block(grad.view(self._matrix(grad).shape), roots[0])
                continue
            g = self._matrix(grad)
            out = torch.empty_like(g)
            blocks = matrix_blocks(g.shape, self.block_size)
            for (rs, cs), block_roots in zip(blocks, roots, strict=True):
                out[rs, cs] = g[rs, cs]
                _precondition_block(out[rs, cs], block_roots)
            grad.copy_(out.reshape(grad.shape))

    # -- state ------------------------------------------------------------------
    def _extra_state(self) -> dict[str, Any]:
        def flat(d: dict[str, list[list[Tensor]]]) -> dict[str, Tensor]:
            return {
                f"{name}/{k}/{i}": t
                for name, blocks in d.items()
                for k, ts in enumerate(blocks)
                for i, t in enumerate(ts)
            }

        return {"statistics": flat(self.statistics), "roots": flat(self.roots)}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        keys = ("statistics", "roots")
        check_extra_state(state, keys, tensor_maps=keys)
        out = {}
        for key in keys:
            nested: dict[str, dict[int, dict[int, Tensor]]] = {}
            for flat_key, value in state[key].items():
                name, k, i = flat_key.rsplit("/", 2)
                nested.setdefault(name, {}).setdefault(int(k), {})[int(i)] = (
                    value.clone()
                )
            out[key] = {
                name: [[b[i] for i in sorted(b)] for _, b in sorted(blocks.items())]
                for name, blocks in nested.items()
            }
        self.statistics, self.roots = out["statistics"], out["roots"]
