"""The three axes in one run: {AdamW, Gefen 8-bit, Gefen 4-bit} x {plain, K-FAC,
Shampoo} x {serial, LayerParallel in one process, LayerParallel on 2 gloo processes}.

A tiny float64 GPT (4 layers, width 8) trains a few steps on one batch in every cell.
With MGRIT iterated to exactness a layer-parallel cell must equal the serial cell of
the same optimizer and maker; every cell must train (the loss falls). One cell per
optimizer is checkpointed mid-run (model, maker, optimizer, Controller, RNG) and
resumed into fresh objects: the resumed run equals the uninterrupted one bit for bit.
The 2-process cells run in one spawned group (one cell by default, all nine under
``-m slow``); there, AdamW equals the serial run and Gefen is close (its codebook is
learned from the gradients a rank holds).
"""

from __future__ import annotations

import io
import itertools

import pytest
import torch

from leantrain.layer_parallel import Controller, LayerParallel
from leantrain.models import GPT
from leantrain.models.gpt import GPTConfig, lm_loss
from leantrain.optim import Gefen
from leantrain.precond import GradientMaker
from leantrain.precond.registry import make_gradient_maker
from tests._helpers.launchers import parallelize_over_all_ranks, run_distributed

VOCAB, T, BATCH, STEPS = 16, 6, 3, 3
EXACT = {"levels": 2, "cf": 2, "fwd_iters": 2, "bwd_iters": 2}
OPTIMIZERS = ("adamw", "gefen8", "gefen4")
MAKERS = ("plain", "kfac", "shampoo")


def build(mode: str, world: int = 1):
    """(model, maker, optimizer, controller) factories for one mode."""
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=VOCAB,
        block_size=T,
        n_layer=4,
        n_head=2,
        d_model=8,
        mlp_ratio=2,
        t_final=1.0,
    )
    model = GPT(config).double()
    if mode != "serial":
        model.stack = LayerParallel(model.stack, t_final=1.0, **EXACT)
        if world > 1:
            parallelize_over_all_ranks(model)
    return model


def make_optimizer(name: str, model):
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=3e-3)
    return Gefen(model.parameters(), lr=3e-3, momentum_bits=int(name[-1]))


def make_maker(name: str, model):
    if name == "plain":
        return GradientMaker(model)
    config = {"damping": 1e-2, "ignore_modules": ["wpe"]}
    return make_gradient_maker(name, model, config=config)


def data():
    g = torch.Generator().manual_seed(1)
    return (
        torch.randint(0, VOCAB, (BATCH, T), generator=g),
        torch.randint(0, VOCAB, (BATCH, T), generator=g),
    )


class Run:
    """One cell: model, maker, optimizer and (layer-parallel) a Controller."""

    def __init__(self, opt: str, maker: str, mode: str, world: int = 1) -> None:
        self.model = build(mode, world)
        self.maker = make_maker(maker, self.model)
        self.opt = make_optimizer(opt, self.model)
        lp = mode != "serial"
        self.ctrl = Controller(self.model, every=2) if lp else None
        self.losses: list[float] = []

    def step(self) -> None:
        x, y = data()
        self.opt.zero_grad()
        out = self.maker.setup_model_call(self.model, x)
        self.maker.setup_loss_call(lm_loss, out, y)
        _, loss = self.maker.forward_and_backward()
        self.opt.step()
        if self.ctrl is not None:
            self.ctrl.step()
        self.losses.append(float(loss.detach()))

    def state(self) -> bytes:
        buf = io.BytesIO()
        torch.save(
            {
                "model": self.model.state_dict(),
                "maker": self.maker.state_dict()
                if hasattr(self.maker, "state_dict")
                else None,
                "opt": self.opt.state_dict(),
                "ctrl": None if self.ctrl is None else self.ctrl.state_dict(),
                "rng": torch.get_rng_state(),  # LayerRNG draws each batch's seed
            },
            buf,
        )
        return buf.getvalue()

    def load(self, blob: bytes) -> None:
        state = torch.load(io.BytesIO(blob), weights_only=False)
        self.model.load_state_dict(state["model"])
        if state["maker"] is not None:
            self.maker.load_state_dict(state["maker"])
        self.opt.load_state_dict(state["opt"])
        if self.ctrl is not None and state["ctrl"] is not None:
            self.ctrl.load_state_dict(state["ctrl"])
        torch.set_rng_state(state["rng"])

    def params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}


def run_cell(opt: str, maker: str, mode: str, world: int = 1):
    torch.manual_seed(5)
    run = Run(opt, maker, mode, world)
    for _ in range(STEPS):
        run.step()
    return run.losses, run.params()


def assert_close_params(want, got, names=None, tol=1e-6):
    names = list(want) if names is None else names
    a = torch.cat([want[n].reshape(-1) for n in names])
    b = torch.cat([got[n].reshape(-1) for n in names])
    err = float((a - b).norm() / a.norm())
    assert err < tol, f"relative difference {err:.3g}"


@pytest.fixture(scope="module")
def serial_cells():
    return {
        (o, m): run_cell(o, m, "serial")
        for o, m in itertools.product(OPTIMIZERS, MAKERS)
    }


@pytest.mark.parametrize(("opt", "maker"), list(itertools.product(OPTIMIZERS, MAKERS)))
def test_serial_and_one_process_cells(serial_cells, opt, maker):
    s_losses, s_params = serial_cells[(opt, maker)]
    assert s_losses[-1] < s_losses[0]
    losses, params = run_cell(opt, maker, "lp")
    assert losses[-1] < losses[0]
    assert_close_params(s_params, params)
    if maker != "plain":  # the preconditioned step is another step than the plain one
        plain = serial_cells[(opt, "plain")][1]
        a = torch.cat([p.reshape(-1) for p in plain.values()])
        b = torch.cat([p.reshape(-1) for p in params.values()])
        assert float((a - b).norm() / a.norm()) > 1e-6


def _two_process_cells(rank: int, world: int, cells):
    return {cell: run_cell(*cell, "lp", world) for cell in cells}


# The default suite spawns one group for one cell; -m slow runs all nine in one.
TWO_PROCESS = {
    "default": [("adamw", "kfac")],
    "all": list(itertools.product(OPTIMIZERS, MAKERS)),
}


@pytest.mark.distributed
@pytest.mark.parametrize(
    "which", ["default", pytest.param("all", marks=pytest.mark.slow)]
)
def test_two_process_cells(serial_cells, which):
    cells = TWO_PROCESS[which]
    results = run_distributed(_two_process_cells, 2, cells, timeout=240)
    layers_per_rank = 2
    for opt, maker in cells:
        s_losses, s_params = serial_cells[(opt, maker)]
        for rank, ran in enumerate(results):
            losses, params = ran[(opt, maker)]
            assert losses[-1] < losses[0], (opt, maker, losses)
            # Gefen learns its codebook from the first gradient of the parameters it
            # holds; a rank holds the gradients of its own layers only, so its codes
            # (not its arithmetic) differ from one process's: close, not equal.
            tol = 1e-9 if opt == "adamw" else 1e-2
            torch.testing.assert_close(
                torch.tensor(losses), torch.tensor(s_losses), rtol=tol, atol=0
            )
            owned = range(rank * layers_per_rank, (rank + 1) * layers_per_rank)
            names = [
                n
                for n in s_params
                if not n.startswith("stack.") or int(n.split(".")[2]) in owned
            ]
            assert_close_params(s_params, params, names, tol=tol)


CHECKPOINTED = [("adamw", "kfac"), ("gefen8", "shampoo"), ("gefen4", "kfac")]


@pytest.mark.parametrize(("opt", "maker"), CHECKPOINTED)
def test_checkpoint_resume_bit_exact(opt, maker):
    torch.manual_seed(5)
    whole = Run(opt, maker, "lp")
    for _ in range(2):
        whole.step()
    blob = whole.state()
    for _ in range(2):
        whole.step()
    torch.manual_seed(123)  # a fresh process: other weights, other RNG state
    resumed = Run(opt, maker, "lp")
    resumed.load(blob)
    for _ in range(2):
        resumed.step()
    for name, p in whole.params().items():
        assert torch.equal(p, resumed.params()[name]), name
    assert whole.losses[2:] == resumed.losses
    assert whole.ctrl.state_dict() == resumed.ctrl.state_dict()


def test_controller_switch_to_serial_keeps_maker_and_gefen_state():
    # Two batches layer-parallel, then the Controller's check switches the stack to
    # serial; the next steps must equal a plain serial GPT started from the states
    # (weights, K-FAC factors, Gefen codes) the switch left.
    torch.manual_seed(5)
    run = Run("gefen8", "kfac", "lp")
    run.maker = make_gradient_maker(
        "kfac",
        run.model,
        config={"damping": 1e-2, "ema_decay": 0.9, "ignore_modules": ["wpe"]},
    )
    run.ctrl = Controller(run.model, every=2)
    for _ in range(2):
        run.step()
    run.ctrl.threshold = 1e-300  # the check of batch 2 finds "too slow" and switches
    run.step()
    assert run.ctrl.switched and run.ctrl.records[-1].action == "serial"
    blob = run.state()

    serial = Run("gefen8", "kfac", "serial")
    serial.maker = make_gradient_maker(
        "kfac",
        serial.model,
        config={"damping": 1e-2, "ema_decay": 0.9, "ignore_modules": ["wpe"]},
    )
    serial.load(blob)
    assert serial.maker.state_dict()["ema"] and serial.opt.state  # states carried
    for _ in range(2):
        run.step()
        serial.step()
    assert run.losses[-2:] == serial.losses
    want, got = serial.params(), run.params()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-15)


@pytest.mark.slow
def test_three_axes_example_runs(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "three_axes.png"
    args = ["--steps", "3", "--layers", "4", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(root / "examples" / "three_axes.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=True,
    )
    assert out.stat().st_size > 0
    assert "three axes" in done.stdout and "serial AdamW" in done.stdout
