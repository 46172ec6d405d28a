r"""Per-module curvature operations: what to capture, and the per-example algebra.

Every supported module is seen in a *canonical unit layout*: ``R`` output units, each
owning ``U`` parameters (a weight row and, when present, its bias entry). An op maps
the captured forward inputs and the output-gradients of one backward pass to

* per-example canonical gradients ``(n, R, U)`` (for "layer", "full", and "diag" /
  "unit" of weight-shared modules, where the cross-position terms make them
  necessary), formed for a chunk of examples at a time;
* closed forms that never form per-example gradients: "diag" and "unit" of a
  non-shared linear map (``T = 1``), and the Kronecker factors of "kron".

``canon_index[r, u]`` is the position of canonical entry ``(r, u)`` in the module's
parameters flattened and concatenated in ``module.named_parameters(recurse=False)``
order (which is ``model.parameters()`` order).

Linear-form modules (``y_t = W a_t + b`` at positions ``t``): ``nn.Linear`` and
subclasses (input ``(N, *, in)``: ``T`` = product of the middle dims), ``nn.Conv2d``
(``a_t`` = im2col patch, ``T`` = output pixels), ``nn.Embedding`` (``a_t`` one-hot,
``W`` = weight transposed: a unit is an embedding *dimension*), the packed
``in_proj`` of ``nn.MultiheadAttention`` (three row blocks q, k, v with their own
inputs), Hugging Face ``Conv1D`` (``nn.Linear`` with the weight stored
transposed, ``_conv1d.py``). Elementwise-affine modules
(``y = \gamma \hat x + \beta``): ``nn.LayerNorm``, RMSNorm (``nn.RMSNorm`` and
the Hugging Face Llama form, no ``\beta``),
``nn.BatchNorm1d/2d`` (a unit is one feature / channel: ``[\gamma_i, \beta_i]``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._base import ModuleOp, Site, _acc, _batch
from ._conv import LazyFeats, LazySite, canonical_order, kernel_major_patches
from ._conv1d import Conv1dOp, is_conv1d
from ._linear_form import DenseLinearOp, LinearFormOp, _cat, gram
from ._mha import check_mha_supported
from ._norm import BatchNormOp, LayerNormOp, RMSNormOp, is_rms_norm

__all__ = [
    "SUPPORTED_MODULES",
    "BatchNormOp",
    "LinearFormOp",
    "ModuleOp",
    "Site",
    "is_conv1d",
    "is_supported_module",
    "make_op",
]

SUPPORTED_MODULES = (
    nn.Linear,
    nn.Conv2d,
    nn.Embedding,
    nn.LayerNorm,
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.MultiheadAttention,
)


def is_supported_module(module: nn.Module) -> bool:
    """Whether :func:`make_op` has an op for ``module``'s type: the
    :data:`SUPPORTED_MODULES`, Hugging Face ``Conv1D`` (see ``_conv1d.py``) and
    RMSNorm (``nn.RMSNorm`` and the Llama form, see ``_norm.py``)."""
    return (
        isinstance(module, SUPPORTED_MODULES)
        or is_conv1d(module)
        or is_rms_norm(module)
    )


class LinearOp(DenseLinearOp):
    def __init__(self, name: str, module: nn.Linear) -> None:
        super().__init__(name, module)
        self._setup(module.out_features, module.in_features, module.bias is not None)


class Conv2dOp(LinearFormOp):
    """Conv2d via im2col: ``a_t`` is the unfolded patch at output pixel ``t``."""

    def __init__(self, name: str, module: nn.Conv2d) -> None:
        super().__init__(name, module)
        if module.groups != 1 or module.padding_mode != "zeros":
            raise ValueError(
                f"module {name!r}: Conv2d with groups={module.groups}, padding_mode="
                f"{module.padding_mode!r} is not supported; allowed: groups=1, "
                "padding_mode='zeros' (or list it in ignore_modules)"
            )
        padding = module.padding
        if isinstance(padding, str):
            if padding == "valid":
                padding = (0, 0)
            else:  # "same" with stride 1: symmetric only when dilation*(k-1) is even
                total = [
                    d * (k - 1)
                    for d, k in zip(module.dilation, module.kernel_size, strict=True)
                ]
                if any(t % 2 for t in total):
                    raise ValueError(
                        f"module {name!r}: Conv2d padding='same' with asymmetric "
                        "padding (even kernel) is not supported"
                    )
                padding = tuple(t // 2 for t in total)
        self.padding = padding
        weight = module.weight
        self._setup(weight.shape[0], weight[0].numel(), module.bias is not None)
        self._perm = canonical_order(
            weight.shape[1], *module.kernel_size, module.bias is not None
        )

    def record(self, args: tuple, output: torch.Tensor) -> tuple[dict, list]:
        x = args[0]
        _batch(x, self.name, 4)
        m, x = self.module, _acc(x)
        geometry = (m.kernel_size, m.dilation, self.padding, m.stride)
        fast = kernel_major_patches(x, *geometry)  # (N, L, kh*kw*C_in)
        n = x.shape[0]

        def canonical() -> list[torch.Tensor]:  # (N, L, C_in*kh*kw), as F.unfold
            return [F.unfold(x, *geometry).transpose(1, 2)]

        feats = LazyFeats(
            canonical,
            a_kernel_major=fast,
            rows=[slice(0, self.rows)],
            eshape=[(n, fast.shape[1], self.rows)],
        )
        return feats, [output]

    def combine(self, calls: list) -> list[Site]:
        live = [(f, g[0]) for f, g in calls if g[0] is not None]
        if not live:
            return []
        e = _cat([g for _, g in live], 1)
        return [
            LazySite(
                live[0][0]["rows"][0], lambda: _cat([f["a"][0] for f, _ in live], 1), e
            )
        ]

    def kron_a(self, calls: list) -> list[torch.Tensor]:
        """``A`` from the kernel-major patches, permuted to the canonical order."""
        a = self._augmented(_cat([f["a_kernel_major"] for f, _ in calls], 1))
        factor = gram(a.reshape(-1, a.shape[-1])).div_(a.shape[0])
        perm = self._perm
        return [factor[perm.unsqueeze(-1), perm.unsqueeze(0)]]

    def grad_feature(self, slot: int, grad: torch.Tensor) -> torch.Tensor:
        return _acc(grad).reshape(grad.shape[0], self.rows, -1).transpose(1, 2)


class EmbeddingOp(LinearFormOp):
    """Embedding as a linear map on one-hot inputs; a unit is one embedding dim."""

    transposed = True

    def __init__(self, name: str, module: nn.Embedding) -> None:
        super().__init__(name, module)
        if module.max_norm is not None or module.scale_grad_by_freq:
            raise ValueError(
                f"module {name!r}: Embedding with max_norm or scale_grad_by_freq is "
                "not supported (list it in ignore_modules)"
            )
        vocab, dim = module.weight.shape
        self._setup(dim, vocab, False)

    def record(self, args: tuple, output: torch.Tensor) -> tuple[dict, list]:
        idx = args[0]
        _batch(idx, self.name, 1)
        n = idx.shape[0]
        ids = idx.reshape(n, -1)
        feats = {
            "a": [ids],
            "rows": [slice(0, self.rows)],
            "eshape": [(n, ids.shape[1], self.rows)],
        }
        return feats, [output]

    def grad_feature(self, slot: int, grad: torch.Tensor) -> torch.Tensor:
        return _acc(grad).reshape(grad.shape[0], -1, self.rows)

    def combine(self, calls: list) -> list[Site]:
        sites = []
        for site in super().combine(calls):
            pad = self.module.padding_idx
            e = site.e
            if pad is not None:  # torch never updates the padding row
                e = e * (site.a != pad).unsqueeze(-1).to(e.dtype)
            sites.append(Site(site.rows, site.a, e))
        return sites

    def per_example(self, data: list[Site], sl: slice) -> torch.Tensor:
        site = data[0]
        ids, e = site.a[sl], site.e[sl]
        index = ids.unsqueeze(-1).expand(-1, -1, self.rows)
        g = e.new_zeros(e.shape[0], self.cols, self.rows).scatter_add_(1, index, e)
        return g.transpose(1, 2)  # (n, D, V)

    def summed(self, data: list[Site]) -> torch.Tensor:
        site = data[0]
        e = site.e.reshape(-1, self.rows)
        out = e.new_zeros(self.cols, self.rows)
        return out.index_add_(0, site.a.reshape(-1), e).T

    def diag(self, data: list[Site]) -> torch.Tensor:
        site = data[0]
        if site.a.shape[1] != 1:
            return ModuleOp.diag(self, data)
        e2 = site.e[:, 0].square()
        return e2.new_zeros(self.cols, self.rows).index_add_(0, site.a[:, 0], e2).T

    def unit(self, data: list[Site]) -> torch.Tensor:
        if data[0].a.shape[1] != 1:
            return ModuleOp.unit(self, data)
        return torch.diag_embed(self.diag(data))  # one-hot inputs: diagonal blocks

    def kron_a(self, calls: list) -> list[torch.Tensor]:
        ids = torch.cat([f["a"][0] for f, _ in calls], 1)
        n = ids.shape[0]
        counts = torch.bincount(ids.reshape(-1), minlength=self.cols)
        if self.module.padding_idx is not None:  # padding positions get no gradient
            counts[self.module.padding_idx] = 0
        dtype = self.module.weight.dtype
        dtype = dtype if dtype in (torch.float32, torch.float64) else torch.float32
        return [torch.diag(counts.to(dtype)) / n]


class MultiheadAttentionOp(LinearFormOp):
    """The packed ``in_proj`` of ``nn.MultiheadAttention`` (rows q, k, v).

    Needs the collector to swap in :func:`~._mha.mha_forward` (see ``_mha.py``).
    For self-attention (query, key and value the same tensor) the three row blocks
    share their input and form one site (one ``A``, one ``3E x 3E`` ``B`` for
    "kron"); otherwise each block is its own site.
    """

    def __init__(self, name: str, module: nn.MultiheadAttention) -> None:
        check_mha_supported(name, module)
        super().__init__(name, module)
        e = module.embed_dim
        self._setup(3 * e, e, module.in_proj_bias is not None)

    def record(self, args: tuple, output: object) -> tuple[dict, list]:
        taps = output  # the collector passes mha_forward's taps here
        e = self.module.embed_dim
        same = taps["same"]
        a = [_acc(taps[k]) for k in ("q_in", "k_in", "v_in")]
        shapes = [(*taps[k].shape[:2], e) for k in ("q", "k", "v")]
        rows = [slice(0, e), slice(e, 2 * e), slice(2 * e, 3 * e)]
        feats = {"a": a, "rows": rows, "eshape": shapes, "same": same}
        return feats, [taps["q"], taps["k"], taps["v"]]

    def grad_feature(self, slot: int, grad: torch.Tensor) -> torch.Tensor:
        return _acc(grad)

    def _merge_shared_input(self, sites: list[Site], live: list) -> list[Site]:
        if not all(f["same"] for f, _ in live):
            return sites
        e = torch.cat([s.e for s in sites], dim=-1)
        return [Site(slice(0, self.rows), sites[0].a, e)]

    def kron_a(self, calls: list) -> list[torch.Tensor]:
        factors = super().kron_a(calls)
        return factors[:1] if all(f["same"] for f, _ in calls) else factors

    def site_rows(self, calls: list) -> list[slice]:
        if all(f["same"] for f, _ in calls):
            return [slice(0, self.rows)]
        return super().site_rows(calls)


def make_op(name: str, module: nn.Module) -> ModuleOp:
    """Build the op for a supported module; raise ValueError for anything else."""
    if isinstance(module, nn.Linear):
        return LinearOp(name, module)
    if isinstance(module, nn.Conv2d):
        return Conv2dOp(name, module)
    if isinstance(module, nn.Embedding):
        return EmbeddingOp(name, module)
    if isinstance(module, nn.LayerNorm):
        return LayerNormOp(name, module)
    if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d)):
        return BatchNormOp(name, module)
    if isinstance(module, nn.MultiheadAttention):
        return MultiheadAttentionOp(name, module)
    if is_conv1d(module):
        return Conv1dOp(name, module)
    if is_rms_norm(module):
        return RMSNormOp(name, module)
    extra = ["Conv1D (HF)", "RMSNorm"]
    allowed = ", ".join([c.__name__ for c in SUPPORTED_MODULES] + extra)
    raise ValueError(
        f"module {name!r} of type {type(module).__name__} has parameters but is not "
        f"supported; allowed: {allowed} (or list it in ignore_modules)"
    )
