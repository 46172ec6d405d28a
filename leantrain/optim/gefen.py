"""Gefen: AdamW with about one byte of optimizer state per parameter.

The class is bookkeeping only (param groups, lazy state, the first-step partition
and codebook, checkpoints, the non-finite gradient policy); the update itself is the
pure function ``_step.reference_step``; ``step()`` runs its fused twin
``_fused.fused_step`` (a C kernel, or chunked PyTorch without a compiler), which a
parity test holds equal to the reference.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.optimizer import ParamsT

from . import _checks
from ._state import check_state, new_state, qblock_for, share_codebooks, state_bits
from ._fused import fused_step

__all__ = ["Gefen"]

# Keys kept on the CPU (0-dim bookkeeping, like torch's non-capturable `step`).
_HOST_KEYS = ("step", "period", "qblock")


def _label(group: dict, position: int, param: Tensor, index: int) -> str:
    """Names a parameter in messages: its name when the groups carry names."""
    names = group.get("param_names")
    if names is not None and position < len(names):
        return f"parameter '{names[position]}' (shape {tuple(param.shape)})"
    return f"parameter {index} (shape {tuple(param.shape)})"


class Gefen(Optimizer):
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
    ) -> None:
        _checks.check_hyperparameters(lr, betas, eps, weight_decay)
        _checks.check_momentum_bits(momentum_bits)
        _checks.check_partition(partition)
        _checks.check_nonfinite(nonfinite)
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "momentum_bits": momentum_bits,
            "partition": partition,
            "maximize": maximize,
        }
        self.nonfinite = nonfinite
        self.nonfinite_steps = 0
        super().__init__(params, defaults)
        self.register_load_state_dict_pre_hook(_load_pre_hook)
        self.register_load_state_dict_post_hook(_load_post_hook)

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

    def _active(self) -> list[tuple[dict, Tensor, str]]:
        """(group, param, label) of every parameter with a non-empty gradient."""
        active, index = [], 0
        for group in self.param_groups:
            for position, param in enumerate(group["params"]):
                label = _label(group, position, param, index)
                index += 1
                if param.grad is None or param.numel() == 0:
                    continue
                _checks.check_grad(param.grad, label)
                active.append((group, param, label))
        return active

    def _all_finite(self, active: list[tuple[dict, Tensor, str]]) -> bool:
        """Applies the non-finite policy; False means: skip this whole step."""
        for _, param, label in active:
            if _checks.is_finite(param.grad):
                continue
            if self.nonfinite == "raise":
                raise FloatingPointError(f"Gefen: non-finite gradient in {label}")
            self.nonfinite_steps += 1
            warnings.warn(
                f"Gefen: non-finite gradient in {label}; step skipped, parameters "
                f"and state unchanged ({self.nonfinite_steps} skipped so far)",
                RuntimeWarning,
                stacklevel=3,
            )
            return False
        return True

    def _period(self, group: dict, param: Tensor) -> int:
        """Block length of a parameter's second moment, from its first gradient."""
        partition, n = group["partition"], param.numel()
        if partition == "element":
            return 1
        if partition == "tensor":
            return n
        if partition != "auto":
            return min(int(partition), n)
        from .partition import choose_period

        period = int(choose_period(param.grad))
        if not 1 <= period <= n:
            raise ValueError(
                f"choose_period returned {period} for a tensor of {n} elements; "
                f"expected 1 <= p <= {n}"
            )
        return period

    def _codebook(self, bits: int) -> Tensor | None:
        """The optimizer's codebook for ``bits`` if any parameter holds one."""
        for state in self.state.values():
            codebook = state.get("codebook")
            if codebook is not None and codebook.numel() == 2**bits:
                return codebook
        return None

    def _init_states(self, active: list[tuple[dict, Tensor, str]]) -> None:
        """Creates the state of parameters getting their first gradient.

        The first gradient decides the partition and, if no codebook exists yet for
        a momentum width, the codebook: the histogram of every such gradient divided
        by its block absmax, summed, fed to the exact 1-D k-means.
        """
        fresh = [(g, p) for g, p, _ in active if not self.state[p]]
        if not fresh:
            return
        periods = {p: self._period(g, p) for g, p in fresh}
        codebooks: dict[int, Tensor] = {}
        for bits in {g["momentum_bits"] for g, _ in fresh} - {None}:
            codebook = self._codebook(bits)
            if codebook is None:
                codebook = self._learn_codebook(
                    bits,
                    [
                        (g, p, periods[p])
                        for g, p in fresh
                        if g["momentum_bits"] == bits
                    ],
                )
            codebooks[bits] = codebook
        for group, param in fresh:
            bits = group["momentum_bits"]
            self.state[param] = new_state(
                param, periods[param], bits, codebooks.get(bits)
            )

    @staticmethod
    def _learn_codebook(bits: int, members: list[tuple[dict, Tensor, int]]) -> Tensor:
        from .codebook import histogram, learn_codebook

        counts = None
        for group, param, period in members:
            g = param.grad.reshape(-1).float()
            if group["maximize"]:
                g = -g
            # Normalize by the momentum's own quantization blocks (qblock): the
            # codebook must fit m / absmax, also for per-element second moments.
            h = histogram(g, qblock_for(period))
            counts = h if counts is None else counts + h
        codebook = learn_codebook(counts, 2**bits).to(torch.float32)
        return codebook.to(members[0][1].device)

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
        active = self._active()
        if not self._all_finite(active):
            return loss
        for group, param, label in active:
            state = self.state[param]
            if state and state_bits(state) != group["momentum_bits"]:
                raise ValueError(
                    f"{label}: its state holds momentum_bits={state_bits(state)} but "
                    f"its group now says {group['momentum_bits']}; momentum_bits "
                    "cannot change after the first step"
                )
        self._init_states(active)
        for group, param, _ in active:
            beta1, beta2 = group["betas"]
            fused_step(
                param,
                param.grad,
                self.state[param],
                lr=float(group["lr"]),
                beta1=float(beta1),
                beta2=float(beta2),
                eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]),
                maximize=group["maximize"],
            )
        return loss


def _load_pre_hook(optimizer: Gefen, state_dict: dict) -> dict | None:
    """Validates a Gefen state dict and keeps its per-parameter state aside.

    torch's ``load_state_dict`` casts every floating-point parameter's state to the
    parameter dtype (uint8 codes and int64 periods included). Gefen's state has
    fixed dtypes, so the per-parameter state is taken out here and installed
    unchanged (moved to the parameter's device) by ``_load_post_hook``.
    """
    groups, saved_groups = optimizer.param_groups, state_dict["param_groups"]
    if len(groups) != len(saved_groups) or any(
        len(g["params"]) != len(s["params"])
        for g, s in zip(groups, saved_groups, strict=True)
    ):
        return None  # torch raises its own ValueError for these
    for index, (group, saved) in enumerate(zip(groups, saved_groups, strict=True)):
        if "momentum_bits" not in saved or "partition" not in saved:
            raise ValueError(
                f"not a Gefen state dict: param group {index} has no 'momentum_bits'/"
                f"'partition' (its keys: {sorted(saved)})"
            )
        if saved["momentum_bits"] != group["momentum_bits"]:
            raise ValueError(
                f"param group {index}: the state dict has momentum_bits="
                f"{saved['momentum_bits']}, this optimizer momentum_bits="
                f"{group['momentum_bits']}"
            )
        _checks.check_group({**saved, "betas": tuple(saved["betas"])})
    id_map, where = {}, {}
    index = 0
    for group, saved in zip(groups, saved_groups, strict=True):
        for position, (param, saved_id) in enumerate(
            zip(group["params"], saved["params"], strict=True)
        ):
            id_map[saved_id] = param
            where[saved_id] = (group, position, index, saved["momentum_bits"])
            index += 1
    pending = {}
    for saved_id, state in state_dict["state"].items():
        if saved_id not in id_map:
            continue
        group, position, index, bits = where[saved_id]
        param = id_map[saved_id]
        check_state(state, param, bits, _label(group, position, param, index))
        pending[param] = state
    optimizer._pending_state = pending
    rest = {k: v for k, v in state_dict["state"].items() if k not in id_map}
    return {**state_dict, "state": rest}


def _load_post_hook(optimizer: Gefen) -> None:
    """Installs the kept state (fp32 as saved) and re-shares the codebooks."""
    pending = optimizer.__dict__.pop("_pending_state", {})
    copies: dict[int, Tensor] = {}  # keeps tensors shared in the checkpoint shared
    for param, saved in pending.items():
        state = {}
        for key, value in saved.items():
            if id(value) not in copies:
                device = "cpu" if key in _HOST_KEYS else param.device
                copies[id(value)] = value.to(device=device, copy=True)
            state[key] = copies[id(value)]
        optimizer.state[param] = state
    share_codebooks(list(optimizer.state.values()))
