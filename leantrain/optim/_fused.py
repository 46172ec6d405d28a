r"""Gefen's step implementations and the one check that picks among them.

:func:`implementation` is the dispatch's one check: from the tensors' device,
dtype and layout it names the implementation that steps a parameter, and why a
CUDA parameter falls back (``_dispatch.step_many`` caches its answer per state;
:func:`fused_step` asks it for one parameter):

* **"c"** — fp32 or bf16 parameter and gradient on the CPU, contiguous, fp32
  state: ``_kernels/gefen_step.c`` through :func:`c_step` (one parameter) or
  ``_cabi.launch`` (all of a step's; see the C file's header).
* **"triton"** — CUDA tensors the Triton kernels cover (``_triton_step``: a few
  launches for all of a step's parameters).
* **"torch"** — everything else (fp16 on the CPU, no compiler,
  ``LEANTRAIN_NO_NATIVE=1``, CUDA without triton or a case the kernels do not
  cover): the same math in plain eager tensor ops over chunks of whole blocks
  (``_torch_step``; no ``torch.compile`` anywhere). On CUDA a one-time warning
  names why.

The reference oracle (``_step.reference_step``) is the fourth implementation: the
readable one, which parity tests hold every other to.

All quantize with the reference's rule (``quant.NearestCode``): with distinct
codebook values :math:`u_0 < \dots < u_{U-1}` and exact midpoints
:math:`\mu_j = (u_j + u_{j+1})/2`, the value index is
:math:`k = \#\{j: \mu_j < x\}` (a tie goes to the lower value) and the code is
the lowest code holding :math:`u_k` (see ``_quant_table``). Given the same momentum
they store identical codes.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from . import _cabi, _native, _triton_step
from ._options import StepOptions
from ._state_layout import state_layout
from ._torch_step import torch_step
from .code_rounding import code_key
from .factored import column_mean, update_factors
from .precision import default_stochastic, rounding_key

# Sub-chunk of the C kernel (None: its largest, 16384 elements); tests lower it to
# exercise the kernel's recompute path on small blocks.
C_CHUNK: int | None = None
# Below this many elements the kernel runs on one thread (a parallel region costs
# more than it saves).
_THREAD_MIN = 1 << 16


def backend() -> str:
    """The CPU backend in use: "c" (native kernel) or "torch" (fallback).

    ``_native.status()`` says why the kernel is not in use.
    """
    return "c" if _native.load() is not None else "torch"


# Parameter and gradient dtypes the C kernel reads and writes itself.
C_DTYPES = (torch.float32, torch.bfloat16)


def c_takes(name: str, t: Tensor) -> str | None:
    """Why the C kernel cannot read or write parameter or gradient ``t`` (None: it
    can). ``_dispatch`` asks it of each new gradient of a cached parameter."""
    if t.layout != torch.strided:
        return f"{name}: the C kernel needs a dense tensor, got layout {t.layout}"
    if t.dtype not in C_DTYPES or t.device.type != "cpu" or not t.is_contiguous():
        return (
            f"{name}: the C kernel needs a contiguous fp32 or bf16 CPU tensor, "
            f"got {t.dtype} on {t.device}, contiguous={t.is_contiguous()}"
        )
    return None


def c_problem(param: Tensor, grad: Tensor, state: dict) -> str | None:
    """Why the C kernel cannot take these tensors (None: it can): the C half of
    :func:`implementation`; ``c_step`` turns the answer into its ValueError."""
    for name, t in (("param", param), ("grad", grad)):
        if (why := c_takes(name, t)) is not None:
            return why
    names = (
        ("exp_avg_sq", "exp_avg_absmax", "codebook")
        if "codebook" in state
        else ("exp_avg_sq", "exp_avg")
    )
    for name in names:
        t = state[name]
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            return (
                f"{name}: the C kernel needs a contiguous fp32 CPU tensor, got "
                f"{t.dtype} on {t.device}, contiguous={t.is_contiguous()}"
            )
    codes = state.get("exp_avg_codes")
    if codes is not None and not (
        codes.dtype == torch.uint8
        and codes.device.type == "cpu"
        and codes.is_contiguous()
    ):
        return (
            f"exp_avg_codes: the C kernel needs contiguous uint8 CPU codes, got "
            f"{codes.dtype} on {codes.device}"
        )
    return None


Implementation = str  # "c", "triton" or "torch"


def implementation(
    param: Tensor, grad: Tensor, state: dict, stochastic: bool
) -> tuple[Implementation, str | None]:
    """The implementation that steps these tensors, and why a CUDA parameter takes
    the fallback (None otherwise): the dispatch's one check. ``stochastic``: the
    parameter is rounded stochastically.

    CPU tensors take the C kernel where :func:`c_problem` finds nothing (and the
    library loads), CUDA tensors the Triton kernels where
    ``_triton_step.problem`` finds nothing; the rest the eager fallback. Tests
    send CPU tensors to the Triton kernels (Triton's interpreter) by patching
    ``_triton_step.serves``.
    """
    if _triton_step.serves(param.device):
        why = _triton_step.problem(param, grad, state, stochastic)
        return ("triton", None) if why is None else ("torch", why)
    if _native.load() is not None and c_problem(param, grad, state) is None:
        return "c", None
    return "torch", None


def c_step(
    param: Tensor,
    grad: Tensor,
    state: dict,
    hyper: dict[str, float],
    *,
    chunk: int | None = None,
    threads: int | None = None,
    layout: tuple[int, int, int] | None = None,
    stochastic: bool = False,
    key: int = 0,
    code_key: int | None = None,
    index0: int = 0,
    cbar: float | Tensor | None = None,
    lib: ctypes.CDLL | None = None,
    checked: bool = False,
) -> None:
    """Runs the C kernel on one parameter (``state['step']`` already advanced).

    ``param`` and ``grad`` are fp32 or bf16 (each on its own); a bf16 parameter is
    written back rounded to nearest, or stochastically (``stochastic``, keyed by
    ``key``; see :mod:`leantrain.optim.precision`); with ``code_key`` its codes
    are rounded stochastically (:mod:`.code_rounding`); ``index0`` is the global
    flat index of its first element (a shard's offset); ``cbar``: a factored state's
    column-factor mean when the caller already advanced its factors (None: the
    kernel's first phase advances them from ``grad``). ``lib`` is the loaded library
    (default: :func:`_native.load`); ``checked`` says the caller already had
    :func:`c_problem` accept these tensors (``fused_step``: one check per step).

    Raises:
        ValueError: a tensor of the wrong dtype, device, layout or size (checked
            here, before any pointer reaches C), or an argument the kernel rejects.
        RuntimeError: the native library is not available.
        MemoryError: the kernel's per-thread buffers (~25 B x chunk each) do not fit.
    """
    lib = lib or _native.load()
    if lib is None:
        raise RuntimeError(f"native Gefen kernel unavailable: {_native.status()}")
    period, block, bits = layout or state_layout(param, state)
    n = param.numel()
    if grad.numel() != n:
        raise ValueError(f"grad has {grad.numel()} elements, param {n}")
    if not checked:
        problem = c_problem(param, grad, state)
        if problem is not None:
            raise ValueError(problem)
    max_chunk = _cabi.checked_library(lib)
    chunk = chunk or C_CHUNK or max_chunk
    if not 1 <= chunk <= max_chunk:
        raise ValueError(f"chunk {chunk}; allowed: 1 <= chunk <= {max_chunk}")
    interned: dict = {}  # the job's scalars, alive until launch returns
    job = _cabi.c_job(
        param,
        grad,
        state,
        hyper,
        layout=(period, block, bits),
        stochastic=stochastic,
        key=key,
        interned=interned,
        code_key=code_key,
        index0=index0,
        cbar=cbar,
    )
    threads = threads or (torch.get_num_threads() if n >= _THREAD_MIN else 1)
    _cabi.launch(lib, [job], chunk, threads)


def advance_factors(grad: Tensor, state: dict, beta2: float) -> Tensor | None:
    """A factored state's factor update (before its element loop, which needs the
    column means of the whole gradient) and their column mean, a 0-dim fp32 tensor
    on the state's device (kept there: a CUDA step does not wait to read it); None
    otherwise."""
    if "factored" not in state:
        return None
    rows = int(state["factored"])
    update_factors(grad, state["exp_avg_sq"], rows, beta2)
    return column_mean(state["exp_avg_sq"], rows)


def check_step(
    param: Tensor,
    grad: Tensor,
    state: dict,
    stochastic_rounding: bool | None,
    seed: object,
    stochastic_codes: bool = False,
) -> tuple[tuple[int, int, int], bool, bool] | None:
    """The checks of one parameter's step, before anything changes: its state
    layout ``(period, block, bits)``, whether it rounds the parameter
    stochastically and whether its codes, or None for an empty parameter (nothing
    to do).

    Raises:
        ValueError: grad and param differ in size, or the state does not fit.
        TypeError: a bad ``stochastic_rounding`` or a ``seed`` that is not an int.
    """
    n = param.numel()
    if grad.numel() != n:
        raise ValueError(f"grad has {grad.numel()} elements, param {n}")
    if n == 0:
        return None
    layout = state_layout(param, state)
    stochastic = default_stochastic(param.dtype, stochastic_rounding)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
    return layout, stochastic, bool(stochastic_codes) and layout[2] in (4, 8)


@torch.no_grad()
def fused_step(
    param: Tensor,
    grad: Tensor,
    state: dict,
    options: StepOptions | None = None,
    *,
    seed: int = 0,
    index0: int = 0,
    **fields: object,
) -> None:
    """Applies one Gefen step to ``param`` in place; same contract as
    ``_step.reference_step`` (same arguments, same state, same result to fp32
    rounding), on the fastest path available for these tensors.

    Parameters and gradients may be fp32, bf16 or fp16 (the math is fp32 either
    way). A bf16/fp16 parameter's updated fp32 value is written back rounded to
    nearest (``reference_step``'s rounding) or, with stochastic rounding, to one of
    its two neighbours, unbiasedly, with random bits from a counter-based hash of
    the element's flat index and ``rounding_key(seed, step)``
    (:mod:`leantrain.optim.precision`): deterministic given ``seed`` and the state's
    ``step``, so a resumed run continues bit-exactly.

    Args:
        options: the step's hyper-parameters (:class:`~._options.StepOptions`:
            ``stochastic_rounding`` None is "on for bf16 parameters, off
            otherwise", no effect on fp32; ``stochastic_codes`` keys the codes'
            rounding by ``code_key(seed, step)`` as ``reference_step`` does); or
            give its fields as keywords.
        seed: identifies the parameter's random stream; give every parameter its
            own (e.g. a base seed plus its index in the optimizer) and keep it
            across a checkpoint.
        index0: the global flat index of ``param``'s first element, when it is a
            shard of a larger parameter: the counter of both roundings' hashes.

    Raises:
        ValueError: grad and param differ in size, or the state's tensors do not fit
            the parameter (sizes, a period outside [1, numel], a codebook that is not
            16 or 256 sorted codes).
        TypeError: ``stochastic_rounding`` is not a bool or None, ``seed`` not an int.

    Example:
        >>> import torch
        >>> from leantrain.optim._state import new_state
        >>> p, g = torch.ones(6), torch.full((6,), 0.5)
        >>> state = new_state(p, period=3, bits=None, codebook=None)
        >>> fused_step(p, g, state, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8,
        ...            weight_decay=0.0, maximize=False)
        >>> torch.allclose(p, torch.full((6,), 0.9))
        True
    """
    o = options if options is not None else StepOptions(**fields)
    checked = check_step(
        param, grad, state, o.stochastic_rounding, seed, o.stochastic_codes
    )
    if checked is None:
        return
    layout, stochastic, codes_sr = checked
    state["step"] += 1
    key = rounding_key(seed, int(state["step"])) if stochastic else 0
    ckey = code_key(seed, int(state["step"])) if codes_sr else None
    hyper = o.scalars(float(state["step"]))
    kind, why = implementation(param, grad, state, stochastic)
    where = dict(stochastic=stochastic, key=key, code_key=ckey, index0=index0)
    if kind == "c":  # the kernel advances a factored state's factors itself
        c_step(param, grad, state, hyper, layout=layout, checked=True, **where)
    elif kind == "triton":  # the kernels advance the factors themselves
        job = _triton_step.job(param, grad, state, hyper, layout=layout, **where)
        _triton_step.launch([job])
    else:
        torch_fallback(param, grad, state, hyper, o.beta2, why, **where)


def torch_fallback(
    param: Tensor,
    grad: Tensor,
    state: dict,
    hyper: dict[str, float],
    beta2: float,
    why: str | None,
    *,
    stochastic: bool,
    key: int,
    code_key: int | None,
    index0: int,
) -> None:
    """The "torch" implementation of one parameter's step (``state['step']``
    already advanced); ``why``: the reason a CUDA parameter is here, warned once."""
    if why is not None:
        _triton_step.warn_fallback(why)
    cbar = advance_factors(grad, state, beta2)
    torch_step(
        param,
        grad,
        state,
        hyper,
        stochastic=stochastic,
        key=key,
        code_key=code_key,
        index0=index0,
        cbar=cbar,
    )
