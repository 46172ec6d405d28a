r"""The output-gradient shortcut for wide ``nn.Linear`` layers.

A linear layer's weight gradient is ``G = E^T X`` (output-gradients ``E``, inputs
``X``, one row per example). A Kronecker-factored preconditioner only needs
``B^{-1} G A^{-1}``, which can be formed as ``(B^{-1} E^T)(X A^{-1})`` without ``G``:
cheaper when the batch is smaller than the layer is wide (see
:func:`shortcut_is_cheaper`). :class:`LinearCapture` keeps ``(X, output)`` of the
layers where that pays so that the backward can stop at the output and hand ``E``
to the preconditioner (K-FAC, Shampoo) instead of forming ``.grad``.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor, nn

from leantrain import evaluation

__all__ = ["LinearCapture", "shortcut_is_cheaper"]


def shortcut_is_cheaper(rows: int, cols: int, n: int) -> bool:
    r"""Whether ``(B^{-1} E^T)(X A^{-1})`` beats forming ``G = E^T X`` first.

    For a linear layer seen by ``n`` examples (no weight sharing), ``G = E^T X``
    with ``E`` the ``(n, rows)`` output-gradients and ``X`` the ``(n, cols)``
    inputs (with the trailing 1 of the bias). ``B^{-1} G A^{-1}`` costs
    ``rows·cols·(rows + cols)`` multiply-adds plus ``n·rows·cols`` for ``G``; the
    factored product ``n·(rows² + cols² + rows·cols)``: cheaper when ``n`` is
    below the layer's width (a 256-wide layer at batch 128 saves 40%).
    """
    return n * (rows * rows + cols * cols) < rows * cols * (rows + cols)


class LinearCapture:
    """Forward hooks keeping ``(input, output)`` of plain ``nn.Linear`` modules.

    Used to skip the weight gradient of layers whose preconditioned gradient is
    cheaper to form from the factors ``E`` (output-gradient) and ``X`` (input); see
    :func:`shortcut_is_cheaper`. A module called more than once, or whose output is
    later modified in place, is dropped at backward time (its gradient is computed
    as usual).
    """

    def __init__(self, modules: dict[str, nn.Module], bias_column: bool = True) -> None:
        self.modules = modules
        # Parameter lists fixed at construction, as the makers' ModuleOp.params are:
        # walking module.parameters() twice a step cost more than the check itself.
        self._params = {name: list(m.parameters()) for name, m in modules.items()}
        self.bias_column = bias_column  # K-FAC folds the bias into A; Shampoo not
        self.records: dict[str, tuple | None] = {}
        self._handles: list = []

    def __enter__(self) -> LinearCapture:
        self.records = {}
        for name, module in self.modules.items():
            hook = partial(self._on_forward, name)
            self._handles.append(module.register_forward_hook(hook))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _on_forward(self, name: str, module: nn.Module, args: tuple, output) -> None:
        if not torch.is_grad_enabled() or evaluation.is_auxiliary():
            return
        if evaluation.recomputation() is not None:  # checkpointing's re-run
            return
        if evaluation.in_detached():
            # A graph of its own (a layer-parallel solver's): autograd.grad from the
            # loss cannot stop at this output, so its gradient is formed as usual.
            self.records[name] = None
            return
        if name in self.records or not args:  # a second call: weight sharing
            self.records[name] = None
            return
        x = args[0]
        ok = (
            isinstance(x, Tensor)
            and x.ndim == 2
            and isinstance(output, Tensor)
            and output.requires_grad
            and shortcut_is_cheaper(
                module.out_features,
                module.in_features + self.bias_column,
                x.shape[0],
            )
        )
        self.records[name] = (x.detach(), output, output._version) if ok else None

    def usable(self) -> dict[str, tuple[Tensor, Tensor]]:
        """``{name: (input, output)}`` of the modules whose ``.grad`` is still
        ``None`` (so the preconditioned gradient is this pass's alone), called once,
        and whose output was not modified in place."""
        out = {}
        for name, rec in self.records.items():
            if rec is None or rec[1]._version != rec[2]:
                continue
            if all(p.grad is None for p in self._params[name]):
                out[name] = (rec[0], rec[1])
        return out
