"""Host synchronisations of a steady step on CUDA: only the listed ones (``-m gpu``).

A steady step refreshes nothing: Gefen's after its first steps (partition and
codebook learned, the compiled update built), an in-loop preconditioner's (and
its gradient maker's) between two refreshes, LayerParallel's after its first
call. Each is warmed up, then run once more under
``torch.cuda.set_sync_debug_mode``: ``"error"`` where no synchronisation is
listed (the first one raises), ``"warn"`` where the algorithm needs some. Each
warning is attributed to the innermost line of ``leantrain`` on the stack when
it was issued, and every one must be a place of :data:`LISTED`, as many times
as the step's own record says it read there. :data:`LISTED` is what the docs
list (docs/gefen.md, docs/precond.md "Devices", docs/layer_parallel.md) and
``tests/test_host_syncs.py`` holds the code to, without a GPU.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import leantrain
from leantrain.layer_parallel import LayerParallel
from leantrain.optim import Gefen, GefenMuon
from leantrain.precond import precondition_in_loop
from leantrain.precond.in_loop import IN_LOOP_METHODS
from leantrain.precond.registry import make_gradient_maker
from tests._helpers.lp_steps import TanhStep
from tests._helpers.source_scan import enclosing_function

pytestmark = pytest.mark.gpu

# (file under leantrain/, function) -> what the read is for.
LISTED = {
    ("optim/_checks.py", "finite_flags"): "Gefen's non-finite policy, per device",
    ("precond/preconditioned.py", "all_finite"): "the maker's non-finite policy",
    ("layer_parallel/mgrit.py", "mgrit_solve.norm"): "a residual norm MGRIT uses",
    ("layer_parallel/mgrit.py", "_finite"): "u_0's finiteness, when not converged",
}
# c10's warning: "called a synchronizing CUDA operation" (older torch: "... operation")
_SYNC = "called a synchronizing"
LIBRARY = Path(leantrain.__file__).resolve().parent  # wherever it is imported from
# Between two refreshes of every in-loop method: refreshed at step 0, then steady.
_EVERY_10 = {"curvature_interval": 10, "preconditioner_interval": 10}


def _cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device")
    return torch.device("cuda")


def _caller() -> tuple[str, str]:
    """(file under leantrain/, function) of the innermost library frame on the
    stack, or ("<outside leantrain>", file:line) of the innermost frame."""
    frame = sys._getframe(2)
    first = frame
    while frame is not None:
        path = Path(frame.f_code.co_filename).resolve()
        if path.is_relative_to(LIBRARY):
            return path.relative_to(LIBRARY).as_posix(), enclosing_function(
                path, frame.f_lineno
            )
        frame = frame.f_back
    return "<outside leantrain>", f"{first.f_code.co_filename}:{first.f_lineno}"


@contextlib.contextmanager
def host_syncs() -> Iterator[list[tuple[str, str]]]:
    """The synchronising CUDA calls made inside (``"warn"`` mode), each as the
    ``(file, function)`` of the library line that made it, in order."""
    found: list[tuple[str, str]] = []

    def record(message, category, filename, lineno, file=None, line=None):
        if _SYNC in str(message):  # issued inside the call: the stack is the caller's
            found.append(_caller())

    torch.cuda.synchronize()  # nothing earlier is charged to the step
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # every sync, not once per line
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(previous)


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Raise ``RuntimeError`` at the first synchronising CUDA call inside."""
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _only_listed(found: list[tuple[str, str]]) -> Counter:
    unlisted = [f for f in found if f not in LISTED]
    assert not unlisted, f"unlisted host synchronisations: {unlisted}"
    return Counter(found)


# -- Gefen ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make, options, width",
    [
        (Gefen, {}, 64),  # 8-bit default
        (Gefen, {"momentum_bits": 4}, 64),  # 4-bit default: factored, stochastic
        (Gefen, {"partition": "tensor"}, 512),  # blocks longer than a chunk
        (GefenMuon, {}, 64),
        (GefenMuon, {"momentum_bits": 4}, 64),
    ],
    ids=["gefen-8bit", "gefen-4bit", "gefen-8bit-one-block", "muon-8bit", "muon-4bit"],
)
def test_gefen_steady_step_reads_only_its_nonfinite_verdict(make, options, width):
    device = _cuda()
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, width), nn.LayerNorm(width), nn.Tanh(), nn.Linear(width, width)
    ).to(device)
    opt = make(model.parameters(), lr=1e-3, **options)
    x = torch.randn(16, 32, device=device)

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):  # the codebook, then the compiled update's graphs
        step()
    with host_syncs() as found:
        step()
    # one read for the one device: does any gradient hold NaN or inf
    assert _only_listed(found) == {("optim/_checks.py", "finite_flags"): 1}
    assert opt.nonfinite_steps == 0
    momenta = [s.get("exp_avg_codes", s.get("exp_avg")) for s in opt.state.values()]
    assert all(m.is_cuda for m in momenta)


# -- preconditioning --------------------------------------------------------------
def _mlp(device: torch.device) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).to(device)
    x = torch.randn(32, 6, device=device)
    return model, x, torch.arange(32, device=device) % 3


@pytest.mark.parametrize("method", sorted(IN_LOOP_METHODS))
def test_in_loop_steady_step_reads_only_its_nonfinite_verdict(method):
    device = _cuda()
    model, x, t = _mlp(device)
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = precondition_in_loop(sgd, model, method, config=_EVERY_10)

    def step():
        F.cross_entropy(model(x), t).backward()
        opt.step()
        opt.zero_grad()

    step()  # step 0 refreshes
    step()
    with host_syncs() as found:
        step()
    assert _only_listed(found) == {("precond/preconditioned.py", "all_finite"): 1}
    assert (opt.maker.step, opt.maker.curvature_updates) == (3, 1)


@pytest.mark.parametrize("method", sorted(IN_LOOP_METHODS))
def test_gradient_maker_steady_step_reads_only_its_nonfinite_verdict(method):
    device = _cuda()
    model, x, t = _mlp(device)
    maker = make_gradient_maker(method, model, config=_EVERY_10)
    maker.lr = 0.05  # the KL clip's learning rate

    def step():
        for p in model.parameters():
            p.grad = None
        maker.setup_loss_call(F.cross_entropy, maker.setup_model_call(model, x), t)
        maker.forward_and_backward()

    step()
    step()
    with host_syncs() as found:
        step()
    assert _only_listed(found) == {("precond/preconditioned.py", "all_finite"): 1}
    assert (maker.step, maker.curvature_updates) == (3, 1)


# -- LayerParallel ----------------------------------------------------------------
def _stack(device: torch.device, **options) -> tuple[LayerParallel, torch.Tensor]:
    torch.manual_seed(0)
    blocks = [TanhStep(16) for _ in range(8)]
    stack = LayerParallel(blocks, cf=2, on_divergence="ignore", **options).to(device)
    x = torch.randn(4, 16, device=device, requires_grad=True)
    stack(x).square().sum().backward()  # warm-up
    return stack, x


def _mgrit_reads(stats) -> Counter:
    """The reads one MGRIT solve reports: a residual per full V-cycle, the final
    residual and the state norm; u_0's finiteness when the verdict is False.
    (Counters compare missing entries as 0.)"""
    return Counter(
        {
            ("layer_parallel/mgrit.py", "mgrit_solve.norm"): len(stats.residuals) + 2,
            ("layer_parallel/mgrit.py", "_finite"): int(stats.converged is False),
        }
    )


def test_layer_parallel_serial_mode_makes_no_host_sync():
    stack, x = _stack(_cuda())
    stack.serial()
    with no_host_sync():
        stack(x).square().sum().backward()
    assert stack.stats.mode == "serial" and x.grad.device == x.device


def test_serial_forward_solver_syncs_only_for_the_adjoints_residuals():
    stack, x = _stack(_cuda(), forward_solver="serial", bwd_iters=2)
    with no_host_sync():  # the forward: exact stepping, nothing read
        loss = stack(x).square().sum()
    with host_syncs() as found:
        loss.backward()
    expected = _mgrit_reads(stack.stats.backward)
    assert _only_listed(found) == expected
    assert len(stack.stats.backward.residuals) == 1  # the skipped cycle reads none


def test_mgrit_syncs_only_for_its_residuals():
    stack, x = _stack(_cuda(), fwd_iters=2, bwd_iters=2)
    with host_syncs() as found:
        stack(x).square().sum().backward()
    expected = _mgrit_reads(stack.stats.forward) + _mgrit_reads(stack.stats.backward)
    assert _only_listed(found) == expected
