"""Convolution patches for the Kronecker input factor, gathered cheaply.

``A = sum_{n,t} a_t a_t^T / N`` over the im2col patches ``a_t`` of a Conv2d input is
one ``(N L, K)`` Gram matrix. ``F.unfold`` gives the patches as ``(N, K, L)``, and the
transposing copy into ``(N L, K)`` plus the unfold itself cost more than the Gram
product's arithmetic at the sizes of a small CNN. Gathering from a channels-last copy
of the input instead makes the innermost run of the copy contiguous (the channels), so
the patches come out in *kernel-major* column order ``(kh, kw, C)`` in one fast copy;
:func:`canonical_order` permutes the (small) factor back to the weight's ``(C, kh,
kw)`` order. The canonical patches, which per-example quantities need, are built only
when asked for (:class:`LazyFeats`, :class:`LazySite`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ._base import Site

__all__ = ["LazyFeats", "LazySite", "canonical_order", "kernel_major_patches"]


def kernel_major_patches(
    x: torch.Tensor,
    kernel: tuple[int, int],
    dilation: tuple[int, int],
    padding: tuple[int, int],
    stride: tuple[int, int],
) -> torch.Tensor:
    """Patches ``(N, L, kh*kw*C)`` of ``x`` ``(N, C, H, W)``; columns ``(kh, kw, C)``.

    Zero padding only (the op rejects other padding modes).
    """
    n, c, h, w = x.shape
    (kh, kw), (dh, dw), (ph, pw), (sh, sw) = kernel, dilation, padding, stride
    xp = F.pad(x, (pw, pw, ph, ph)).permute(0, 2, 3, 1).contiguous()  # (N, H', W', C)
    oh = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    ow = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    s_n, s_h, s_w, s_c = xp.stride()
    view = xp.as_strided(
        (n, oh, ow, kh, kw, c), (s_n, s_h * sh, s_w * sw, s_h * dh, s_w * dw, s_c)
    )
    return view.reshape(n, oh * ow, kh * kw * c)


def canonical_order(channels: int, kh: int, kw: int, bias: bool) -> torch.Tensor:
    """Index ``p`` with ``M_canonical = M_kernel_major[p][:, p]`` (bias column last)."""
    c = torch.arange(channels).reshape(-1, 1, 1)
    i = torch.arange(kh).reshape(1, -1, 1)
    j = torch.arange(kw).reshape(1, 1, -1)
    perm = ((i * kw + j) * channels + c).reshape(-1)  # canonical (c, i, j) -> (i, j, c)
    if bias:
        perm = torch.cat([perm, torch.tensor([perm.numel()])])
    return perm


class LazyFeats(dict):
    """Forward features whose canonical ``"a"`` is computed on first access."""

    def __init__(self, make_a: Callable[[], list[torch.Tensor]], **items) -> None:
        super().__init__(**items)
        self._make_a = make_a

    def __missing__(self, key: str):
        if key != "a":
            raise KeyError(key)
        self["a"] = value = self._make_a()
        return value


class LazySite(Site):
    """A :class:`Site` whose inputs ``a`` are computed on first access."""

    def __init__(
        self, rows: slice, make_a: Callable[[], torch.Tensor], e: torch.Tensor
    ) -> None:
        self.rows, self.e, self._make_a, self._a = rows, e, make_a, None

    @property
    def a(self) -> torch.Tensor:  # type: ignore[override]
        if self._a is None:
            self._a = self._make_a()
        return self._a
