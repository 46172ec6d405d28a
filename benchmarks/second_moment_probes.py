"""Second-moment probes: AdamW with the second moment of each matrix swapped.

A research harness for the question "which compact second moment would bring 8-bit
Gefen within 1 % of AdamW on the MLP?"
(docs/notebook/2026-12-02-gefen-not-the-default.md). :class:`ProbeAdamW` is AdamW
(decoupled weight decay, bias corrections) whose matrices (parameters with two or more
dims, viewed as ``shape[0]`` rows) use one of these second moments; 1-D parameters
always keep AdamW's own:

- ``own``: AdamW's per-element ``v`` (the harness equals ``torch.optim.AdamW``);
- ``factored``: Adafactor's row and column EMAs of ``g^2``, ``v = r_i c_j / mean(c)``
  (Gefen's ``second_moment="factored"``);
- ``sm3``: SM3's cover, ``v = min(R_i, C_j)`` updated with ``g^2`` and re-maximized
  per row and column (an upper bound of the per-element EMA);
- ``geo``: the geometric mean of the two.

Options after the estimator, separated by colons: ``xK`` multiplies ``v`` by K,
``clipC`` clamps each element's step ``m_hat / (sqrt(v_hat) + eps)`` to ``[-C, C]``,
``rmsC`` scales a matrix's step down to an RMS of C (Adafactor's update clipping),
and ``qB`` stores the momentum of every parameter in B-bit codes (blocks of 256, one
fp32 absmax each, a codebook learned from the first gradient as Gefen's) rounded
``nearest`` (default) or ``stochastic`` (unbiased). The step uses the exact new
momentum; only the stored one is rounded, as in Gefen.

Run through ``benchmarks/gefen_seeds.py`` with a ``probe:`` prefix, e.g.
``python benchmarks/gefen_seeds.py --model mlp --seeds 0-15 --variants
probe:own,probe:factored,probe:factored:q4:stochastic:clip1``. Slow, obvious code:
for measuring ideas, not for training.
"""

from __future__ import annotations

import torch
from torch import Tensor

from leantrain.optim.codebook import histogram, learn_codebook, with_exact_zero

ESTIMATORS = ("own", "factored", "sm3", "geo")
QBLOCK = 256


def parse_probe(spec: str) -> dict:
    """Options of a probe spec ``ESTIMATOR[:xK][:clipC][:rmsC][:qB][:stochastic]``."""
    name, *extra = spec.split(":")
    if name not in ESTIMATORS:
        raise ValueError(
            f"unknown second moment {name!r} in {spec!r}; known: {ESTIMATORS}"
        )
    options = {"estimator": name, "scale": 1.0, "clip": None, "rms": None}
    options.update({"bits": None, "rounding": "nearest"})
    for item in extra:
        if item in ("nearest", "stochastic"):
            options["rounding"] = item
        else:
            key, number = _split_number(item, spec)
            options[key] = int(number) if key == "bits" else number
    if options["bits"] is not None and not 2 <= options["bits"] <= 8:
        raise ValueError(
            f"qB needs 2 <= B <= 8 bits, got {options['bits']} in {spec!r}"
        )
    return options


def _split_number(item: str, spec: str) -> tuple[str, float]:
    for prefix, key in (
        ("clip", "clip"),
        ("rms", "rms"),
        ("x", "scale"),
        ("q", "bits"),
    ):
        if item.startswith(prefix):
            try:
                value = float(item[len(prefix) :])
            except ValueError:
                break
            if value > 0:
                return key, value
    raise ValueError(
        f"unknown probe option {item!r} in {spec!r}; known: xK, clipC, rmsC "
        "(K, C > 0), qB, nearest, stochastic"
    )


def round_to_codes(x: Tensor, codebook: Tensor, rounding: str, gen) -> Tensor:
    """Indices into the ascending ``codebook`` of ``x`` in [-1, 1]: the nearer
    neighbour, or the upper one with probability ``(x - lower) / gap`` (unbiased)."""
    upper = torch.searchsorted(codebook, x.clamp(-1, 1)).clamp(1, codebook.numel() - 1)
    low, high = codebook[upper - 1], codebook[upper]
    if rounding == "nearest":
        take_upper = (x - low) > (high - x)
    else:
        gap = high - low
        share = torch.where(gap > 0, (x - low) / gap.clamp_min(1e-30), 0.0).clamp(0, 1)
        take_upper = torch.rand(x.shape, generator=gen) < share
    return torch.where(take_upper, upper, upper - 1)


class ProbeAdamW(torch.optim.Optimizer):
    """AdamW with a swappable second moment for matrices; see the module docstring."""

    def __init__(
        self, params, lr: float, spec: str = "own", weight_decay: float = 1e-2
    ):
        super().__init__(params, {"lr": lr, "betas": (0.9, 0.999), "eps": 1e-8})
        self.weight_decay = weight_decay
        self.options = parse_probe(spec)
        self.codebook = None
        self.generator = torch.Generator().manual_seed(0)

    @torch.no_grad()
    def step(self) -> None:
        params = [
            p for g in self.param_groups for p in g["params"] if p.grad is not None
        ]
        bits = self.options["bits"]
        if bits is not None and self.codebook is None:
            counts = sum(histogram(p.grad.reshape(-1).float(), QBLOCK) for p in params)
            # Gefen's codebook: learned from the first gradients, with an exact 0
            self.codebook = with_exact_zero(learn_codebook(counts, 2**bits)).float()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        if bits is not None:
            for p in params:
                self._store_codes(self.state[p])

    def _update(self, p: Tensor, group: dict) -> None:
        (b1, b2), lr, eps = group["betas"], group["lr"], group["eps"]
        g, state = p.grad, self.state[p]
        matrix = p.ndim >= 2 and p.shape[0] >= 2
        if not state:
            state["t"], state["m"] = 0, torch.zeros_like(p)
        state["t"] += 1
        t = state["t"]
        if "codes" in state:  # the stored momentum, as the codes hold it
            state["m"].copy_(self._dequantize(state).view_as(p))
        state["m"].lerp_(g, 1 - b1)
        v = self._second_moment(state, g, b2, matrix)
        step = (state["m"] / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
        if self.options["clip"] is not None:
            step.clamp_(-self.options["clip"], self.options["clip"])
        if self.options["rms"] is not None and matrix:
            rms = float(step.square().mean().sqrt())
            step.mul_(min(1.0, self.options["rms"] / max(rms, 1e-30)))
        p.mul_(1 - lr * self.weight_decay).add_(step, alpha=-lr)

    def _second_moment(self, state: dict, g: Tensor, b2: float, matrix: bool) -> Tensor:
        estimator = self.options["estimator"] if matrix else "own"
        if estimator == "own":
            state.setdefault("v", torch.zeros_like(g)).mul_(b2).addcmul_(
                g, g, value=1 - b2
            )
            return state["v"]
        g2 = g.reshape(g.shape[0], -1).square()
        v = None
        if estimator in ("factored", "geo"):
            r = state.setdefault("r", g2.new_zeros(g2.shape[0]))
            c = state.setdefault("c", g2.new_zeros(g2.shape[1]))
            r.mul_(b2).add_(g2.mean(1), alpha=1 - b2)
            c.mul_(b2).add_(g2.mean(0), alpha=1 - b2)
            mean_c = c.mean()
            v = r[:, None] * c[None, :] / mean_c if mean_c > 0 else torch.zeros_like(g2)
        if estimator in ("sm3", "geo"):
            rows = state.setdefault("rows", g2.new_zeros(g2.shape[0]))
            cols = state.setdefault("cols", g2.new_zeros(g2.shape[1]))
            cover = (
                torch.minimum(rows[:, None], cols[None, :])
                .mul_(b2)
                .add_(g2, alpha=1 - b2)
            )
            rows.copy_(cover.amax(1))
            cols.copy_(cover.amax(0))
            v = cover if v is None else (v * cover).sqrt()
        return (v * self.options["scale"]).view_as(g)

    def _dequantize(self, state: dict) -> Tensor:
        values = (
            self.codebook[state["codes"]].view(-1, QBLOCK) * state["absmax"][:, None]
        )
        return values.view(-1)[: state["m"].numel()]

    def _store_codes(self, state: dict) -> None:
        flat = state["m"].reshape(-1)
        padded = torch.cat([flat, flat.new_zeros((-flat.numel()) % QBLOCK)])
        blocks = padded.view(-1, QBLOCK)
        absmax = blocks.abs().amax(1)
        safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
        x = (blocks / safe[:, None]).reshape(-1)
        state["codes"] = round_to_codes(
            x, self.codebook, self.options["rounding"], self.generator
        )
        state["absmax"] = absmax
