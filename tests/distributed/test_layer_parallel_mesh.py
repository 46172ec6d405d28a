"""DP x LP on a 2 x 2 gloo mesh: equals one-process serial training on the union batch
once MGRIT is iterated to exactness; the Controller decides identically on all four
ranks (factors max-reduced over data replicas that see different data) and, after
switching to serial, the gradients are exactly the serial network's. A Controller on
a model parallelized over an ``lp`` sub-mesh decides over that sub-mesh only."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from leantrain.layer_parallel import LayerParallel
from leantrain.layer_parallel.controller import Controller
from leantrain.layer_parallel.mesh import ParallelDims, parallelize
from leantrain.models import GPT, GPTConfig, lm_loss
from leantrain.models.blocks import ResidualStack
from tests._helpers.launchers import run_distributed
from tests._helpers.lp_steps import tanh_steps

pytestmark = pytest.mark.distributed


def _gpt(n: int) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=11, block_size=8, n_layer=n, n_head=2, d_model=8)
    model = GPT(cfg).double()
    for m in model.stack.modules():  # blocks far from the identity
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.5 / 8**0.5)
    model.stack = ResidualStack(model.stack.steps, t_final=1.0)
    return model


def _max_grad_diff(model, ref, owned_names) -> float:
    refs = dict(ref.named_parameters())
    return max(
        (p.grad - refs[name].grad).abs().max().item()
        for name, p in model.named_parameters()
        if name in owned_names
    )


class _Net(nn.Module):
    def __init__(self, stack: nn.Module, d: int) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.inp, self.stack = nn.Linear(d, d).double(), stack
        self.out = nn.Linear(d, 1).double()

    def forward(self, x):
        return self.out(self.stack(self.inp(x)))


def _mesh_worker(rank: int, world: int) -> dict:
    mesh = ParallelDims(dp=2, lp=2).build_mesh()
    dp_rank, lp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("lp")
    out: dict = {"coords": (dp_rank, lp_rank)}

    # --- DP x LP == serial on the union batch (MGRIT iterated to exactness)
    n, cf = 8, 2
    ref = _gpt(n)
    model = copy.deepcopy(ref)
    model.stack = LayerParallel(
        model.stack.steps,
        cf=cf,
        fwd_iters=n // (2 * cf),
        bwd_iters=n // (2 * cf),
        skip_downcycle=False,
    )
    parallelize(model, mesh)
    torch.manual_seed(1)
    idx = torch.randint(0, 11, (4, 6))  # the union batch, identical on every rank
    mine = idx[2 * dp_rank : 2 * dp_rank + 2]  # this replica's half
    lm_loss(model(mine), mine).backward()
    lm_loss(ref(idx), idx).backward()
    owned = {f"stack.steps.{i}." for i in model.stack.owned_layers}
    names = [
        name
        for name, _ in model.named_parameters()
        if not name.startswith("stack.") or any(name.startswith(o) for o in owned)
    ]
    out["grad_diff"] = _max_grad_diff(model, ref, set(names))
    out["foreign_grads"] = sum(
        p.grad is not None
        for name, p in model.named_parameters()
        if name.startswith("stack.") and name not in names
    )
    out["owned"] = list(model.stack.owned_layers)

    # --- Controller on a stalled problem (h = 1), replicas see different data
    steps = tanh_steps(16, 6, scale=2.0)
    net = _Net(LayerParallel(steps, t_final=16.0, cf=2, on_divergence="ignore"), 6)
    serial = copy.deepcopy(net)
    serial.stack = ResidualStack(serial.stack.steps, t_final=16.0)
    parallelize(net, mesh)
    ctrl = Controller(net, every=2)
    opt = torch.optim.SGD(net.parameters(), lr=0.0)  # params fixed: grads comparable
    diffs = []
    for k in range(4):
        g = torch.Generator().manual_seed(50 + k)
        x = torch.randn(4, 6, generator=g, dtype=torch.float64)
        y = x.sum(1, keepdim=True).sin()
        mx, my = x[2 * dp_rank : 2 * dp_rank + 2], y[2 * dp_rank : 2 * dp_rank + 2]
        opt.zero_grad()
        (net(mx) - my).pow(2).mean().backward()
        ctrl.step()
        if ctrl.switched and k > 0:
            serial.zero_grad()
            (serial(x) - y).pow(2).mean().backward()
            local = {f"stack.steps.{i}." for i in net.stack.owned_layers}
            keep = {
                name
                for name, _ in net.named_parameters()
                if not name.startswith("stack.")
                or any(name.startswith(o) for o in local)
            }
            diffs.append(_max_grad_diff(net, serial, keep))
        opt.step()
    out["records"] = [(d.batch, d.action, d.factor) for d in ctrl.records]
    out["serial_diffs"] = diffs
    return out


def test_dp_x_lp_equals_serial_union_batch_and_controller_agrees():
    results = run_distributed(_mesh_worker, 4, timeout=240)
    assert [r["coords"] for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert results[0]["owned"] == [0, 1, 2, 3] and results[1]["owned"] == [4, 5, 6, 7]
    for r in results:
        assert r["grad_diff"] < 1e-12, r
        assert r["foreign_grads"] == 0
    records = [r["records"] for r in results]
    assert all(rec == records[0] for rec in records)  # identical decisions
    assert records[0][0][1] == "serial" and records[0][0][2] > 1.0
    for r in results:
        assert len(r["serial_diffs"]) == 3
        assert max(r["serial_diffs"]) < 1e-12


def _sub_mesh_worker(rank: int, world: int) -> dict:
    # Two independent layer-parallel models, each over its own 2-rank ``lp`` sub-mesh
    # of a 2 x 2 mesh: replica 0 trains a stalled problem (h = 1), replica 1 a
    # well-posed one (h = 1/N). Each Controller must decide over its own model's
    # ranks only: a reduction over all four ranks would switch replica 1 too.
    mesh = ParallelDims(dp=2, lp=2).build_mesh()
    replica = mesh.get_local_rank("dp")
    t_final = 16.0 if replica == 0 else 1.0
    steps = tanh_steps(16, 6, scale=2.0)
    net = _Net(LayerParallel(steps, t_final=t_final, cf=2, on_divergence="ignore"), 6)
    parallelize(net, mesh["lp"])
    ctrl = Controller(net, every=1)
    g = torch.Generator().manual_seed(50 + replica)
    x = torch.randn(2, 6, generator=g, dtype=torch.float64)
    net(x).pow(2).mean().backward()
    decision = ctrl.step()
    return {
        "replica": replica,
        "mesh_is_lp": ctrl.mesh is net.stack.mesh,
        "decision": (decision.action, decision.factor),
    }


def test_controller_decides_over_the_sub_mesh_its_model_runs_on():
    results = run_distributed(_sub_mesh_worker, 4, timeout=240)
    assert [r["replica"] for r in results] == [0, 0, 1, 1]
    assert all(r["mesh_is_lp"] for r in results)
    stalled, converging = results[0]["decision"], results[2]["decision"]
    assert results[1]["decision"] == stalled  # the two ranks of a model agree
    assert results[3]["decision"] == converging
    assert stalled[0] == "serial" and stalled[1] > 1.0
    assert converging[0] == "keep" and converging[1] <= 1.0
