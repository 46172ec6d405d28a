"""Gefen: AdamW with about one byte of optimizer state per parameter.

The class is bookkeeping only (param groups, lazy state, the first-step partition
and codebook, checkpoints; the non-finite policy and the step's dispatch it shares
with GefenMuon through ``_base.GefenBase``); the update itself is the pure function
``_step.reference_step``. ``step()`` hands every parameter to the one dispatch,
``_dispatch.step_many``, which picks each one's implementation (a C kernel on the
CPU, Triton kernels on CUDA, eager chunked PyTorch where neither runs; parity tests
hold each equal to the reference). Every implementation takes one
``_options.StepOptions``, which ``_options.options_of`` resolves from a param group
and a state (the one place the "auto" options are decided). A steady step (same
parameters, states and options as the last) is one kernel call through the cached
``_fused_plan``: on the CPU it enters five files of leantrain/optim (this one,
``_base``, ``_fused_plan``, ``_options``, ``_cabi``; tests/optim/test_step_files.py
holds it to at most eight).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from . import _checks, _dist
from . import _reducible_partition as _partition
from ._base import GefenBase
from ._dispatch import StepItem
from ._first_codebook import learn_first_codebook
from ._options import options_of, resolved, second_moment_of, update_clip_of
from ._sharded import new_local_state
from ._state import check_factored, new_state
from ._state_dict import (
    LazyLabel,
    group_factors,
    load_post_hook,
    load_pre_hook,
    state_dict_post_hook,
)
from ._state_dict import fresh as _fresh
from ._state_dict import label as _label
from ._straddle import straddle_layout, straddling_step

__all__ = ["Gefen"]


def block_period(partition: int | str, param: Tensor) -> int:
    """Block length of a parameter's second moment, from the partition option and
    (for "auto") its first gradient ``param.grad``.

    Shared with GefenMuon's AdamW side, so a parameter gets the same period in both.
    """
    n = param.numel()
    if partition == "element":
        return 1
    if partition == "tensor":
        return n
    if partition != "auto":
        return min(int(partition), n)
    # The reducible twin of partition.choose_period: integer statistics, so the
    # period of the global tensor is the same on every rank and for every sharding
    # (single process included).
    grad = _dist.local(param.grad)
    if _dist.is_sharded(param):
        period = _partition.choose_period(
            grad,
            tuple(param.shape),
            _dist.my_span(param).start,
            _dist.reduce_sum_fn(_dist.group_of(param)),
        )
    else:
        period = _partition.choose_period(grad, tuple(param.shape))
    if not 1 <= period <= n:
        raise ValueError(
            f"choose_period returned {period} for a tensor of {n} elements; "
            f"expected 1 <= p <= {n}"
        )
    return period


def _own_v(group: dict, param: Tensor) -> bool:
    """True when every weight of ``param`` gets a second moment of its own."""
    return (
        second_moment_of(group, param) == "factored" or group["partition"] == "element"
    )


class Gefen(GefenBase):
    r"""AdamW with a block-shared second moment and a codebook-quantized momentum.

    A drop-in replacement for ``torch.optim.AdamW`` (same arguments, defaults and
    update rule) that keeps ~1 byte of state per parameter with 8-bit momentum and
    ~0.5 byte with 4-bit momentum, instead of AdamW's 8. See docs/gefen.md.

    Args:
        params: parameters or param groups, as for any torch optimizer.
        lr: learning rate.
        betas: (momentum decay, second-moment decay).
        eps: added to the bias-corrected :math:`\sqrt{v}`.
        weight_decay: decoupled weight decay, as in AdamW.
        momentum_bits: 8 or 4 (quantized momentum), or None (fp32 momentum). May be
            set per param group.
        partition: block length of the shared second moment: "auto" (chosen from
            the first gradient), "element" (per element, p = 1, exactly AdamW's
            second moment), "tensor" (one block per tensor) or an int block length.
            May be set per param group.
        maximize: maximize the objective instead of minimizing it.
        nonfinite: what a step does when a gradient holds NaN or inf: "skip" (leave
            every parameter and all state untouched, count it in
            ``nonfinite_steps`` and warn) or "raise" (``FloatingPointError``).
        stochastic_rounding: round the updated bf16/fp16 parameter stochastically
            (unbiased, so updates smaller than half an ulp are not lost) instead of
            to nearest. None: on for bf16 parameters, off otherwise. The random bits
            come from a counter-based hash of the parameter's index in the optimizer,
            the step and the element index, so a resumed run rounds identically.
            May be set per param group; no effect on fp32 parameters.
        momentum_rounding: how the stored momentum is rounded to its codes:
            "nearest" (the nearest code), "stochastic" (one of the two neighbouring
            codes, with the probabilities that keep the stored momentum unbiased,
            so a momentum whose gradient stops decays to 0, which nearest 8-bit
            codes do not guarantee) or "auto" (stochastic for 4-bit codes and for
            8-bit codes on a second moment of the weight's own, factored or
            per-element; nearest for 8-bit codes on a block-shared one). The random
            bits are keyed like ``stochastic_rounding``'s,
            on a stream of their own. May be set per param group; no effect on fp32
            momentum. See docs/gefen.md.
        second_moment: "blocks" (one second moment per block of ``partition``),
            "factored" (for parameters with two or more dims, Adafactor's row and
            column factors of :math:`g^2`, viewed as ``shape[0] x rest``; the
            momentum's absmax keeps its blocks; 1-D parameters keep blocks) or
            "auto" (with ``partition="auto"``): factored for every parameter with two
            or more dims (both sides >= 2), whatever the momentum bits; blocks for
            1-D tensors and for FSDP2-sharded parameters, which cannot factor yet.
            Factors close most of the gap to AdamW that a block-shared ``v``
            leaves (a 2,000-step GPT, 8-bit: 1.020x -> 1.003x AdamW's validation
            loss; an MLP on raw pixels: 1.16x -> 1.01x). May be set per param
            group. See docs/gefen.md.
        update_clip: the largest step of one element, in units of lr: each
            element's :math:`|\hat m / (\sqrt{\hat v} + \epsilon)|` is clipped to
            it (weight decay is not). None: no clipping (AdamW's update). "auto":
            1.0 for 4-bit momentum on a factored or per-element second moment (the
            4-bit default for matrices), None otherwise. The coarse 4-bit codes'
            rounding error, divided by a weight's own small :math:`\sqrt{v}`, can
            otherwise make steps of many lr (an MLP on pixels: validation loss
            1.035x -> 1.001x AdamW's over sixteen seeds, training loss 0.99x ->
            1.06x); Adam's own steps are about lr per element. May be set per
            param group. See docs/gefen.md, "Update clipping".

    Raises:
        ValueError: an invalid hyper-parameter, naming the value.
        TypeError: a complex or non-floating parameter.

    Example:
        >>> import torch
        >>> from leantrain.optim import Gefen
        >>> model = torch.nn.Linear(16, 4)
        >>> opt = Gefen(model.parameters(), lr=1e-2)
        >>> loss = model(torch.randn(8, 16)).square().mean()
        >>> loss.backward()
        >>> opt.step()
        >>> opt.state[model.weight]["exp_avg_codes"].dtype
        torch.uint8
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        momentum_bits: int | None = 8,
        partition: str | int = "auto",
        maximize: bool = False,
        nonfinite: str = "skip",
        stochastic_rounding: bool | None = None,
        momentum_rounding: str = "auto",
        second_moment: str = "auto",
        update_clip: float | str | None = "auto",
    ) -> None:
        _checks.check_hyperparameters(lr, betas, eps, weight_decay)
        _checks.check_momentum_bits(momentum_bits)
        resolved(momentum_rounding, momentum_bits)
        _checks.check_partition(partition)
        _checks.check_second_moment(second_moment, partition)
        _checks.check_nonfinite(nonfinite)
        update_clip_of({"momentum_bits": momentum_bits, "update_clip": update_clip})
        if stochastic_rounding not in (None, True, False):
            raise ValueError(
                "Invalid stochastic_rounding: "
                f"{stochastic_rounding!r} (allowed: None, True, False)"
            )
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "momentum_bits": momentum_bits,
            "partition": partition,
            "maximize": maximize,
            "stochastic_rounding": stochastic_rounding,
            "momentum_rounding": momentum_rounding,
            "second_moment": second_moment,
            "update_clip": update_clip,
        }
        self.nonfinite = nonfinite
        self.nonfinite_steps = 0
        super().__init__(params, defaults)
        self.register_load_state_dict_pre_hook(load_pre_hook)
        self.register_state_dict_post_hook(state_dict_post_hook)
        self.register_load_state_dict_post_hook(load_post_hook)

    def add_param_group(self, param_group: dict) -> None:
        """Adds a param group, validating its options and parameters."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            group["betas"] = tuple(group["betas"])
            _checks.check_group(group)
            for position, param in enumerate(group["params"]):
                _checks.check_param(param, _label(group, position, param, position))
        except (ValueError, TypeError):
            self.param_groups.pop()
            raise

    def _label(
        self, group: dict, position: int, param: Tensor, index: int
    ) -> LazyLabel:
        return LazyLabel(group, position, param, index)

    def _init_states(self, active: list[tuple[dict, Tensor, str]]) -> None:
        """Creates the state of parameters getting their first gradient.

        The first gradient decides the partition and, if no codebook exists yet for
        a momentum width, the codebook: the histogram of every such gradient divided
        by its block absmax, summed, fed to the exact 1-D k-means.
        """
        fresh = [(g, p) for g, p, _ in active if _fresh(self.state[p])]
        if not fresh:
            return
        for group, param in fresh:  # before any collective: every rank raises alike
            if group_factors(group, param) is not None and _dist.is_sharded(param):
                raise ValueError(
                    f"second_moment='factored' is not supported for FSDP2-sharded "
                    f"parameters (shape {tuple(param.shape)}: its column factor would "
                    "span every rank); use second_moment='auto' or 'blocks' for this "
                    "group"
                )
        periods = {p: block_period(g["partition"], p) for g, p in fresh}
        codebooks: dict[int, Tensor] = {}
        for bits in {g["momentum_bits"] for g, _ in fresh} - {None}:
            codebook = self._codebook(bits)
            if codebook is None:
                codebook = learn_first_codebook(
                    bits,
                    [
                        (g, p, periods[p])
                        for g, p in fresh
                        if g["momentum_bits"] == bits
                    ],
                )
            elif 0.0 not in codebook.tolist() and any(
                _own_v(g, p) and g["momentum_bits"] == bits for g, p in fresh
            ):
                # Codebooks learned before leantrain moved a code to exactly 0
                # (codebook.with_exact_zero) come back from old checkpoints; a
                # second moment of each weight's own divides their 0 residue by ~0.
                raise ValueError(
                    f"second_moment='factored' and partition='element' need a "
                    f"{bits}-bit codebook with an exact 0 code, and this optimizer's "
                    "(from an older checkpoint) has none; use the default blocks for "
                    "this group"
                )
            codebooks[bits] = codebook
        for group, param in fresh:
            bits, codebook = (
                group["momentum_bits"],
                codebooks.get(group["momentum_bits"]),
            )
            factors = group_factors(group, param)
            if _dist.is_sharded(param):
                self.state[param] = new_local_state(
                    param.to_local(),
                    _dist.my_span(param),
                    periods[param],
                    bits,
                    codebook,
                )
            else:
                self.state[param] = new_state(
                    _dist.local(param), periods[param], bits, codebook, factors
                )

    # torch.compile(opt.step) runs this step eagerly: it is one native call (or the
    # chunked fallback) over every parameter, which Dynamo cannot trace, and a
    # partial trace around it changed results silently; eager is bit-exact.
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Performs one optimization step.

        Args:
            closure: re-evaluates the model and returns the loss; it runs first, so
                the gradients it makes feed this step (the first step too).

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._planned_step(self.param_groups):  # a steady step: one call
            return loss
        active = self._active()
        if not self._all_finite(active):
            return loss
        if self._template_step(active):
            return loss
        self._check_bits(active)
        any_fresh = False
        for group, param, label in active:
            state = self.state[param]
            if _fresh(state):
                any_fresh = True
                continue
            check_factored(
                state, tuple(param.shape), second_moment_of(group, param, state), label
            )
        if any_fresh:
            self._init_states(active)
        straddling = []
        position = self._positions()
        items, layouts = [], self._steps.layouts
        for group, param, _ in active:
            seed = position[id(param)]
            state = self.state[param]
            layout = straddle_layout(state, param, layouts)
            if layout is not None:
                straddling.append((group, param, layout, seed))
                continue
            sharded = _dist.is_sharded(param)
            items.append(
                StepItem(
                    _dist.local(param),
                    _dist.local(param.grad),
                    state,
                    options_of(group, state),
                    seed=seed,
                    index0=_dist.my_span(param).start if sharded else 0,
                )
            )
        # no plan where shards straddle (their exchange is not planned): the
        # plan is built only when every active parameter is an item
        self._dispatched_step(self.param_groups, active, items)
        if straddling:
            straddling_step(self.state, straddling)
        return loss

    def _template_step(self, active: list[tuple[dict, Tensor, str]]) -> bool:
        """Recognizes DCP's optimizer-state initialisation (a step with every
        gradient zero at lr 0 on fresh parameters) and answers it with provisional
        states (``period`` 0) instead of learning a partition and a codebook from
        zeros. Parameters and existing states are untouched. True when it did."""
        if not active or any(float(g["lr"]) != 0.0 for g in self.param_groups):
            return False
        if not all(_fresh(self.state[p]) for _, p, _ in active):
            return False
        zero = [not bool(_dist.local(p.grad).any()) for _, p, _ in active]
        sharded = [p for _, p, _ in active if _dist.is_sharded(p)]
        if sharded:
            flags = torch.tensor(zero, dtype=torch.float32, device=sharded[0].device)
            group = _dist.group_of(sharded[0])
            zero = [bool(f) for f in _dist.all_reduce(flags, "min", group)]
        if not all(zero):
            return False
        for _, param, _ in active:
            self.state[param] = {
                "step": torch.tensor(0.0, dtype=torch.float32),
                "period": torch.tensor(0, dtype=torch.int64),
            }
        return True
