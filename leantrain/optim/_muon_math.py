r"""Muon's math: Newton–Schulz orthogonalization, lr adjustment, one step (pure).

``newton_schulz`` is the quintic iteration of Keller Jordan's Muon, written with the
same operations in the same order as ``torch.optim.Muon`` so that, in bfloat16, it
gives the same bits. ``newton_schulz_reference`` is the slow, obvious definition: the
iteration acts on each singular value alone, so it is an SVD in float64 followed by
the scalar polynomial applied ``steps`` times.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from . import code_rounding
from .quant import (
    NearestCode,
    dequantize_blockwise,
    pack_nibbles,
    quantize_blockwise,
    unpack_nibbles,
)

__all__ = [
    "ADJUST_LR_FNS",
    "DEFAULT_NS_COEFFICIENTS",
    "adjust_lr",
    "default_ns_dtype",
    "muon_momentum",
    "muon_step",
    "muon_update",
    "newton_schulz",
    "newton_schulz_reference",
]

# Keller Jordan's coefficients: maximize the slope at zero, so small singular values
# grow fast; the result has singular values in roughly [0.7, 1.2], not exactly 1.
DEFAULT_NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def check_ns_arguments(
    steps: object, coefficients: object, eps: object, *, what: str = "ns"
) -> None:
    """Validates Newton–Schulz options, naming the offending value.

    Raises:
        ValueError: steps outside [0, 100), coefficients not three real numbers,
            eps negative.
        TypeError: steps not an int, eps not a real number.
    """
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral):
        raise TypeError(f"{what}_steps must be an int, got {steps!r}")
    if not 0 <= steps < 100:
        raise ValueError(f"Invalid {what}_steps: {steps}; allowed: 0 <= steps < 100")
    if (
        not isinstance(coefficients, (tuple, list))
        or len(coefficients) != 3
        or any(
            isinstance(c, bool) or not isinstance(c, numbers.Real) for c in coefficients
        )
    ):
        raise ValueError(
            f"Invalid {what}_coefficients: {coefficients!r}; allowed: three real "
            "numbers (a, b, c)"
        )
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps must be a real number, got {eps!r}")
    if not eps >= 0.0:
        raise ValueError(f"Invalid epsilon value: {eps}")


def _check_matrix(G: Tensor) -> None:
    if not isinstance(G, Tensor):
        raise TypeError(f"G must be a torch.Tensor, got {type(G).__name__}")
    if G.ndim != 2:
        raise ValueError(
            f"newton_schulz needs a 2-D matrix, got shape {tuple(G.shape)}"
        )


def newton_schulz(
    G: Tensor,
    steps: int = 5,
    coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
    eps: float = 1e-7,
    *,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    r"""Approximately orthogonalizes G: :math:`U S V^\top \mapsto U f(S) V^\top`.

    With :math:`X_0 = G / \max(\|G\|_F, \epsilon)` (wide orientation: transposed
    when G has more rows than columns), each step is
    :math:`X \leftarrow aX + (bA + cA^2)X` with :math:`A = XX^\top`, i.e. each
    singular value follows :math:`s \leftarrow as + bs^3 + cs^5`.

    Args:
        G: the (2-D) matrix, e.g. Muon's Nesterov momentum.
        steps: number of iterations (0 <= steps < 100).
        coefficients: (a, b, c) of the quintic.
        eps: floor of the Frobenius norm (a zero matrix stays zero).
        dtype: the dtype of the iteration. bfloat16 is Muon's choice on GPUs and
            matches ``torch.optim.Muon`` bit for bit; on CPUs without native
            bfloat16 GEMMs float32 is much faster.

    Returns:
        The orthogonalized matrix, shape and dtype of G.

    Raises:
        ValueError: G not 2-D, or invalid steps/coefficients/eps.

    Example:
        >>> import torch
        >>> X = newton_schulz(torch.randn(4, 6), dtype=torch.float32)
        >>> s = torch.linalg.svdvals(X)
        >>> bool(((s > 0.5) & (s < 1.5)).all())
        True
    """
    _check_matrix(G)
    check_ns_arguments(steps, tuple(coefficients), eps)
    if torch.is_autocast_enabled(G.device.type):
        # Under torch.autocast (an opt.step() inside the forward's autocast block)
        # the matmuls would run in autocast's dtype, not ``dtype``.
        with torch.autocast(G.device.type, enabled=False):
            return newton_schulz(G, steps, coefficients, eps, dtype=dtype)
    a, b, c = coefficients
    X = G.to(dtype)
    tall = G.size(0) > G.size(1)
    if tall:  # iterate on the wide side: the Gram matrix is the smaller one
        X = X.T
    # Frobenius norm >= spectral norm, so every singular value starts in [0, 1].
    X = X.div(X.norm().clamp(min=eps))
    for _ in range(steps):
        A = X @ X.T
        B = torch.addmm(A, A, A, beta=b, alpha=c)  # bA + cA^2
        X = torch.addmm(X, B, X, beta=a)  # aX + BX
    if tall:
        X = X.T
    return X.to(G.dtype)


def newton_schulz_reference(
    G: Tensor,
    steps: int = 5,
    coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
    eps: float = 1e-7,
) -> Tensor:
    r"""Slow, obvious Newton–Schulz: the quintic applied to G's singular values.

    Computes the SVD of G in float64, scales the singular values by
    :math:`1/\max(\|G\|_F, \epsilon)`, applies :math:`s \leftarrow as + bs^3 + cs^5`
    ``steps`` times and rebuilds :math:`U f(S) V^\top`. Independent of the matrix
    iteration in :func:`newton_schulz` (used to test it).

    Returns:
        float64 tensor of G's shape.
    """
    _check_matrix(G)
    check_ns_arguments(steps, tuple(coefficients), eps)
    a, b, c = coefficients
    G64 = G.detach().to(torch.float64)
    U, S, Vh = torch.linalg.svd(G64, full_matrices=False)
    s = S / max(float(torch.linalg.matrix_norm(G64)), eps)
    for _ in range(steps):
        s = a * s + b * s**3 + c * s**5
    return (U * s) @ Vh


def adjust_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    r"""Muon's per-matrix learning rate, as in ``torch.optim.Muon``.

    For an A x B matrix: None or "original" (Keller Jordan):
    :math:`\mathrm{lr}\sqrt{\max(1, A/B)}`; "match_rms_adamw" (Moonshot):
    :math:`0.2\,\mathrm{lr}\sqrt{\max(A, B)}`, which makes the update's RMS match
    AdamW's so AdamW's lr and weight decay can be reused.

    Raises:
        ValueError: an unknown ``adjust_lr_fn``.
    """
    rows, cols = shape[0], shape[1]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        # The ratio first, then lr * ratio: torch's rounding, to the last bit.
        return lr * (0.2 * math.sqrt(max(rows, cols)))
    raise ValueError(
        f"Invalid adjust_lr_fn: {adjust_lr_fn!r}; allowed: None, 'original', "
        "'match_rms_adamw'"
    )


def default_ns_dtype(device: torch.device) -> torch.dtype:
    # bfloat16 GEMMs are fast on GPUs; on AVX2 CPUs they are far slower than
    # float32 (CHANGELOG.md has the timings), so CPUs iterate in float32.
    return torch.bfloat16 if device.type == "cuda" else torch.float32


@torch.no_grad()
def muon_step(
    param: Tensor,
    grad: Tensor,
    state: dict,
    *,
    lr: float,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    ns_coefficients: tuple[float, float, float],
    ns_steps: int,
    eps: float,
    adjust_lr_fn: str | None,
    ns_dtype: torch.dtype,
    nearest: NearestCode | None = None,
    stochastic_codes: bool = False,
    seed: int = 0,
) -> None:
    r"""One Muon step for one 2-D parameter, in place (fp32 math): the reference.

    .. code-block:: text

        m  = lerp(m, g, 1 - momentum)          # stored quantized (or fp32)
        u  = lerp(g, m, momentum) if nesterov else m
        param *= 1 - lr * weight_decay
        param -= adjust_lr(lr) * newton_schulz(u)

    With quantized momentum, ``m`` is de-quantized, updated, and re-quantized with
    a fresh absmax per block for the next step; this step uses the exact new ``m``
    (as Gefen does, docs/gefen.md). With
    ``momentum_bits=None`` (state key ``exp_avg``) this is ``torch.optim.Muon``.
    It is :func:`muon_momentum` then :func:`muon_update`; on the GPU, GefenMuon
    runs the first half for all its parameters in one Triton launch
    (``_triton_momentum``) and the second as here.

    Args:
        param: a 2-D parameter (any floating dtype).
        grad: its gradient, same shape.
        state: the parameter's state (keys ``step``, ``period``, and ``exp_avg`` or
            ``exp_avg_codes``/``exp_avg_absmax``/``qblock``/``codebook``).
        lr, weight_decay, momentum, nesterov, ns_coefficients, ns_steps, eps,
            adjust_lr_fn: as in :class:`GefenMuon`.
        ns_dtype: dtype of the Newton–Schulz iteration.
        nearest: a quantizer for the state's codebook (built when None).
        stochastic_codes, seed: codes (4- or 8-bit) rounded stochastically, keyed by
            ``code_key(seed, step)`` (:mod:`leantrain.optim.code_rounding`).
    """
    state["step"] += 1
    update = muon_momentum(
        param,
        grad,
        state,
        momentum=momentum,
        nesterov=nesterov,
        nearest=nearest,
        stochastic_codes=stochastic_codes,
        seed=seed,
    )
    muon_update(
        param,
        update,
        lr=lr,
        weight_decay=weight_decay,
        ns_coefficients=ns_coefficients,
        ns_steps=ns_steps,
        eps=eps,
        adjust_lr_fn=adjust_lr_fn,
        ns_dtype=ns_dtype,
    )


@torch.no_grad()
def muon_momentum(
    param: Tensor,
    grad: Tensor,
    state: dict,
    *,
    momentum: float,
    nesterov: bool,
    nearest: NearestCode | None = None,
    stochastic_codes: bool = False,
    seed: int = 0,
) -> Tensor:
    """The momentum half of :func:`muon_step` (``state['step']`` already advanced):
    updates the stored momentum and returns the Newton–Schulz input, the exact
    new fp32 ``m`` or the Nesterov blend ``lerp(g, m, momentum)``."""
    g = grad.float()
    if "exp_avg" in state:
        buf = state["exp_avg"]
        buf.lerp_(g, 1 - momentum)
    else:
        codebook, qblock, n = state["codebook"], int(state["qblock"]), param.numel()
        packed = codebook.numel() == 16
        codes = state["exp_avg_codes"]
        codes = unpack_nibbles(codes, n) if packed else codes
        m = dequantize_blockwise(codes, state["exp_avg_absmax"], qblock, codebook)
        m = m.view(param.shape).lerp_(g, 1 - momentum)
        if nearest is None:
            nearest = NearestCode(codebook)
        flat = m.reshape(-1)
        # No host-side checks on the step's path: m is finite (the optimizer
        # rejected non-finite gradients before) and a 16-code codebook's codes are
        # at most 15; each check would make the host wait for a CUDA device.
        codes, absmax = quantize_blockwise(flat, qblock, nearest, check_finite=False)
        if stochastic_codes:
            key = code_rounding.code_key(seed, int(state["step"]))
            each = absmax.repeat_interleave(qblock)[:n]
            codes = code_rounding.round_blocks(flat, each, codebook, key, 0, codes)
        state["exp_avg_absmax"].copy_(absmax)
        if packed:
            codes = pack_nibbles(codes, check_range=False)
        state["exp_avg_codes"].copy_(codes)
        buf = m  # the exact new momentum; only the stored copy is quantized
    return g.lerp(buf, momentum) if nesterov else buf


@torch.no_grad()
def muon_update(
    param: Tensor,
    update: Tensor,
    *,
    lr: float,
    weight_decay: float,
    ns_coefficients: tuple[float, float, float],
    ns_steps: int,
    eps: float,
    adjust_lr_fn: str | None,
    ns_dtype: torch.dtype,
) -> None:
    """The update half of :func:`muon_step`: decays ``param`` and moves it by the
    orthogonalized ``update`` (:func:`muon_momentum`'s result), in place."""
    update = newton_schulz(update, ns_steps, ns_coefficients, eps, dtype=ns_dtype)
    scaled_lr = adjust_lr(lr, adjust_lr_fn, param.shape)
    w = param if param.dtype == torch.float32 else param.float()
    w.mul_(1 - lr * weight_decay)
    w.add_(update, alpha=-scaled_lr)
    if w is not param:
        param.copy_(w)
