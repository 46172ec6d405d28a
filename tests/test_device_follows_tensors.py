"""No device assumption in the three axes: what they make follows the tensors it serves.

A tensor factory without ``device=`` (``torch.zeros``, ``torch.arange``,
``torch.tensor``, ``torch.Generator``, ...) makes a CPU tensor; in code that
serves CUDA parameters that is either a crash (a CPU generator handed to a CUDA
draw: K-FAC's Monte-Carlo Fisher did exactly that, ``Expected a 'cuda' device
type for generator``; a CPU buffer in an NCCL collective) or a host-synchronising
copy on every use (a CPU index into a CUDA tensor).

Without a GPU here, the check is static, so that a reader can follow it: every
such call in ``leantrain/precond``, ``leantrain/optim`` and
``leantrain/layer_parallel`` either passes ``device=`` or is listed below, by
file, enclosing function and factory, with the reason it may stay on the host.
A new call without ``device=`` fails this test until it passes one or is listed
with its reason; a listed call that is gone fails it too, so the list stays
true. ``*_like`` and ``new_*`` factories follow their tensor and are not
checked. The ``gpu``-marked tests run the same paths on a real device.
"""

from __future__ import annotations

import ast

import pytest
import torch

from leantrain.precond._random import DeviceGenerators, device_key
from tests._helpers.source_scan import ROOT, assert_listed, parse, scoped_nodes

PACKAGES = ("precond", "optim", "layer_parallel")
FACTORIES = {
    "arange",
    "as_tensor",
    "empty",
    "eye",
    "full",
    "Generator",
    "linspace",
    "normal",
    "ones",
    "rand",
    "randint",
    "randn",
    "randperm",
    "tensor",
    "zeros",
}

_LAYOUT = (
    "a layout index built with the op on the CPU; ModuleOp.index_on moves it to "
    "the parameters' device on first use"
)
_HOST_STATE = (
    "host-side bookkeeping in the state dict (a counter or a size), as torch.optim "
    "keeps its step on the CPU"
)
_CPU_TOOL = "CPU measurement / simulation tool of the depth axis (gloo, CPU timings)"
_CODEBOOK = (
    "the codebook's lookup tables are built on the host from its at most 256 codes"
)
_NO_TENSOR = "no tensor to follow (an empty list of layers)"

HOST_SIDE: dict[tuple[str, str, str], str] = {
    # precond
    ("precond/_safeguards.py", "layer_norms", "zeros"): _NO_TENSOR,
    ("precond/_safeguards.py", "layer_dots", "zeros"): _NO_TENSOR,
    ("precond/curv/_base.py", "ModuleOp.__init__", "empty"): _LAYOUT,
    ("precond/curv/_conv.py", "canonical_order", "arange"): _LAYOUT,
    ("precond/curv/_conv.py", "canonical_order", "tensor"): _LAYOUT,
    ("precond/curv/_linear_form.py", "LinearFormOp._setup", "arange"): _LAYOUT,
    ("precond/curv/_norm.py", "ElementwiseAffineOp._setup", "arange"): _LAYOUT,
    ("precond/curv/_tied.py", "TiedOp.__init__", "arange"): _LAYOUT,
    (
        "precond/curv/api.py",
        "_zeros",
        "zeros",
    ): "a dtype/device template when the model has no parameters",
    (
        "precond/curv/api.py",
        "_frozen_entries",
        "empty",
    ): "an empty index (no frozen rows)",
    (
        "precond/curv/representations.py",
        "Curvature._dtype_device",
        "zeros",
    ): "a dtype/device template when the layer has no parameters",
    (
        "precond/methods/kbfgs.py",
        "KbfgsGradientMaker._extra_state",
        "tensor",
    ): _HOST_STATE,
    # optim
    ("optim/_checkpoint.py", "to_checkpoint", "tensor"): _HOST_STATE,
    (
        "optim/_checkpoint.py",
        "to_checkpoint",
        "zeros",
    ): "a placeholder codebook in the saved layout of an fp32-momentum parameter",
    (
        "optim/_muon_state.py",
        "check_muon_state",
        "zeros",
    ): "a validation template, never stepped",
    ("optim/_quant_table.py", "build_table", "arange"): _CODEBOOK,
    ("optim/_quant_table.py", "build_table", "tensor"): _CODEBOOK,
    ("optim/_quant_table.py", "_interval_entry", "arange"): _CODEBOOK,
    ("optim/_quant_table.py", "_interval_entry", "full"): _CODEBOOK,
    ("optim/_quant_table.py", "_interval_entry", "tensor"): _CODEBOOK,
    (
        "optim/_sharded.py",
        "block_lengths",
        "arange",
    ): "moved to the state's device by its caller",
    ("optim/_state.py", "new_state", "tensor"): _HOST_STATE,
    ("optim/_triton_tables.py", "device_codebook", "full"): (
        _CODEBOOK + ", then moved to the parameters' device"
    ),
    (
        "optim/_triton_step.py",
        "upload",
        "tensor",
    ): "the kernels' job tables, built on the host and copied to the device",
    ("optim/_triton_layout.py", "build_layout", "tensor"): (
        "the kept job tables' host copies, uploaded by _triton_step.upload each step"
    ),
    ("optim/_triton_momentum.py", "_build", "tensor"): (
        "the kept momentum job table's host copy, uploaded by _triton_step.upload "
        "each step"
    ),
    ("optim/_triton_step.py", "fill", "tensor"): (
        "a step's columns of a host job table, uploaded by _triton_step.upload"
    ),
    ("optim/gefen.py", "Gefen._template_step", "tensor"): _HOST_STATE,
    ("optim/factored.py", "_native_means", "empty"): "buffers of the CPU C kernel",
    # layer_parallel
    ("layer_parallel/mgrit.py", "mgrit_solve", "as_tensor"): "reads a dtype only",
    (
        "layer_parallel/module.py",
        "_MGRITFunction.forward",
        "empty",
    ): "a structure template for autograd, never computed with",
    (
        "layer_parallel/ode.py",
        "LayerRNG.draw",
        "randint",
    ): (
        "draws a batch's seed from the user's global CPU stream; the layers' draws "
        "use each device's own generator"
    ),
    ("layer_parallel/costs/simulate.py", "_solve_clock", "Generator"): _CPU_TOOL,
    ("layer_parallel/costs/simulate.py", "_solve_clock", "zeros"): _CPU_TOOL,
    ("layer_parallel/costs/simulate.py", "_solve_clock.prop", "rand"): _CPU_TOOL,
    ("layer_parallel/costs/timing.py", "_two_process_worker", "randn"): _CPU_TOOL,
    ("layer_parallel/costs/timing.py", "_two_process_worker", "tensor"): _CPU_TOOL,
    ("layer_parallel/costs/timing.py", "measure_comm", "zeros"): _CPU_TOOL,
}


def _factory_calls_without_device() -> dict[tuple[str, str, str], list[int]]:
    """(file, enclosing function, factory) -> line numbers, for every ``torch.X(...)``
    factory call that passes no ``device=`` keyword."""
    found: dict[tuple[str, str, str], list[int]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for scope, node in scoped_nodes(parse(path)):
                func = getattr(node, "func", None)
                if (
                    isinstance(node, ast.Call)
                    and isinstance(func, ast.Attribute)
                    and isinstance(func.value, ast.Name)
                    and func.value.id == "torch"
                    and func.attr in FACTORIES
                    and "device" not in {k.arg for k in node.keywords}
                ):
                    found.setdefault((rel, scope, func.attr), []).append(node.lineno)
    return found


def test_every_factory_follows_a_device_or_says_why_not():
    found = _factory_calls_without_device()
    assert_listed(
        found,
        HOST_SIDE,
        what="tensor factories without device=",
        table="HOST_SIDE",
        fix="pass the device of the tensors they serve",
    )


def test_the_check_finds_a_device_less_factory(tmp_path, monkeypatch):
    """The scan itself: a ``torch.Generator()`` in a function is reported."""
    package = tmp_path / "precond"
    package.mkdir()
    (package / "m.py").write_text(
        "import torch\n\ndef draw():\n    return torch.Generator().manual_seed(0)\n"
        "\ndef fine(x):\n    return torch.zeros(3, device=x.device)\n"
    )
    globals_ = _factory_calls_without_device.__globals__
    monkeypatch.setitem(globals_, "ROOT", tmp_path)
    monkeypatch.setitem(globals_, "PACKAGES", ("precond",))
    assert _factory_calls_without_device() == {
        ("precond/m.py", "draw", "Generator"): [4]
    }


def test_generators_are_made_per_device_from_the_seed():
    streams = DeviceGenerators(7)
    cpu = streams.on("cpu")
    assert cpu.device == torch.device("cpu")
    assert streams.on(torch.device("cpu")) is cpu
    expected = torch.randn(5, generator=torch.Generator().manual_seed(7))
    assert torch.equal(torch.randn(5, generator=cpu), expected)


def test_generator_state_round_trips():
    streams = DeviceGenerators(3)
    torch.rand(4, generator=streams.on("cpu"))
    state = streams.get_state()
    after = torch.rand(4, generator=streams.on("cpu"))
    streams.set_state(state)
    assert torch.equal(torch.rand(4, generator=streams.on("cpu")), after)
    fresh = DeviceGenerators(3)
    fresh.set_state(state["cpu"])  # a bare tensor: a CPU state (older checkpoints)
    assert torch.equal(torch.rand(4, generator=fresh.on("cpu")), after)


def test_a_loaded_state_of_an_unused_device_waits_for_that_device():
    """A CUDA stream saved on a GPU machine and loaded on a CPU one is kept
    (and saved again) until that device draws."""
    streams = DeviceGenerators(0)
    cuda_like = torch.Generator().manual_seed(11).get_state()
    streams.set_state({"cuda:0": cuda_like, "cpu": torch.Generator().get_state()})
    streams.on("cpu")
    assert set(streams.get_state()) == {"cpu", "cuda:0"}
    assert torch.equal(streams.get_state()["cuda:0"], cuda_like)


def test_bad_generator_state_is_refused_by_type():
    with pytest.raises(TypeError, match="device names to byte tensors"):
        DeviceGenerators(0).set_state([1, 2])


def test_device_key_names_the_device():
    assert device_key("cpu") == "cpu"
    assert device_key(torch.device("cpu")) == "cpu"
