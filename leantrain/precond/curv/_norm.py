"""Elementwise-affine ops: LayerNorm, BatchNorm, RMSNorm (a unit is
``[gamma_i, beta_i]``, or ``[gamma_i]`` without a shift)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._base import ModuleOp, Site, _acc, _batch

__all__ = [
    "BatchNormOp",
    "ElementwiseAffineOp",
    "LayerNormOp",
    "RMSNormOp",
    "is_rms_norm",
]


def is_rms_norm(module: nn.Module) -> bool:
    """``nn.RMSNorm``, or a Hugging Face ``*RMSNorm`` of the Llama form
    (``weight * x / rms(x)``, a ``variance_epsilon``, no bias)."""
    if isinstance(module, getattr(nn, "RMSNorm", ())):
        return module.weight is not None
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__.endswith("RMSNorm")
        and hasattr(module, "variance_epsilon")
        and isinstance(weight, nn.Parameter)
        and weight.dim() == 1
        and getattr(module, "bias", None) is None
    )


class ElementwiseAffineOp(ModuleOp):
    r"""``y = \gamma \hat x + \beta`` per feature; a unit is ``[\gamma_i, \beta_i]``."""

    def _setup(self, size: int, bias: bool) -> None:
        self.size, self.has_bias = size, bias
        idx = torch.arange(size).unsqueeze(1)
        self.canon_index = torch.cat([idx, size + idx], 1) if bias else idx

    def grad_feature(self, slot: int, grad: torch.Tensor) -> torch.Tensor:
        return self._layout(_acc(grad))

    def combine(self, calls: list) -> list[Site]:
        live = [(f, g[0]) for f, g in calls if g[0] is not None]
        if not live:
            return []
        if len(live) == 1:  # called once: no copy
            return [Site(slice(0, self.size), live[0][0]["xhat"], live[0][1])]
        xhat = torch.cat([f["xhat"] for f, _ in live], 1)
        e = torch.cat([g for _, g in live], 1)
        return [Site(slice(0, self.size), xhat, e)]

    def per_example(self, data: list[Site], sl: slice) -> torch.Tensor:
        site = data[0]
        e = site.e[sl]
        parts = [(e * site.a[sl]).sum(1)]
        if self.has_bias:
            parts.append(e.sum(1))
        return torch.stack(parts, dim=-1)  # (n, S, U)


class LayerNormOp(ElementwiseAffineOp):
    def __init__(self, name: str, module: nn.LayerNorm) -> None:
        super().__init__(name, module)
        if module.weight is None:
            raise ValueError(f"module {name!r}: LayerNorm without weight has no units")
        self._setup(module.weight.numel(), module.bias is not None)

    def _layout(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], -1, self.size)

    def record(self, args: tuple, output: torch.Tensor) -> tuple[dict, list]:
        x = args[0]
        m = self.module
        _batch(x, self.name, len(m.normalized_shape) + 1)
        xhat = F.layer_norm(_acc(x), m.normalized_shape, eps=m.eps)
        return {"xhat": self._layout(xhat)}, [output]


class BatchNormOp(ElementwiseAffineOp):
    """BatchNorm in eval mode (running statistics): examples stay independent.

    In training mode the batch statistics couple the examples, so per-example
    quantities (and every kind but "hessian") are not defined; the collector rejects
    it unless ``allow_batch_coupling=True``, which treats the batch statistics as
    constants (the usual K-FAC approximation).
    """

    allow_batch_coupling = False

    def __init__(self, name: str, module: nn.modules.batchnorm._BatchNorm) -> None:
        super().__init__(name, module)
        if module.weight is None:
            raise ValueError(f"module {name!r}: BatchNorm without affine has no units")
        self._setup(module.num_features, module.bias is not None)

    def _layout(self, x: torch.Tensor) -> torch.Tensor:
        n, c = x.shape[:2]
        return x.reshape(n, c, -1).transpose(1, 2)  # (N, spatial, C)

    def record(self, args: tuple, output: torch.Tensor) -> tuple[dict, list]:
        x = _acc(args[0])
        m = self.module
        _batch(x, self.name, 2)
        batch_stats = m.training or m.running_mean is None
        if batch_stats and not self.allow_batch_coupling:
            raise ValueError(
                f"module {self.name!r}: BatchNorm using batch statistics (training mode"
                " or track_running_stats=False) couples the examples, so per-example "
                "curvature is undefined; call model.eval(), use kind='hessian', or "
                "list it in ignore_modules"
            )
        gamma = m.weight.detach()
        if bool((gamma.abs() > 1e-6).all()):
            # x̂ read back from the module's own output, y = γ x̂ + β: two
            # elementwise passes instead of a second normalization (a sixth of it
            # on the digits CNN).
            shape = (1, -1) + (1,) * (x.dim() - 2)
            out = _acc(output.detach())
            if m.bias is not None:
                out = out - m.bias.detach().to(out.dtype).view(shape)
            return {"xhat": self._layout(out / gamma.to(out.dtype).view(shape))}, [
                output
            ]
        # A (near) zero γ loses x̂ in y: normalize again, by torch's own kernel (no
        # affine, no running-statistics update).
        stats = (None, None) if batch_stats else (m.running_mean, m.running_var)
        xhat = F.batch_norm(
            x,
            *(s if s is None else s.to(x.dtype) for s in stats),
            training=batch_stats,
            momentum=0.0,
            eps=m.eps,
        )
        return {"xhat": self._layout(xhat)}, [output]


class RMSNormOp(ElementwiseAffineOp):
    r"""``y = \gamma \odot x / \mathrm{rms}(x)`` over the last dim; a unit is
    ``[\gamma_i]``.

    ``x̂ = x / rms(x)`` is read back from the output (``y / γ``, exact to rounding,
    whatever precision the module normalises in) and, on the first call, checked
    against a normalisation computed here: a module named ``*RMSNorm`` that
    computes something else (e.g. ``(1 + γ) x̂``) raises instead of being
    preconditioned with the wrong gradient.
    """

    def __init__(self, name: str, module: nn.Module) -> None:
        super().__init__(name, module)
        self._setup(module.weight.numel(), False)
        self._checked = False

    def _layout(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], -1, self.size)

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        if isinstance(m, getattr(nn, "RMSNorm", ())):
            return F.rms_norm(_acc(x), m.normalized_shape, None, m.eps)
        xf = x.detach().float()  # the Llama form normalises in float32
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + m.variance_epsilon)
        return _acc(xf.to(x.dtype))

    def record(self, args: tuple, output: torch.Tensor) -> tuple[dict, list]:
        x = args[0]
        _batch(x, self.name, 2)
        gamma = self.module.weight.detach()
        out = _acc(output.detach())
        if bool((gamma.abs() > 1e-6).all()):
            xhat = out / gamma.to(out.dtype)
            if not self._checked:
                ref = self._normalize(x).to(out.dtype)
                err = float((xhat - ref).abs().max())
                if err > 1e-3 * (1.0 + float(ref.abs().max())):
                    raise ValueError(
                        f"module {self.name!r} ({type(self.module).__name__}): its "
                        "output is not weight * x / rms(x), the RMSNorm form the "
                        "curvature here assumes; list it in ignore_modules"
                    )
                self._checked = True
        else:  # a (near) zero γ loses x̂ in y: normalize again
            xhat = self._normalize(x).to(out.dtype)
        return {"xhat": self._layout(xhat)}, [output]
