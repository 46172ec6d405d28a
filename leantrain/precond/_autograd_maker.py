"""Shared pieces of the makers that differentiate the loss twice (Newton, HF).

They work on any module owning trainable parameters (no hooks), on the flat vector of
the selected modules' parameters, and average over the DDP group themselves: the
curvature pass calls the unwrapped model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from leantrain.precond.gradient_maker import unwrap_model
from leantrain.precond.preconditioned import PreconditionedGradientMaker

__all__ = ["AutogradMaker", "twice_differentiable"]


@contextlib.contextmanager
def twice_differentiable() -> Iterator[None]:
    """Run ``scaled_dot_product_attention`` by its composite math kernel.

    The fused CPU kernels (flash attention, which Hugging Face models call by
    default) have no derivative of their backward, so a Hessian-vector product
    through them fails; the math kernel computes the same attention from
    differentiable primitives.
    """
    with sdpa_kernel([SDPBackend.MATH]):
        yield


class AutogradMaker(PreconditionedGradientMaker):
    """Base: selected parameters as one flat vector, and a graph-keeping pass."""

    def is_supported(self, module: nn.Module) -> bool:
        """Any module owning trainable parameters."""
        return any(p.requires_grad for p in module.parameters(recurse=False))

    def selected_parameters(self) -> list[nn.Parameter]:
        """Trainable parameters of the selected modules, module by module; a
        parameter shared by several modules (tied weights) appears once."""
        out, seen = [], set()
        for _, module in self.modules():
            for p in module.parameters(recurse=False):
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def _graph_pass(self, create_graph: bool) -> tuple[Any, Tensor, Tensor, list]:
        """Forward through the unwrapped model, gradient into ``.grad`` (averaged).

        Returns ``(output, loss, flat selected gradient with graph, selected)``.
        """
        inner = unwrap_model(self.model)
        fn = self.model_call[0]
        if isinstance(fn, nn.Module) and unwrap_model(fn) is inner:
            fn = inner  # bypass DDP: the gradient is averaged below
        params = [p for p in inner.parameters() if p.requires_grad]
        selected = self.selected_parameters()
        position = {id(p): i for i, p in enumerate(params)}
        with torch.enable_grad(), twice_differentiable():
            output = self._call_model(fn)
            loss = self._loss_from_output(output)
            grads = torch.autograd.grad(
                loss,
                params,
                create_graph=create_graph,
                retain_graph=True,
                allow_unused=True,
            )
        grads = [
            torch.zeros_like(p) if g is None else g
            for p, g in zip(params, grads, strict=True)
        ]
        flat = torch.cat([grads[position[id(p)]].reshape(-1) for p in selected])
        plain = [g.detach().clone() for g in grads]
        self._all_reduce_mean(plain)
        for p, g in zip(params, plain, strict=True):
            if p.grad is None:
                p.grad = g
            else:  # in place: DDP may hold .grad as a view of its buckets
                p.grad.add_(g)
        return output, loss, flat, selected

    def read_flat(self) -> Tensor | None:
        """The selected parameters' ``.grad`` as one flat vector."""
        params = self.selected_parameters()
        if all(p.grad is None for p in params):
            return None
        return torch.cat(
            [
                (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                for p in params
            ]
        )

    def write_flat(self, flat: Tensor) -> None:
        """Write a flat vector into the selected parameters' ``.grad``."""
        params = self.selected_parameters()
        for p, piece in zip(
            params, flat.split([p.numel() for p in params]), strict=True
        ):
            piece = piece.reshape(p.shape).to(p.dtype)
            if p.grad is None:
                p.grad = piece.clone()
            else:
                p.grad.copy_(piece)
