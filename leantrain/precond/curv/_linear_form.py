r"""The linear-form base of the curvature ops: ``y_t = W a_t + b`` at positions ``t``.

:class:`LinearFormOp` holds what ``nn.Linear``, ``nn.Conv2d``, ``nn.Embedding`` and
the ``in_proj`` of ``nn.MultiheadAttention`` share (``modules.py`` defines those):
the canonical unit layout (a unit is a weight row and its bias entry), the
per-example gradients, the closed-form "diag" and "unit" of a non-shared map, and
the Kronecker factors of "kron".
"""

from __future__ import annotations

import torch

from ._base import ModuleOp, Site, _acc, _batch

__all__ = ["LinearFormOp", "gram"]


def _cat(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
    """``torch.cat`` that returns a lone tensor itself: a module called once per
    forward (the usual case) must not copy its im2col patches (MBs for a conv)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim)


def gram(a: torch.Tensor) -> torch.Tensor:
    """``a^T a`` for a tall ``(M, K)`` matrix, computing one triangle of blocks.

    With ``a = [a1, a2]`` the lower-left block is the transpose of the upper-right,
    so three products replace four: 15-20% faster for convolution patches (``M`` in
    the thousands, ``K`` = 144 or more); a plain product otherwise.
    """
    rows, cols = a.shape
    if cols < 128 or rows < 4 * cols:
        return a.T @ a
    k = cols // 2
    top = a[:, :k].T @ a  # (k, K): [a1^T a1, a1^T a2]
    out = a.new_empty(cols, cols)
    out[:k] = top
    out[k:, :k] = top[:, k:].T
    out[k:, k:] = a[:, k:].T @ a[:, k:]
    return out


class LinearFormOp(ModuleOp):
    """Modules computing ``y_t = W a_t + b`` at positions ``t`` (see module doc)."""

    kron_capable = True
    transposed = False  # Embedding stores W^T

    def _setup(self, rows: int, cols: int, bias: bool) -> None:
        self.rows, self.cols, self.has_bias = rows, cols, bias
        r = torch.arange(rows).unsqueeze(1)
        c = torch.arange(cols).unsqueeze(0)
        weight_idx = c * rows + r if self.transposed else r * cols + c
        if bias:
            bias_idx = rows * cols + torch.arange(rows).unsqueeze(1)
            weight_idx = torch.cat([weight_idx, bias_idx], dim=1)
        self.canon_index = weight_idx

    def combine(self, calls: list) -> list[Site]:
        live = [(f, g) for f, g in calls if any(x is not None for x in g)]
        if not live:
            return []
        n_sites = len(live[0][1])
        sites = []
        for s in range(n_sites):
            a = [f["a"][s] for f, g in live]
            e = []
            for f, g in live:
                ref = next(x for x in g if x is not None)  # a hooked grad of this call
                e.append(g[s] if g[s] is not None else ref.new_zeros(f["eshape"][s]))
            sites.append(Site(live[0][0]["rows"][s], _cat(a, 1), _cat(e, 1)))
        return self._merge_shared_input(sites, live)

    def _merge_shared_input(self, sites: list[Site], live: list) -> list[Site]:
        return sites

    def per_example(self, data: list[Site], sl: slice) -> torch.Tensor:
        blocks = []
        for site in data:
            e = site.e[sl]
            g = torch.einsum("nti,ntj->nij", e, site.a[sl])
            if self.has_bias:
                g = torch.cat([g, e.sum(1).unsqueeze(-1)], dim=-1)
            blocks.append(g)
        return torch.cat(blocks, dim=1)

    def _augmented(self, a: torch.Tensor) -> torch.Tensor:
        if not self.has_bias:
            return a
        return torch.cat([a, a.new_ones(*a.shape[:-1], 1)], dim=-1)

    def summed(self, data: list[Site]) -> torch.Tensor:
        # sum_n sum_t e a^T as one matrix product: no per-example gradient
        out = []
        for site in data:
            e = site.e.reshape(-1, site.e.shape[-1])
            out.append(e.T @ self._augmented(site.a).reshape(e.shape[0], -1))
        return torch.cat(out)

    def diag(self, data: list[Site]) -> torch.Tensor:
        if any(site.a.shape[1] != 1 for site in data):
            return super().diag(data)
        # No weight sharing: per-example gradient e a^T, so its square is e^2 (a^2)^T.
        return torch.cat(
            [
                site.e[:, 0].square().T @ self._augmented(site.a[:, 0]).square()
                for site in data
            ]
        )

    def unit(self, data: list[Site]) -> torch.Tensor:
        if any(site.a.shape[1] != 1 for site in data):
            return super().unit(data)
        out = []
        for site in data:
            a = self._augmented(site.a[:, 0])
            out.append(torch.einsum("ni,nj,nk->ijk", site.e[:, 0].square(), a, a))
        return torch.cat(out)

    def kron_a(self, calls: list) -> list[torch.Tensor]:
        """Input factors ``A = sum_{n,t} ã ã^T / N`` per site (ã with a trailing 1)."""
        n = calls[0][0]["a"][0].shape[0]
        return [
            gram(self.input_rows(calls, s)).div_(n)
            for s in range(len(calls[0][0]["a"]))
        ]

    def input_rows(self, calls: list, site: int = 0) -> torch.Tensor:
        """The ``(N·T, U)`` rows ã of site ``site``'s ``A`` (before ``/ N``)."""
        a = self._augmented(_cat([f["a"][site] for f, _ in calls], 1))
        return a.reshape(-1, a.shape[-1])

    def kron_b(self, data: list[Site]) -> list[torch.Tensor]:
        """Output factor increments ``sum_{n,t} e e^T`` per site for this pass."""
        out = []
        for site in data:
            e = site.e.reshape(-1, site.e.shape[-1])
            out.append(e.T @ e)
        return out

    def site_rows(self, calls: list) -> list[slice]:
        return list(calls[0][0]["rows"])


class DenseLinearOp(LinearFormOp):
    """A linear map of the last input dim (``nn.Linear``, HF ``Conv1D``): one site per
    call, positions = every leading dim after the batch."""

    def record(self, args: tuple, output: torch.Tensor) -> tuple[dict, list]:
        x = args[0]
        _batch(x, self.name, 2)
        n = x.shape[0]
        a = _acc(x).reshape(n, -1, self.cols)
        feats = {
            "a": [a],
            "rows": [slice(0, self.rows)],
            "eshape": [(n, a.shape[1], self.rows)],
        }
        return feats, [output]

    def grad_feature(self, slot: int, grad: torch.Tensor) -> torch.Tensor:
        return _acc(grad).reshape(grad.shape[0], -1, self.rows)
