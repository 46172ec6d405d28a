r"""K-BFGS: Kronecker-factored BFGS (Goldfarb, Ren & Bahamou, 2020).

Each Linear / Conv2d layer ``h = W a + b`` is preconditioned by ``H_B ⊗ A^{-1}``:
``G ← H_B G (A + \sqrt{λ} I)^{-1}`` on the canonical gradient ``G = [dW, db]``.

* ``A = sum ã ã^T / N`` from the layer inputs (bias-augmented, bias-corrected EMA),
  inverted with a Cholesky factorization on preconditioner steps, as in K-FAC.
* ``H_B`` approximates the inverse of the Hessian block of the pre-activations.
  It is updated by damped BFGS from the secant pair of the layer's mean
  pre-activation and mean pre-activation gradient at two parameter points on the
  *same* minibatch: on a curvature step at parameters ``θ`` with batch ``X``,
  ``s = h̄(θ; X) - h̄(θ'; X)`` and ``y = ḡ(θ; X) - ḡ(θ'; X)``, where ``θ'`` are the
  parameters of the previous curvature step (kept by the maker, saved in
  ``state_dict``). ``h̄`` averages the pre-activations over examples (and positions),
  ``ḡ`` is the gradient of the loss w.r.t. them summed over examples (averaged over
  positions), i.e. the mean per-example gradient for a mean-reduced loss.
* Damping: Powell's damping with ``mu1`` on ``H`` (guarantees
  ``s^T y ≥ mu1 · y^T H y > 0``) followed by Levenberg-Marquardt damping
  ``y ← y + \sqrt{λ} s`` (ASDL's ``powell_lm_damping_``, Goldfarb et al. Alg. 2),
  then the BFGS inverse update

  .. math::
      H^+ = (I - ρ s y^\top) H (I - ρ y s^\top) + ρ s s^\top,\quad ρ = 1/(s^\top y).

The second point costs one extra forward and backward on curvature steps (the
previous parameters are swapped in, then restored). That pass also runs BatchNorm
in training mode and draws new dropout masks; use eval mode or ignore such modules
when exactness matters. The first curvature step only records ``θ'``: ``H_B``
starts at the identity.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from leantrain import evaluation
from leantrain.precond._checks import check_extra_state
from leantrain.precond._coverage import check_one_site
from leantrain.precond._denormal import autocast_off
from leantrain.precond._fisher import add_grads
from leantrain.precond._kron import read_canonical, write_canonical
from leantrain.precond.curv import damped_inverse
from leantrain.precond.curv._recompute import records_evaluation
from leantrain.precond.curv.modules import is_conv1d, make_op
from leantrain.precond.gradient_maker import unwrap_model
from leantrain.precond.preconditioned import (
    PreconditionedGradientMaker,
    PreconditioningConfig,
)

__all__ = ["KbfgsGradientMaker", "bfgs_inverse_update", "powell_lm_damping"]


def powell_lm_damping(
    h: Tensor, s: Tensor, y: Tensor, mu1: float, mu2: float
) -> tuple[Tensor, Tensor]:
    r"""Powell's damping on ``H`` then Levenberg-Marquardt damping (new tensors).

    If ``s^T y < mu1 · y^T H y``, ``s ← θ s + (1 - θ) H y`` with
    ``θ = (1 - mu1) y^T H y / (y^T H y - s^T y)``, which makes
    ``s^T y = mu1 · y^T H y``; then ``y ← y + mu2 · s``.
    """
    hy = h @ y
    yhy, sy = y @ hy, s @ y
    if sy < mu1 * yhy:
        theta = (1 - mu1) * yhy / (yhy - sy)
        s = theta * s + (1 - theta) * hy
    return s, y + mu2 * s


def bfgs_inverse_update(h: Tensor, s: Tensor, y: Tensor) -> Tensor:
    r"""BFGS update of an inverse Hessian approximation ``H`` (new tensor).

    ``H^+ = (I - ρ s y^T) H (I - ρ y s^T) + ρ s s^T`` with ``ρ = 1 / s^T y``,
    written as two rank-one corrections; ``H^+ y = s`` (the secant condition).
    """
    sy = s @ y
    hy = h @ y
    yhy = y @ hy
    hys = torch.outer(hy, s)
    return h + torch.outer(s, s) * ((sy + yhy) / sy**2) - (hys + hys.T) / sy


class KbfgsGradientMaker(PreconditionedGradientMaker):
    r"""K-BFGS for Linear and Conv2d layers (see the module docstring).

    Args:
        model: the module to train (plain or ``DistributedDataParallel``).
        config: schedule, damping λ (``sqrt(λ)`` on ``A`` and in the LM damping),
            EMA decay of ``A``, ignored modules.
        mu1: Powell damping threshold in (0, 1).

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from leantrain.precond import PreconditioningConfig
        >>> from leantrain.precond.methods.kbfgs import KbfgsGradientMaker
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
        ...                             torch.nn.Linear(8, 3))
        >>> gm = KbfgsGradientMaker(model, PreconditioningConfig(damping=1e-2))
        >>> x, t = torch.randn(16, 4), torch.randint(0, 3, (16,))
        >>> for _ in range(2):
        ...     y = gm.setup_model_call(model, x)
        ...     gm.setup_loss_call(F.cross_entropy, y, t)
        ...     _ = gm.forward_and_backward()
        ...     with torch.no_grad():
        ...         for p in model.parameters():
        ...             p -= 0.1 * p.grad
        ...     model.zero_grad()
        >>> gm.h_inverse["0"].shape, gm.bfgs_updates
        (torch.Size([8, 8]), 1)
    """

    skips_frozen = False  # its state is fitted to the parameters it was built with

    def __init__(
        self,
        model: nn.Module,
        config: PreconditioningConfig | None = None,
        *,
        mu1: float = 0.2,
    ) -> None:
        if isinstance(mu1, bool) or not isinstance(mu1, (int, float)):
            raise TypeError(f"mu1 must be a float in (0, 1), got {mu1!r}")
        if not 0.0 < mu1 < 1.0:
            raise ValueError(f"mu1 must be in (0, 1), got {mu1}")
        self.mu1 = float(mu1)
        self.a_factor: dict[str, Tensor] = {}
        self.a_inverse: dict[str, Tensor] = {}
        self.h_inverse: dict[str, Tensor] = {}
        self.previous_params: dict[str, Tensor] = {}
        self.bfgs_updates = 0
        self._records: dict[str, dict[str, Tensor]] = {}
        self._before_params: dict[str, Tensor] = {}
        super().__init__(model, config)
        self.ops = {name: make_op(name, m) for name, m in self.modules()}
        self._warn_tied()

    def _warn_tied(self) -> None:
        """K-BFGS has no rule for a weight used by several modules: say so."""
        check_one_site(
            "KbfgsGradientMaker",
            unwrap_model(self.model),
            set(self.ops),
            warn="K-BFGS has no rule for several sites and preconditions its summed "
            "gradient with the curvature of {site} alone (K-FAC and EKFAC combine "
            "the sites)",
        )

    def is_supported(self, module: nn.Module) -> bool:
        """Linear (and subclasses), Conv2d and Hugging Face ``Conv1D`` layers with
        trainable parameters."""
        layer = isinstance(module, (nn.Linear, nn.Conv2d)) or is_conv1d(module)
        return layer and any(p.requires_grad for p in module.parameters(recurse=False))

    # -- capture ----------------------------------------------------------------
    @contextlib.contextmanager
    def _capture(self, records: dict[str, dict[str, Tensor]]) -> Iterator[None]:
        """Record per layer ``A``, the mean input and the summed output-gradient."""
        handles = [
            op.module.register_forward_hook(partial(self._on_forward, name, records))
            for name, op in self.ops.items()
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    @autocast_off()
    def _on_forward(self, name, records, module, args, output) -> None:
        if not records_evaluation(name):
            return  # a layer-parallel solver's sweeps, checkpointing's re-run
        op = self.ops[name]
        feats, tensors = op.record(args, output)
        a = feats["a"][0]  # (N, T, J)
        n, t = a.shape[0], a.shape[1]
        if len(op.params) == 2:
            a = torch.cat([a, a.new_ones(n, t, 1)], dim=-1)
        flat = a.reshape(-1, a.shape[-1])
        rec = {"A": flat.T @ flat / n, "a_mean": flat.mean(0)}
        records[name] = rec

        @autocast_off()
        def on_grad(grad: Tensor) -> None:
            if evaluation.is_auxiliary():
                return
            e = op.grad_feature(0, grad)  # (N, T, R)
            rec["g_sum"] = e.sum((0, 1)) / e.shape[1]

        tensors[0].register_hook(on_grad)

    def _pass(self, fn: Any, params: list[Tensor]) -> tuple[Any, Tensor, dict, list]:
        records: dict[str, dict[str, Tensor]] = {}
        with torch.enable_grad(), self._capture(records):
            output = self._call_model(fn)
            loss = self._loss_from_output(output)
            grads = torch.autograd.grad(loss, params, allow_unused=True)
        tensors = [t for name in sorted(records) for t in records[name].values()]
        self._all_reduce_mean(tensors)  # union-batch means under DDP
        return output, loss.detach(), records, list(grads)

    def _curvature_pass(self) -> tuple[Any, Tensor]:
        inner = unwrap_model(self.model)
        fn = self.model_call[0]
        if isinstance(fn, nn.Module) and unwrap_model(fn) is inner:
            fn = inner  # bypass DDP: we average gradients and statistics ourselves
        named = [(n, p) for n, p in inner.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        output, loss, records, grads = self._pass(fn, params)
        add_grads(self._all_reduce_mean, params, grads)
        current = {n: p.detach().clone() for n, p in named}
        previous = None
        if self.previous_params:
            with torch.no_grad():
                for n, p in named:
                    p.copy_(self.previous_params[n])
            try:
                _, _, previous, _ = self._pass(fn, params)
            finally:
                with torch.no_grad():
                    for n, p in named:
                        p.copy_(current[n])
        self._records = {"now": records, "before": previous or {}}
        self._before_params = self.previous_params
        self.previous_params = current
        return output, loss

    # -- updates ------------------------------------------------------------------
    def update_curvature(self) -> None:
        """EMA of ``A``; damped BFGS update of ``H_B`` from this step's secant pair."""
        now, before = self._records.get("now", {}), self._records.get("before", {})
        root = self.config.damping**0.5
        updated = False
        for name, rec in now.items():
            self.a_factor[name] = self._ema_update(f"{name}/A", rec["A"])
            old = before.get(name)
            if old is None or "g_sum" not in rec or "g_sum" not in old:
                continue
            mean, mean_before = rec["a_mean"], old["a_mean"]
            # In the statistics' (float32 or wider) dtype: a bf16 layer's weights too.
            w = _read_weight(self.ops[name]).to(mean.dtype)
            s = w @ mean - self._weight_before(name).to(mean.dtype) @ mean_before
            y = rec["g_sum"] - old["g_sum"]
            h = self.h_inverse.get(name)
            if h is None:
                h = torch.eye(s.shape[0], dtype=s.dtype, device=s.device)
            s, y = powell_lm_damping(h, s, y, self.mu1, root)
            if not bool(s @ y > 0):
                # s = 0: the layer's pre-activations did not move since the last
                # curvature step (weights unchanged, e.g. a step GradScaler skipped
                # or lr 0), so the pair holds no curvature; BFGS would divide by 0.
                continue
            self.h_inverse[name] = bfgs_inverse_update(h, s, y)
            updated = True
        self.bfgs_updates += int(updated)
        self._records, self._before_params = {}, {}

    def _weight_before(self, name: str) -> Tensor:
        """``[W, b]`` of layer ``name`` at the previous curvature step's parameters."""
        op = self.ops[name]
        inner = unwrap_model(self.model)
        names = {id(p): n for n, p in inner.named_parameters()}
        before = self._before_params
        return op.to_canonical([before[names[id(p)]] for p in op.params])

    def update_preconditioner(self) -> None:
        """``(A + sqrt(λ) I)^{-1}`` per layer (``H_B`` is already an inverse)."""
        root = self.config.damping**0.5
        self.a_inverse = {n: damped_inverse(a, root) for n, a in self.a_factor.items()}

    @torch.no_grad()
    def precondition(self) -> None:
        """``.grad`` ← ``H_B G A^{-1}`` per layer (``H_B = I`` until first updated)."""
        for name, a_inv in self.a_inverse.items():
            op = self.ops[name]
            g = read_canonical(op)
            if g is None:
                continue
            out = g @ a_inv.to(g.dtype)
            h = self.h_inverse.get(name)
            if h is not None:
                out = h.to(g.dtype) @ out
            write_canonical(op, out)

    # -- state ------------------------------------------------------------------
    def _extra_state(self) -> dict[str, Any]:
        return {
            "a_factor": dict(self.a_factor),
            "a_inverse": dict(self.a_inverse),
            "h_inverse": dict(self.h_inverse),
            "previous_params": dict(self.previous_params),
            "bfgs_updates": torch.tensor(self.bfgs_updates),
        }

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        maps = ("a_factor", "a_inverse", "h_inverse", "previous_params")
        check_extra_state(state, (*maps, "bfgs_updates"), tensor_maps=maps)
        self.a_factor = {k: v.clone() for k, v in state["a_factor"].items()}
        self.a_inverse = {k: v.clone() for k, v in state["a_inverse"].items()}
        self.h_inverse = {k: v.clone() for k, v in state["h_inverse"].items()}
        self.previous_params = {
            k: v.clone() for k, v in state["previous_params"].items()
        }
        self.bfgs_updates = int(state["bfgs_updates"])


def _read_weight(op: Any) -> Tensor:
    """``[W, b]`` of a layer's op as a ``(R, U)`` matrix (current values)."""
    return op.to_canonical([p.detach() for p in op.params])
