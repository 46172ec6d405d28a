r"""GefenMuon: Muon on a codebook-quantized momentum, with a Gefen-AdamW side group.

Muon (Keller Jordan; ``torch.optim.Muon``) updates a weight matrix with the
Newton–Schulz orthogonalization of its Nesterov momentum. GefenMuon stores that
momentum like Gefen stores AdamW's: uint8 codes into one learned codebook shared by
the whole optimizer, plus one fp32 absmax per block (docs/CONTRACTS.md "Gefen state"
without ``exp_avg_sq``), about 1 byte per parameter instead of Muon's 4.

Muon is for the 2-D weights of hidden layers. Every other parameter (biases, norms,
convolution kernels, and any parameter a group marks ``use_muon=False``) is trained
by Gefen's AdamW update in the same optimizer, so ``GefenMuon(model.parameters())``
works on any model. The pure math is :func:`newton_schulz`, :func:`adjust_lr` and
:func:`muon_step`; the class is bookkeeping.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from . import _checks, _triton_momentum, _triton_step
from ._base import GefenBase
from ._dispatch import StepItem
from ._first_codebook import learn_first_codebook
from ._muon_groups import ADAMW_KEYS, items_of, muon_param_groups, tensor_of
from ._muon_math import (
    DEFAULT_NS_COEFFICIENTS,
    adjust_lr,
    default_ns_dtype,
    muon_step,
    newton_schulz,
    newton_schulz_reference,
)
from ._muon_state import check_muon_options, check_ns_dtype, load_pre_hook
from ._options import options_of, resolved, stochastic_codes_of, update_clip_of
from ._state import new_state
from ._state_dict import load_post_hook  # the same as Gefen's: install state as saved
from .gefen import block_period
from .quant import NearestCode

__all__ = [
    "GefenMuon",
    "adjust_lr",
    "muon_param_groups",
    "muon_step",
    "newton_schulz",
    "newton_schulz_reference",
]


class GefenMuon(GefenBase):
    r"""Muon with a Gefen-quantized momentum, and Gefen-AdamW for the other params.

    For a 2-D parameter (a "Muon parameter") each step is ``torch.optim.Muon``'s
    (see :func:`muon_step`) with the momentum stored as ``momentum_bits``-bit codes
    into one codebook (learned from the first gradients, like Gefen's) times one
    fp32 absmax per block of the parameter's period. With ``momentum_bits=None`` it
    is ``torch.optim.Muon`` exactly. Other parameters are updated by Gefen's AdamW
    step (``_step.reference_step``, run by its fused twin as in Gefen) with the
    ``adamw_*`` options. Sharded (DTensor) parameters are not supported.

    Routing: a group's ``use_muon`` key decides. ``True``: every parameter must be
    2-D. ``False``: an AdamW group; its ``lr``, ``betas``, ``eps`` and
    ``weight_decay`` are the AdamW values (those not given come from the group's or
    the optimizer's ``adamw_*`` options). Absent or ``None`` (e.g.
    ``GefenMuon(model.parameters())``): the group is split into a Muon group of its
    2-D parameters and an AdamW group of the rest, so ``param_groups`` may have more
    entries than the groups passed in. Embeddings and output heads are 2-D but are
    better trained by AdamW (Keller Jordan; Moonshot): route them with a
    ``use_muon=False`` group, e.g. built by :func:`muon_param_groups`.

    Args:
        params: parameters or param groups (see routing above).
        lr: Muon learning rate (before :func:`adjust_lr`).
        weight_decay: Muon decoupled weight decay (``param *= 1 - lr * wd``).
        momentum: Muon momentum, in [0, 1).
        nesterov: use the Nesterov momentum ``lerp(g, m, momentum)``.
        ns_coefficients: (a, b, c) of the quintic Newton–Schulz iteration.
        eps: floor of the Frobenius norm in Newton–Schulz.
        ns_steps: Newton–Schulz iterations.
        adjust_lr_fn: None/"original" (``lr * sqrt(max(1, rows/cols))``) or
            "match_rms_adamw" (``0.2 * lr * sqrt(max(rows, cols))``).
        momentum_bits: 8, 4 or None (fp32 momentum), for both sides.
        momentum_rounding: "auto" (stochastic 4-bit codes, nearest 8-bit ones),
            "nearest" or "stochastic", for both sides; as Gefen's.
        update_clip: the AdamW side's bound on each element's step in units of
            its lr, as Gefen's ("auto": 1.0 for 4-bit momentum with
            ``partition="element"``, None otherwise: this side keeps blocks).
        partition: Gefen's block length: "auto" (from the first gradient),
            "element", "tensor" or an int. For Muon parameters it sets the momentum
            quantization block (``qblock``); for AdamW ones also the second moment's.
        ns_dtype: dtype of the Newton–Schulz iteration; None picks bfloat16 on CUDA
            (Muon's choice, ``torch.optim.Muon``'s bits) and float32 elsewhere
            (bfloat16 matrix products are much slower on AVX2 CPUs).
        adamw_lr: learning rate of the AdamW side.
        adamw_betas: (beta1, beta2) of the AdamW side.
        adamw_eps: eps of the AdamW side.
        adamw_weight_decay: decoupled weight decay of the AdamW side.
        nonfinite: "skip" (a step with a NaN/inf gradient changes nothing, counted
            in ``nonfinite_steps``, warns) or "raise" (``FloatingPointError``).

    Raises:
        ValueError: an invalid option, or a ``use_muon=True`` parameter that is not
            2-D, naming the value.
        TypeError: a complex or non-floating parameter.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
        ...                             torch.nn.Linear(16, 2))
        >>> opt = GefenMuon(model.parameters(), lr=0.02, adamw_lr=1e-3)
        >>> [g["use_muon"] for g in opt.param_groups]
        [True, False]
        >>> model(torch.randn(4, 8)).square().mean().backward()
        >>> opt.step()
        >>> sorted(opt.state[model[0].weight])
        ['codebook', 'exp_avg_absmax', 'exp_avg_codes', 'period', 'qblock', 'step']
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        momentum_bits: int | None = 8,
        partition: str | int = "auto",
        ns_dtype: torch.dtype | None = None,
        adamw_lr: float = 3e-4,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-10,
        adamw_weight_decay: float = 0.0,
        nonfinite: str = "skip",
        momentum_rounding: str = "auto",
        update_clip: float | str | None = "auto",
    ) -> None:
        check_muon_options(
            lr,
            weight_decay,
            momentum,
            nesterov,
            ns_coefficients,
            eps,
            ns_steps,
            adjust_lr_fn,
        )
        _checks.check_hyperparameters(
            adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay
        )
        _checks.check_momentum_bits(momentum_bits)
        resolved(momentum_rounding, momentum_bits)
        _checks.check_partition(partition)
        _checks.check_nonfinite(nonfinite)
        update_clip_of({"momentum_bits": momentum_bits, "update_clip": update_clip})
        check_ns_dtype(ns_dtype)
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients),
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "momentum_bits": momentum_bits,
            "partition": partition,
            "ns_dtype": ns_dtype,
            "adamw_lr": adamw_lr,
            "adamw_betas": tuple(adamw_betas),
            "adamw_eps": adamw_eps,
            "adamw_weight_decay": adamw_weight_decay,
            "momentum_rounding": momentum_rounding,
            "update_clip": update_clip,
        }
        self.nonfinite = nonfinite
        self.nonfinite_steps = 0
        super().__init__(params, defaults)
        self.register_load_state_dict_pre_hook(load_pre_hook)
        self.register_load_state_dict_post_hook(load_post_hook)

    takes_dtensors = False  # Newton-Schulz needs whole matrices (see _add_checked)

    def add_param_group(self, param_group: dict) -> None:
        """Adds a group; one without ``use_muon`` is split into a Muon and an AdamW
        group (see the class docstring). Validates options and parameters."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group)}")
        use_muon = param_group.get("use_muon")
        if use_muon is not None and not isinstance(use_muon, bool):
            raise ValueError(
                f"Invalid use_muon: {use_muon!r}; allowed: True, False, None"
            )
        items = items_of(param_group["params"])
        if use_muon is None:
            muon = [i for i in items if getattr(tensor_of(i), "ndim", None) == 2]
            other = [i for i in items if getattr(tensor_of(i), "ndim", None) != 2]
            parts = [(True, muon)] if muon or not other else []
            parts += [(False, other)] if other else []
        else:
            parts = [(use_muon, items)]
        for is_muon, part in parts:
            group = {**param_group, "params": part, "use_muon": is_muon}
            if not is_muon:
                for key, adamw_key in ADAMW_KEYS.items():
                    if use_muon is None or key not in param_group:
                        group[key] = param_group.get(
                            adamw_key, self.defaults[adamw_key]
                        )
            self._add_checked(group)

    def _add_checked(self, group: dict) -> None:
        super().add_param_group(group)
        group = self.param_groups[-1]
        try:
            if group["use_muon"]:
                check_muon_options(
                    group["lr"],
                    group["weight_decay"],
                    group["momentum"],
                    group["nesterov"],
                    group["ns_coefficients"],
                    group["eps"],
                    group["ns_steps"],
                    group["adjust_lr_fn"],
                )
            else:
                group["betas"] = tuple(group["betas"])
                _checks.check_hyperparameters(
                    group["lr"], group["betas"], group["eps"], group["weight_decay"]
                )
            _checks.check_momentum_bits(group["momentum_bits"])
            stochastic_codes_of(group)  # validates momentum_rounding
            update_clip_of(group)  # validates update_clip
            _checks.check_partition(group["partition"])
            check_ns_dtype(group["ns_dtype"])
            for position, param in enumerate(group["params"]):
                label = _label(group, position, param)
                _checks.check_param(param, label)
                if type(param).__name__ == "DTensor":
                    raise TypeError(
                        f"GefenMuon: {label} is a sharded DTensor; GefenMuon needs "
                        "whole tensors (Newton-Schulz works on the full matrix)"
                    )
                if group["use_muon"] and param.ndim != 2:
                    raise ValueError(
                        f"GefenMuon: {label} is in a use_muon=True group but Muon "
                        "needs 2-D parameters; put it in a use_muon=False group"
                    )
        except (ValueError, TypeError):
            self.param_groups.pop()
            raise

    def _label(self, group: dict, position: int, param: Tensor, index: int) -> str:
        return _label(group, position, param)

    def _init_states(self, active: list[tuple[dict, Tensor, str]]) -> None:
        """Creates the state of parameters on their first gradient; learns a codebook
        per momentum width from all of them when the optimizer has none yet."""
        fresh = [(group, p) for group, p, _ in active if not self.state[p]]
        if not fresh:
            return
        periods = {p: block_period(group["partition"], p) for group, p in fresh}
        codebooks: dict[int, Tensor] = {}
        for bits in {group["momentum_bits"] for group, _ in fresh} - {None}:
            codebook = self._codebook(bits)
            if codebook is None:
                codebook = learn_first_codebook(
                    bits,
                    [
                        (group, p, periods[p])
                        for group, p in fresh
                        if group["momentum_bits"] == bits
                    ],
                )
            codebooks[bits] = codebook.to(fresh[0][1].device)
        for group, param in fresh:
            bits = group["momentum_bits"]
            state = new_state(param, periods[param], bits, codebooks.get(bits))
            if group["use_muon"]:
                del state["exp_avg_sq"]  # Muon keeps no second moment
            self.state[param] = state

    # torch.compile(opt.step) runs this step eagerly: it is one native call (or the
    # chunked fallback) over every parameter, which Dynamo cannot trace, and a
    # partial trace around it changed results silently; eager is bit-exact.
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Performs one optimization step.

        Args:
            closure: re-evaluates the model and returns the loss; it runs first, so
                its gradients feed this step (the first step, codebook included).

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        active = self._active()
        if not self._all_finite(active):
            return loss
        self._check_bits(active)
        self._init_states(active)
        # As in Gefen: a parameter's position keys its rounding streams, and
        # momentum_rounding="auto" rounds 4-bit codes stochastically (both sides).
        position = self._positions()
        on_triton = []  # momentum through one Triton launch (per gradient dtype)
        for group, param, _ in active:
            if not group["use_muon"]:
                continue
            state = self.state[param]
            if self._takes_triton(param, state):
                on_triton.append(
                    _triton_momentum.MuonEntry(group, param, state, position[id(param)])
                )
                continue
            codebook = state.get("codebook")
            muon_step(
                param,
                param.grad,
                state,
                lr=float(group["lr"]),
                weight_decay=float(group["weight_decay"]),
                momentum=float(group["momentum"]),
                nesterov=group["nesterov"],
                ns_coefficients=group["ns_coefficients"],
                ns_steps=group["ns_steps"],
                eps=float(group["eps"]),
                adjust_lr_fn=group["adjust_lr_fn"],
                ns_dtype=group["ns_dtype"] or default_ns_dtype(param.device),
                nearest=None if codebook is None else self._quantizer(codebook),
                stochastic_codes=stochastic_codes_of(group),
                seed=position[id(param)],
            )
        if on_triton:
            tables = self.__dict__.get("_momentum_tables")
            if tables is None:  # the job tables, kept while the same states step
                tables = self._momentum_tables = _triton_momentum.MomentumTables()
            _triton_momentum.step_on_triton(on_triton, tables)
        # The AdamW side: Gefen's dispatch, one kernel call (or a few Triton
        # launches) for all of it; a steady step through its cached plan.
        groups = [g for g in self.param_groups if not g["use_muon"]]
        if self._planned_step(groups):
            return loss
        adamw = [(g, p, label) for g, p, label in active if not g["use_muon"]]
        items = []
        for group, param, _ in adamw:
            state = self.state[param]
            # Codes' "auto" rounding as for a fresh state (this side has always
            # resolved it so); the clip from the state, as Gefen's.
            options = replace(
                options_of(group, state, maximize=False),
                stochastic_codes=stochastic_codes_of(group),
            )
            items.append(
                StepItem(param, param.grad, state, options, position[id(param)])
            )
        self._dispatched_step(groups, adamw, items)
        return loss

    def _takes_triton(self, param: Tensor, state: dict) -> bool:
        """Whether a Muon parameter's momentum takes the Triton kernel: it is
        quantized (fp32 momentum keeps ``torch.optim.Muon``'s own ops, bit for
        bit), its device is one ``_triton_step.serves`` (asked once per device,
        whose answer it is, so a CPU step enters no Triton module) and the kernel
        covers its tensors."""
        served = self.__dict__.setdefault("_served_devices", {})
        if param.device not in served:
            served[param.device] = _triton_step.serves(param.device)
        return (
            served[param.device]
            and "codebook" in state
            and _triton_momentum.problem(param, param.grad, state) is None
        )

    def _quantizer(self, codebook: Tensor) -> NearestCode:
        """The quantizer of ``codebook``, built once and kept while the codebook is
        unchanged (the same tensor, no in-place change): building one reads the
        codebook on the host and copies its tables to the device, and per step
        that would make the host wait for the device every step."""
        cache = self.__dict__.setdefault("_quantizers", {})
        entry = cache.get(id(codebook))
        version = codebook._version  # bumped by every in-place change
        if entry is None or entry[0]() is not codebook or entry[1] != version:
            for key in [k for k, (ref, _, _) in cache.items() if ref() is None]:
                del cache[key]  # codebooks gone (a load_state_dict replaced them)
            entry = (weakref.ref(codebook), version, NearestCode(codebook))
            cache[id(codebook)] = entry
        return entry[2]


def _label(group: dict, position: int, param: Tensor) -> str:
    names = group.get("param_names")
    if names is not None and position < len(names):
        return f"parameter '{names[position]}' (shape {tuple(param.shape)})"
    return f"parameter {position} of its group (shape {tuple(param.shape)})"
