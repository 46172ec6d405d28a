"""The peer registry, its state/memory accounting, and how failures are reported."""

import importlib.util
import math
import os
import statistics
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from leantrain.compare.measure import measured_step, state_nbytes
from leantrain.compare.optimizers import OPTIMIZERS, PEERS, OptimizerEntry
from leantrain.compare.peers import peers_table, train_peer
from leantrain.compare.precond import steps_to_reach
from leantrain.compare.report import moving_average
from leantrain.compare.tasks import Task
from leantrain.optim import Gefen, optimizer_state_nbytes

ROOT = Path(__file__).resolve().parents[1]


def _tiny_task(seed: int = 0) -> Task:
    """A 16-32-4 MLP on a fixed random classification set."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 16, generator=gen)
    y = torch.randint(0, 4, (64,), generator=gen)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))

    def batches():
        g = torch.Generator().manual_seed(seed + 1)
        while True:
            idx = torch.randint(0, 64, (8,), generator=g)
            yield x[idx], y[idx]

    return Task("tiny", model, batches, [(x, y)], nn.functional.cross_entropy)


def _stepped(opt_factory, model: nn.Module) -> torch.optim.Optimizer:
    opt = opt_factory(model)
    model(torch.randn(4, model[0].in_features)).square().sum().backward()
    opt.step()
    return opt


def test_state_nbytes_of_adamw_is_two_moments_and_a_step():
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
    opt = _stepped(lambda m: torch.optim.AdamW(m.parameters()), model)
    n = sum(p.numel() for p in model.parameters())
    assert state_nbytes(opt) == 8 * n + 4 * 4  # exp_avg, exp_avg_sq fp32; 0-dim step


def test_state_nbytes_agrees_with_gefen_accounting_shared_codebook_once():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    opt = _stepped(lambda m: Gefen(m.parameters(), momentum_bits=8), model)
    codebooks = {id(s["codebook"]) for s in opt.state.values() if "codebook" in s}
    assert len(codebooks) == 1 and len(opt.state) == 4  # one codebook, shared
    assert state_nbytes(opt) == optimizer_state_nbytes(opt)


def test_state_nbytes_counts_top_level_tensors_of_bitsandbytes():
    bnb = pytest.importorskip("bitsandbytes")
    model = nn.Sequential(nn.Linear(128, 128, bias=False))  # 16384 >= 4096: 8-bit
    opt = _stepped(lambda m: bnb.optim.AdamW8bit(m.parameters()), model)
    seen, expected = set(), 0
    for value in [*opt.state[model[0].weight].values(), *opt.name2qmap.values()]:
        if isinstance(value, torch.Tensor):
            key = value.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                expected += value.untyped_storage().nbytes()
    assert state_nbytes(opt) == expected
    assert 2.0 <= state_nbytes(opt) / 128**2 < 2.3  # two 8-bit moments + absmax


class _Allocating(torch.optim.Optimizer):
    """A step that touches a temporary of ``nbytes`` (known memory to find)."""

    def __init__(self, params, nbytes: int):
        super().__init__(params, {})
        self.nbytes = nbytes

    def step(self, closure=None):
        temp = torch.empty(self.nbytes, dtype=torch.uint8)
        temp.fill_(1)  # touch every page, so it becomes resident
        return float(temp.sum()) if self.nbytes else None


@pytest.mark.skipif(
    not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux /proc"
)
def test_measured_step_sees_the_temporaries_of_a_step():
    params = [nn.Parameter(torch.zeros(4))]
    big = measured_step(_Allocating(params, 64 * 2**20))
    small = measured_step(_Allocating(params, 0))
    assert big.peak_bytes is not None and small.peak_bytes is not None
    assert big.peak_bytes >= 60 * 2**20  # 64 MiB touched, a little allocator slack
    assert small.peak_bytes < 8 * 2**20
    assert big.seconds > 0


def test_train_peer_matches_a_plain_adamw_loop():
    task = _tiny_task()
    result = train_peer(task, "adamw-foreach", 5, 1e-2, lambda: None)
    assert result.status == "ok"
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    model.load_state_dict(task.model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=1e-2)
    losses = []
    for _, (x, y) in zip(range(5), task.batches(), strict=False):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert result.train_losses == pytest.approx(losses, rel=1e-6)
    x, y = task.val_batches[0]
    with torch.no_grad():
        assert result.val_loss == pytest.approx(
            float(nn.functional.cross_entropy(model(x), y)), rel=1e-5
        )
    n = sum(p.numel() for p in model.parameters())
    assert result.state_bytes_per_param == pytest.approx((8 * n + 16) / n)


def _not_installed(model, lr, weight_decay):
    import leantrain_no_such_peer  # noqa: F401

    raise AssertionError("unreachable")


def test_missing_and_diverging_peers_are_rows_saying_failed(monkeypatch):
    monkeypatch.setitem(
        OPTIMIZERS, "ghost", OptimizerEntry(_not_installed, "ghost", "not installed")
    )
    monkeypatch.setitem(
        OPTIMIZERS,
        "inf-lr",
        OptimizerEntry(
            lambda m, lr, wd: torch.optim.SGD(m.parameters(), lr=math.inf), "inf", "x"
        ),
    )
    task = _tiny_task()
    results = [
        train_peer(task, name, 3, 1e-2, lambda: None)
        for name in ("adamw-foreach", "ghost", "inf-lr")
    ]
    assert results[0].status == "ok"
    assert results[1].status.startswith("failed: ModuleNotFoundError")
    assert "leantrain_no_such_peer" in results[1].status
    assert results[2].status.startswith("failed: FloatingPointError")
    table = peers_table(results).splitlines()
    assert len(table) == 2 + 3  # header, rule, every peer: none hidden
    assert table[3].startswith("| ghost | failed: ModuleNotFoundError")
    assert table[4].startswith("| inf-lr | failed: FloatingPointError")


def test_every_registered_peer_has_a_factory_and_a_note():
    assert {"adamw-foreach", "adamw-fused", "gefen8", "gefen4"} <= set(PEERS)
    assert set(PEERS) <= set(OPTIMIZERS)
    for name, entry in OPTIMIZERS.items():
        assert callable(entry.factory) and entry.note and entry.label, name


@pytest.mark.parametrize("window", [1, 2, 3, 7])
def test_moving_average_and_steps_to_reach_against_direct_loops(window):
    gen = torch.Generator().manual_seed(window)
    losses = (torch.rand(25, generator=gen) * 3).tolist()
    avg = moving_average(losses, window)
    for i in range(len(losses)):
        lo = max(0, i - window + 1)
        assert avg[i] == pytest.approx(statistics.fmean(losses[lo : i + 1]))
    for target in (0.5, 1.0, 1.5, 10.0, -1.0):
        direct = None
        for step in range(window, len(losses) + 1):
            if statistics.fmean(losses[step - window : step]) <= target:
                direct = step
                break
        assert steps_to_reach(losses, target, window) == direct


def test_benchmark_imports_the_registry_from_the_package(monkeypatch):
    assert not (ROOT / "benchmarks" / "_peers.py").exists()
    path = ROOT / "benchmarks" / "optimizers.py"
    spec = importlib.util.spec_from_file_location("bench_optimizers", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look it up
    spec.loader.exec_module(module)
    # The package's list and loop (which reads OPTIMIZERS and state_nbytes): no copy.
    assert module.PEERS is PEERS and module.train_peer is train_peer
