"""A steady step reads nothing on the host but what its algorithm needs: a static check.

A steady step is one that refreshes nothing: Gefen's after its first step, an
in-loop preconditioner's (and its gradient maker's) between two curvature or
preconditioner refreshes, LayerParallel's after its first call. On CUDA every
read of a device value on the host (``.item()``, ``float(t)``, ``int(t)``,
``bool(t)``, ``.tolist()``, ``.cpu()``, ``.numpy()``, ``nonzero``) makes the host
wait until the device has caught up, and so does ``torch.tensor(...,
device=...)``, a copy from the host that waits for itself.
``tests/test_host_syncs_gpu.py`` catches them on a GPU with
``torch.cuda.set_sync_debug_mode``; this test holds the code to the same list
without one, so that a new read fails the default suite before a GPU is lent.

:data:`STEADY` names the functions a steady step runs, read from the code (a
class stands for all its methods, a function for the functions nested in it).
Every such call in them is listed in :data:`HOST_READS`, by file, function and
call, with why it stays: it reads a host value (an option, a shape, a step
counter that lives on the CPU as torch.optim keeps its own), or the algorithm
needs the device's answer (those are the syncs the docs list: docs/gefen.md,
docs/precond.md "Devices", docs/layer_parallel.md). A new call fails this test
until it is removed or listed with its reason; a listed call that is gone, or a
listed function that no longer exists, fails it too, so both lists stay true.
What the scan cannot see: a tensor in an ``if`` without ``bool(...)``, and
implicit syncs inside torch ops; the GPU test sees those.
"""

from __future__ import annotations

import ast

from tests._helpers.source_scan import ROOT, assert_listed, parse, scoped_nodes

# file under leantrain/ -> the functions and classes a steady step runs.
STEADY: dict[str, tuple[str, ...]] = {
    # Gefen and GefenMuon on CUDA: the full step (the cached C-kernel plan is for
    # the CPU), the dispatch, the Triton step's host side, the chunked PyTorch
    # update and what they call.
    "optim/gefen.py": ("Gefen.step", "Gefen._label", "Gefen._template_step"),
    "optim/_base.py": (
        "GefenBase._steps",
        "GefenBase._active",
        "GefenBase._all_finite",
        "GefenBase._agreed_finite",
        "GefenBase._check_bits",
        "GefenBase._positions",
        "GefenBase._planned_step",
        "GefenBase._dispatched_step",
    ),
    "optim/_checks.py": ("finite_flags", "is_finite", "check_grad"),
    "optim/_state_dict.py": ("LazyLabel", "fresh", "group_factors"),
    "optim/_options.py": (
        "StepOptions",
        "StepOptions.scalars",
        "options_of",
        "scalar_options",
        "resolved",
        "own_v",
        "_fresh",
        "second_moment_of",
        "stochastic_codes_of",
        "update_clip_of",
        "max_step",
    ),
    "optim/_straddle.py": ("straddle_layout",),
    "optim/_dtensor.py": ("local", "is_dtensor", "is_sharded"),
    "optim/_dispatch.py": (
        "StepItem",
        "step_many",
        "_checked",
        "_signature",
        "_layout_only",
        "_keys",
        "_torch_one",
        "_launch_triton",
    ),
    # the steady CUDA step: the Triton plan on the kept tables
    "optim/_fused_plan.py": ("StepPlan.holds", "TritonPlan.run", "_fields"),
    "optim/_triton_step.py": (
        "grad_fits",
        "job",
        "launch",
        "_launch",
        "_launch_factored",
        "fill",
        "upload",
        "signed",
        "log_jobs",
        "tl_dtype",
    ),
    # GefenMuon's Muon side on CUDA: the momentum launch, then Newton-Schulz
    "optim/_triton_momentum.py": (
        "step_on_triton",
        "problem",
        "job",
        "launch",
        "_launch",
        "_key",
        "_hyper",
    ),
    "optim/_fused.py": (
        "fused_step",
        "implementation",
        "check_step",
        "advance_factors",
        "torch_fallback",
    ),
    "optim/_torch_step.py": (
        "torch_step",
        "_chunk",
        "_big_block",
        "_momentum",
        "_quantize",
        "_ema",
        "_clipped",
        "read_codes",
        "write_codes",
    ),
    "optim/factored.py": (
        "update_factors",
        "torch_factor_means",
        "column_mean",
        "denominator_factors",
        "factored_denominator",
    ),
    "optim/_quant_table.py": ("quant_table", "nearest_index", "cell_index"),
    "optim/code_rounding.py": (
        "round_blocks",
        "stochastic_index",
        "searched_index",
        "uniform",
    ),
    "optim/precision.py": ("round_to", "stochastic_round", "random_bits"),
    "optim/_state_layout.py": ("state_layout", "packed_codes"),
    "optim/_state.py": ("state_bits", "check_factored", "second_moment_length"),
    "optim/muon.py": (
        "GefenMuon.step",
        "GefenMuon._takes_triton",
        "GefenMuon._quantizer",
    ),
    "optim/_muon_math.py": (
        "muon_step",
        "muon_momentum",
        "muon_update",
        "newton_schulz",
    ),
    "optim/quant.py": (
        "NearestCode.__call__",
        "quantize_blockwise",
        "dequantize_blockwise",
        "pack_nibbles",
        "unpack_nibbles",
        "block_absmax",
    ),
    # Preconditioning: the in-loop step and the gradient maker's, between refreshes.
    "precond/in_loop.py": (
        "PreconditionedOptimizer.step",
        "PreconditionedOptimizer._arm",
    ),
    "precond/_loop_record.py": ("amp_scale",),
    "precond/preconditioned.py": (
        "all_finite",
        "PreconditionedGradientMaker.forward_and_backward",
        "PreconditionedGradientMaker._step",
        "PreconditionedGradientMaker.finish_step",
        "PreconditionedGradientMaker._apply_preconditioner",
        "PreconditionedGradientMaker._layer_gradients",
        "PreconditionedGradientMaker._plain_gradient",
        "PreconditionedGradientMaker._layer_lrs",
        "PreconditionedGradientMaker._gradients_are_finite",
    ),
    "precond/gradient_maker.py": (
        "GradientMaker._forward_backward",
        "GradientMaker._call_model",
        "GradientMaker._loss_from_output",
        "unscaled",
        "check_loss",
    ),
    "precond/_patterns.py": ("scale_gradients", "check_trainable"),
    "precond/_safeguards.py": (
        "layer_norms",
        "graft",
        "layer_dots",
        "kl_clip_factor",
        "shortcut_gradient_norm",
        "shortcut_gradient_dot",
        "PlainGradient",
    ),
    "precond/_kfac_apply.py": ("split_inverse", "write_shortcut", "write_operators"),
    "precond/methods/kfac.py": ("KfacGradientMaker.precondition",),
    "precond/methods/ekfac.py": ("EkfacGradientMaker.precondition",),
    "precond/methods/shampoo.py": (
        "ShampooGradientMaker._forward_backward",
        "ShampooGradientMaker.precondition",
        "_precondition_block",
    ),
    "precond/_kron.py": (
        "KronFactorMaker._forward_backward",
        "KronFactorMaker._plain_gradient",
        "KronFactorMaker._unwritten_gradients",
    ),
    "precond/methods/natural_gradient.py": (
        "NaturalGradientMaker.precondition",
        "_solve",
    ),
    "precond/methods/smw_ng.py": ("SmwNgGradientMaker.precondition",),
    "precond/methods/seng.py": ("SengGradientMaker.precondition",),
    "precond/_gram.py": (
        "GramInverse.right",
        "GramInverse.left",
        "CholeskyInverse.right",
        "CholeskyInverse.left",
        "right_solve",
    ),
    # LayerParallel: a call (forward and backward), MGRIT or the serial solver.
    "layer_parallel/module.py": (
        "LayerParallel.forward",
        "LayerParallel._output",
        "LayerParallel._solve_forward",
        "LayerParallel._solve_adjoint",
        "LayerParallel._warm_guess",
        "LayerParallel._finish",
        "_MGRITFunction",
    ),
    "layer_parallel/mgrit.py": (
        "mgrit_solve",
        "sequential_solve",
        "_Chunk",
        "_finite",
        "_judge",
        "MGRITStats",
    ),
    "layer_parallel/relaxation.py": (
        "f_relax",
        "c_relax",
        "restrict",
        "serial_sweep",
        "correct",
    ),
    "layer_parallel/ode.py": (
        "sq_norm",
        "LayerRNG",
        "run_step",
        "serial_forward",
        "StepPropagator",
    ),
    "layer_parallel/adjoint.py": ("vjp", "AdjointPropagator", "adjoint_solve"),
    "layer_parallel/layout.py": ("LocalExchange",),
}

_OPTION = "a host value (an option, a shape, a Python list or flag), not a tensor"
_CPU_STATE = (
    "a CPU tensor of the state (step counter, period, qblock, factor rows), kept on "
    "the host as torch.optim keeps its step"
)
_NONFINITE = (
    "needed: the non-finite policy (skip or raise) decides on the host whether to "
    "step; one read per step and device"
)
_SHARDED = "FSDP2-sharded parameters only: every rank agrees on the verdict"
_STEP_NUMBER = "the step number, a host float read from the CPU step counter"
_DCP_INIT = (
    "runs only when every lr is 0 and every state is fresh (DCP's state "
    "initialisation), never in a steady step"
)

# (file, function, call) -> why it stays in a steady step.
HOST_READS: dict[tuple[str, str, str], str] = {
    # optim
    ("optim/_base.py", "GefenBase._agreed_finite", "bool()"): _SHARDED,
    ("optim/_base.py", "GefenBase._agreed_finite", "torch.tensor(device=)"): _SHARDED,
    ("optim/_fused_plan.py", "TritonPlan.run", "float()"): _CPU_STATE,
    ("optim/_fused_plan.py", "TritonPlan.run", "int()"): _STEP_NUMBER,
    ("optim/gefen.py", "Gefen._template_step", "float()"): _OPTION,
    ("optim/gefen.py", "Gefen._template_step", "bool()"): _DCP_INIT,
    ("optim/gefen.py", "Gefen._template_step", "torch.tensor(device=)"): _DCP_INIT,
    ("optim/_checks.py", "finite_flags", "x.tolist()"): _NONFINITE,
    ("optim/_checks.py", "is_finite", "bool()"): (
        "only for a gradient whose batched norm is not finite (an overflow of "
        "finite values, or the step is skipped anyway)"
    ),
    ("optim/_state_dict.py", "fresh", "int()"): _CPU_STATE,
    ("optim/_straddle.py", "straddle_layout", "int()"): _CPU_STATE,
    ("optim/_dispatch.py", "_keys", "int()"): _STEP_NUMBER,
    ("optim/_dispatch.py", "_torch_one", "float()"): _CPU_STATE,
    ("optim/_dispatch.py", "_launch_triton", "float()"): _CPU_STATE,
    ("optim/_fused.py", "fused_step", "float()"): _CPU_STATE,
    ("optim/_fused.py", "fused_step", "int()"): _CPU_STATE,
    ("optim/_fused.py", "advance_factors", "int()"): _CPU_STATE,
    ("optim/_fused.py", "check_step", "bool()"): _OPTION,
    ("optim/_muon_math.py", "muon_momentum", "int()"): _CPU_STATE,
    ("optim/_triton_momentum.py", "step_on_triton", "int()"): _CPU_STATE,
    ("optim/_triton_momentum.py", "step_on_triton", "float()"): _OPTION,
    ("optim/muon.py", "GefenMuon.step", "float()"): _OPTION,
    ("optim/_triton_momentum.py", "_key", "int()"): _CPU_STATE,
    ("optim/_triton_momentum.py", "_launch", "int()"): (
        "a host flag (stochastic codes) as 0 or 1"
    ),
    ("optim/_state.py", "state_bits", "int()"): _OPTION,
    ("optim/_state.py", "check_factored", "int()"): _CPU_STATE,
    ("optim/_state.py", "second_moment_length", "int()"): _CPU_STATE,
    ("optim/_state_layout.py", "state_layout", "int()"): _CPU_STATE,
    ("optim/_torch_step.py", "_chunk", "float()"): _OPTION,
    ("optim/_torch_step.py", "torch_step", "int()"): _CPU_STATE,
    ("optim/_options.py", "own_v", "int()"): _CPU_STATE,
    ("optim/_options.py", "_fresh", "int()"): _CPU_STATE,
    ("optim/_options.py", "scalar_options", "float()"): _OPTION,
    ("optim/factored.py", "denominator_factors", "torch.tensor(device=)"): (
        "only with a host float cbar (the reference step); the steady step passes "
        "column_mean's tensor"
    ),
    ("optim/quant.py", "pack_nibbles", "int()"): (
        "the public function's range check; GefenMuon passes check_range=False"
    ),
    ("optim/quant.py", "quantize_blockwise", "bool()"): (
        "the public function's finiteness check; GefenMuon passes check_finite=False"
    ),
    # precond
    ("precond/preconditioned.py", "all_finite", "bool()"): _NONFINITE,
    (
        "precond/preconditioned.py",
        "PreconditionedGradientMaker._layer_lrs",
        "float()",
    ): "the learning rates of the wrapped optimizer's groups, host options",
    ("precond/in_loop.py", "PreconditionedOptimizer.step", "float()"): (
        "needed under GradScaler.step: found_inf decides whether the wrapped "
        "optimizer steps and whether the recorded statistics count"
    ),
    (
        "precond/preconditioned.py",
        "PreconditionedGradientMaker.finish_step",
        "float()",
    ): ("curvature steps only: the loss scale divided out of the recorded statistics"),
    ("precond/_loop_record.py", "amp_scale", "float()"): (
        "only after GradScaler.unscale_ (gradient clipping): the scaler's public "
        "get_scale() is a host float"
    ),
    # layer_parallel
    ("layer_parallel/mgrit.py", "mgrit_solve.norm", "float()"): (
        "needed: one read per residual norm the solve uses (the stopping test of "
        "each full V-cycle, the final residual, the state norm)"
    ),
    ("layer_parallel/mgrit.py", "_finite", "bool()"): (
        "needed when the verdict is 'not converged': a non-finite u_0 (a "
        "GradScaler overflow) gets no verdict instead"
    ),
    ("layer_parallel/module.py", "LayerParallel.forward", "bool()"): _OPTION,
    ("layer_parallel/ode.py", "LayerRNG.__init__", "int()"): _OPTION,
    ("layer_parallel/ode.py", "LayerRNG.draw", "int()"): (
        "the batch seed, drawn from the user's CPU generator"
    ),
    ("layer_parallel/ode.py", "LayerRNG.draw", "x.item()"): (
        "the batch seed, drawn from the user's CPU generator"
    ),
}


# Calls that read a tensor on the host (or copy one to the device and wait).
_METHODS = {"item", "tolist", "cpu", "numpy", "nonzero"}
_BUILTINS = {"float", "int", "bool"}
_COPIES = {"tensor", "as_tensor"}  # with device=: from the host, then a wait


def _host_read(node: ast.AST) -> str | None:
    """The kind of host read a call is (``"x.item()"``, ``"float()"``,
    ``"torch.tensor(device=)"``, ...), or None."""
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    if isinstance(func, ast.Name) and func.id in _BUILTINS and node.args:
        if not isinstance(node.args[0], ast.Constant):
            return f"{func.id}()"
    if isinstance(func, ast.Attribute):
        torch_call = isinstance(func.value, ast.Name) and func.value.id == "torch"
        if torch_call and func.attr == "nonzero":
            return "torch.nonzero()"
        if torch_call and func.attr in _COPIES:
            if "device" in {k.arg for k in node.keywords}:
                return f"torch.{func.attr}(device=)"
            return None
        if func.attr in _METHODS and not torch_call:
            return f"x.{func.attr}()"
    return None


def _audited(scope: str, names: tuple[str, ...]) -> str | None:
    """The STEADY entry that covers ``scope`` (itself or an enclosing one)."""
    for name in names:
        if scope == name or scope.startswith(name + "."):
            return name
    return None


def _steady_host_reads(
    steady: dict[str, tuple[str, ...]],
) -> tuple[dict[tuple[str, str, str], list[int]], set[tuple[str, str]]]:
    """(file, function, call) -> line numbers of every host read in the audited
    functions; and the audited (file, name) pairs that no longer exist."""
    found: dict[tuple[str, str, str], list[int]] = {}
    seen: set[tuple[str, str]] = set()
    for rel, names in steady.items():
        for scope, node in scoped_nodes(parse(ROOT / rel)):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                full = node.name if scope == "<module>" else f"{scope}.{node.name}"
                if full in names:
                    seen.add((rel, full))
            kind = _host_read(node)
            if kind is not None and _audited(scope, names) is not None:
                found.setdefault((rel, scope, kind), []).append(node.lineno)
    missing = {(rel, n) for rel, names in steady.items() for n in names} - seen
    return found, missing


def test_steady_steps_read_only_the_listed_host_values():
    found, missing = _steady_host_reads(STEADY)
    assert not missing, f"STEADY names functions that are gone: {sorted(missing)}"
    assert_listed(
        found,
        HOST_READS,
        what="host reads in a steady step",
        table="HOST_READS",
        fix="keep the value on the device",
    )


def test_the_scan_finds_each_kind_of_host_read(tmp_path, monkeypatch):
    """The scan itself, on a small module: each kind of read is reported in its
    function; a constant, a torch.tensor without device= (a CPU tensor) and an
    unaudited function are not."""
    package = tmp_path / "optim"
    package.mkdir()
    (package / "m.py").write_text(
        "import torch\n"
        "\n"
        "def step(t, lr):\n"
        "    a = float(t) + int(lr) + float(1)\n"
        "    if bool(t.any()):\n"
        "        b = t.item(), t.tolist(), t.cpu(), t.numpy(), t.nonzero()\n"
        "    c = torch.nonzero(t)\n"
        "    d = torch.tensor(0.5, device=t.device), torch.tensor(0.5)\n"
        "\n"
        "    def inner():\n"
        "        return t.item()\n"
        "\n"
        "def other(t):\n"
        "    return t.item()\n"
    )
    monkeypatch.setitem(_steady_host_reads.__globals__, "ROOT", tmp_path)
    found, missing = _steady_host_reads({"optim/m.py": ("step", "gone")})
    assert missing == {("optim/m.py", "gone")}
    assert found == {
        ("optim/m.py", "step", "float()"): [4],
        ("optim/m.py", "step", "int()"): [4],
        ("optim/m.py", "step", "bool()"): [5],
        ("optim/m.py", "step", "x.item()"): [6],
        ("optim/m.py", "step", "x.tolist()"): [6],
        ("optim/m.py", "step", "x.cpu()"): [6],
        ("optim/m.py", "step", "x.numpy()"): [6],
        ("optim/m.py", "step", "x.nonzero()"): [6],
        ("optim/m.py", "step", "torch.nonzero()"): [7],
        ("optim/m.py", "step", "torch.tensor(device=)"): [8],
        ("optim/m.py", "step.inner", "x.item()"): [11],
    }
