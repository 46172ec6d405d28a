"""LayerParallel over gloo ranks equals the one-process solver with the same options.

For 2, 3 and 4 processes, one spawned group per world size runs every check: forward
output, input gradient and every parameter gradient against ``LayerParallel`` with
``chunks = P`` in one process (inexact iteration counts, so the comparison sees the
exact same MGRIT iterates, to 1e-12 in float64), the residual histories, warm starts,
dropout, a tuple state, the distributed serial mode against plain autograd, and a rank
failing mid-step.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from leantrain.layer_parallel import LayerParallel
from leantrain.layer_parallel.comm import LayerParallelCommError
from leantrain.models.blocks import TransformerBlock
from tests._helpers.launchers import parallelize_over_all_ranks, run_distributed
from tests._helpers.lp_steps import PairStep

pytestmark = pytest.mark.distributed

D = 8


def _blocks(n: int, dropout: float = 0.0) -> nn.ModuleList:
    torch.manual_seed(0)
    blocks = nn.ModuleList(
        TransformerBlock(D, 2, causal=True, dropout=dropout) for _ in range(n)
    ).double()
    for m in blocks.modules():  # far from the identity: wrong iterates show up
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.5 / D**0.5)
    return blocks


def _run(stack: LayerParallel, x, w, seed: int = 3):
    """Output, input grad and per-layer param grads of ``sum(stack(x) * w)``."""
    xs = tuple(t.clone().requires_grad_() for t in x)
    torch.manual_seed(seed)  # the batch seed drawn by LayerRNG (dropout)
    y = stack(xs if len(xs) > 1 else xs[0])
    ys = y if isinstance(y, tuple) else (y,)
    sum((a * b).sum() for a, b in zip(ys, w, strict=True)).backward()
    grads = {
        n: [None if p.grad is None else p.grad.clone() for p in s.parameters()]
        for n, s in enumerate(stack.steps)
    }
    return [t.detach() for t in ys], [t.grad for t in xs], grads


def _diff(a, b) -> float:
    return max((s - t).abs().max().item() for s, t in zip(a, b, strict=True))


def _compare(rank, world, ref, par, x, w, calls=1) -> dict[str, float]:
    """Max deviations of ``par`` (distributed) from ``ref`` (one process)."""
    out: dict[str, float] = {}
    for call in range(calls):
        ry, rx, rg = _run(ref, x, w, seed=3 + call)
        py, px, pg = _run(par, x, w, seed=3 + call)
        out[f"out{call}"] = _diff(ry, py)
        out[f"in_grad{call}"] = _diff(rx, px)
        owned = par.owned_layers
        out[f"params{call}"] = max(_diff(rg[n], pg[n]) for n in owned)
        # layers of other ranks get no gradient here
        out[f"foreign{call}"] = float(
            any(g is not None for n in pg if n not in owned for g in pg[n])
        )
        for s in ref.steps:
            s.zero_grad()
        for s in par.steps:
            s.zero_grad()
    rs, ps = ref.stats, par.stats
    if rs.mode == "parallel":
        for which in ("forward", "backward"):
            a, b = getattr(rs, which).history, getattr(ps, which).history
            # relative, but a residual that is exactly 0 (an exact solve, seen on
            # some CPUs) compares absolutely
            out[f"{which}_history"] = max(
                abs(u - v) / u if u else abs(v) for u, v in zip(a, b, strict=False)
            )
            out[f"{which}_len"] = float(len(a) != len(b))
    return out


def _parity_worker(rank: int, world: int) -> dict[str, dict[str, float]]:
    results = {}
    n = 4 * world
    torch.manual_seed(2)  # the same batch on every rank, as in training
    x = (torch.randn(1, 3, D, dtype=torch.float64),)
    w = (torch.randn(1, 3, D, dtype=torch.float64),)
    cases = {
        "L2_cf2": dict(levels=2, cf=2, fwd_iters=2, bwd_iters=1),
        "L3_cf2_fcf_noskip": dict(
            levels=3, cf=2, fwd_iters=2, bwd_iters=2, skip_downcycle=False
        ),
        "L2_cf4_F_only": dict(levels=2, cf=4, fwd_iters=3, bwd_iters=2, relax=0),
    }
    for name, kw in cases.items():
        blocks = _blocks(n)
        ref = LayerParallel(copy.deepcopy(blocks), chunks=world, **kw)
        par = parallelize_over_all_ranks(LayerParallel(blocks, **kw), timeout=60)
        results[name] = _compare(rank, world, ref, par, x, w)

    # warm start over two calls, and dropout (same masks from the same batch seed)
    blocks = _blocks(n, dropout=0.2)
    kw = dict(levels=2, cf=2, fwd_iters=2, bwd_iters=1, warm_start=True)
    ref = LayerParallel(copy.deepcopy(blocks), chunks=world, **kw).train()
    par = parallelize_over_all_ranks(LayerParallel(blocks, **kw)).train()
    results["warm_dropout"] = _compare(rank, world, ref, par, x, w, calls=2)

    # tuple state (x, y)
    torch.manual_seed(1)
    pair = nn.ModuleList(PairStep(D) for _ in range(n)).double()
    kw = dict(levels=2, cf=4, fwd_iters=2, bwd_iters=2)
    ref = LayerParallel(copy.deepcopy(pair), chunks=world, **kw)
    par = parallelize_over_all_ranks(LayerParallel(pair, **kw))
    x2 = (
        torch.randn(3, D, dtype=torch.float64),
        torch.randn(3, D, dtype=torch.float64),
    )
    w2 = (
        torch.randn(3, D, dtype=torch.float64),
        torch.randn(3, D, dtype=torch.float64),
    )
    results["tuple_state"] = _compare(rank, world, ref, par, x2, w2)

    # distributed serial mode (rank-to-rank relay) == plain autograd, exactly
    blocks = _blocks(n)
    ref = LayerParallel(copy.deepcopy(blocks), chunks=world).serial()
    par = parallelize_over_all_ranks(LayerParallel(blocks)).serial()
    results["serial"] = _compare(rank, world, ref, par, x, w)

    # after one optimizer step on own layers, synchronize_layers gives every rank
    # the owners' weights (a full checkpoint on any rank)
    with torch.no_grad():
        for n in par.owned_layers:
            for p in par.steps[n].parameters():
                p.add_(float(n + 1))
    expect = [
        p.detach().clone() + float(n + 1)
        for n, s in enumerate(blocks)
        for p in ref.steps[n].parameters()
    ]
    par.synchronize_layers()
    got = [p.detach() for p in par.parameters()]
    results["synchronized"] = {"params": _diff(expect, got)}
    return results


@pytest.mark.parametrize(
    "world",
    [2, 3, pytest.param(4, marks=pytest.mark.slow)],  # 4: also in the mesh test
)
def test_distributed_equals_one_process(world):
    per_rank = run_distributed(_parity_worker, world, timeout=240)
    for rank, results in enumerate(per_rank):
        for case, values in results.items():
            for key, value in values.items():
                limit = (
                    0.5
                    if key.startswith(("foreign", "forward_len", "backward_len"))
                    else 1e-12
                )
                assert value < limit, (rank, case, key, value)


class _Boom(nn.Module):
    """A step that fails on one rank (its layer index belongs to that rank)."""

    def __init__(self, fail: bool) -> None:
        super().__init__()
        self.fail = fail
        self.lin = nn.Linear(D, D)

    def forward(self, u, dt):
        if self.fail:
            raise ValueError("boom inside a layer")
        return u + dt * torch.tanh(self.lin(u))


def _failing_worker(rank: int, world: int) -> None:
    steps = [_Boom(fail=(n == 12)) for n in range(16)]  # layer 12 is on rank 1
    stack = parallelize_over_all_ranks(LayerParallel(steps, cf=2), timeout=8)
    x = torch.randn(2, D, requires_grad=True)
    try:
        stack(x).sum().backward()
    except LayerParallelCommError as err:
        raise LayerParallelCommError(f"clear error on rank {rank}: {err}") from None


def test_failing_rank_ends_every_rank_with_an_error():
    with pytest.raises(RuntimeError) as info:
        run_distributed(_failing_worker, 2, timeout=30)
    msg = str(info.value)
    assert "boom inside a layer" in msg  # the failing rank's own error
    assert "clear error on rank 0" in msg and "did a neighbouring rank fail" in msg
    assert "did not finish" not in msg  # nobody hung
