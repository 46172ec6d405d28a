"""The depth axis of ``leantrain compare``: the serial stack against LayerParallel.

A deep, narrow GPT (``GPTConfig(n_layer=32, d_model=32, t_final=1)``: ``h = 1/N``)
is run twice on one batch of the embedded text: with its own residual stack (exact
serial autograd) and with the same blocks inside :class:`LayerParallel` (MGRIT
forward and adjoint). The table gives

* the relative difference ``||a - b|| / ||b||`` of the logits and of the gradient of
  every parameter (concatenated), parallel against serial, in float32;
* MGRIT's convergence factor, forward and adjoint: the worst ratio of consecutive
  residuals above the rounding floor (:func:`~.layer_parallel.convergence_factor`),
  measured as the :class:`~.layer_parallel.Controller` does, on a step with twice
  the iterations (so that every solve records at least two residuals);
* the step time of the stack on two gloo processes (one thread each) against the
  serial step on one, measured in the same two processes
  (:func:`~.layer_parallel.costs.timing.measure_two_process`), and the simulator's
  serial and two-process steps from the per-layer times and the message cost
  measured there: both as milliseconds and as a speedup over serial, the numbers
  the panel plots;
* the simulator's projected speedup over serial at 8, 32 and 128 ranks for a stack
  of ``projected_layers`` of the same blocks, from those layer times, under the
  message cost measured here and under a GPU interconnect (10 us, 25 GB/s).

The two-process timing needs both cores, so it runs alone, before the other axes'
runs start. :func:`verdict` says in one sentence what the numbers mean on this
machine, worded from them. On CUDA the stack is wider
(``compare.devices.DEVICE_SIZES``) and one GPU's timing
(:mod:`leantrain.compare.depth_device`) replaces the two gloo processes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass

import torch
from torch import nn

from leantrain.compare.depth_device import GPU_INTERCONNECT, time_on_device
from leantrain.compare.jobs import Job
from leantrain.compare.report import fmt, mark_under_load, markdown_table
from leantrain.layer_parallel.costs.simulate import CommModel, simulate
from leantrain.layer_parallel.costs.timing import StackSpec, measure_two_process
from leantrain.models import GPT, GPTConfig, lm_loss


@dataclass(frozen=True)
class DepthConfig:
    """The GPT, the solver, the timing rounds and the projection of the depth axis."""

    n_layer: int = 32
    d_model: int = 32
    n_head: int = 4
    tokens: int = 32
    batch: int = 16
    levels: int = 2
    cf: int = 4
    fwd_iters: int = 2
    bwd_iters: int = 1
    repeats: int = 10
    layer_reps: int = 20
    ranks: tuple[int, ...] = (8, 32, 128)
    projected_layers: int = 512
    seed: int = 0
    data: str = "stdlib"
    # "cuda": the sizes of compare.devices.DEVICE_SIZES, and the timing of one GPU
    # (compare.depth_device) in place of the two gloo processes.
    device: str = "cpu"

    def stack_spec(self) -> StackSpec:
        """The two-process timing's stack: this GPT's blocks, this solver."""
        return StackSpec(
            n_layers=self.n_layer,
            d_model=self.d_model,
            n_head=self.n_head,
            batch=self.batch,
            tokens=self.tokens,
            levels=self.levels,
            cf=self.cf,
            fwd_iters=self.fwd_iters,
            bwd_iters=self.bwd_iters,
            repeats=self.repeats,
            layer_reps=self.layer_reps,
            seed=self.seed,
        )


DEFAULT = DepthConfig()


def deep_gpt(
    n_layer: int, d_model: int, n_head: int, tokens: int, seed: int = 0
) -> GPT:
    """The depth measurements' GPT: ``n_layer`` pre-LN causal blocks with
    ``t_final=1`` (so ``h = 1/N``, the ODE regime in which MGRIT converges), built
    from ``seed`` (the same weights on every rank and in every run)."""
    torch.manual_seed(seed)
    config = GPTConfig(
        block_size=tokens,
        n_layer=n_layer,
        n_head=n_head,
        d_model=d_model,
        t_final=1.0,
    )
    return GPT(config)


def gpt_blocks(spec: StackSpec) -> list[nn.Module]:
    """``spec``'s stack: the blocks of :func:`deep_gpt`, freshly built from
    ``spec.seed``. The block factory :func:`measure_two_process` takes."""
    model = deep_gpt(spec.n_layers, spec.d_model, spec.n_head, spec.tokens, spec.seed)
    return list(model.stack.steps)


@dataclass
class DepthAccuracy:
    """Parallel against serial on one batch, and the convergence factors."""

    output_rel_diff: float
    grad_rel_diff: float
    forward_factor: float
    backward_factor: float
    n_params: int


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def depth_accuracy(
    config: DepthConfig, *, progress: Callable[[], None]
) -> DepthAccuracy:
    """Logits and gradients of the GPT, LayerParallel against its serial stack."""
    from leantrain.data import TokenBatches, load_corpus
    from leantrain.layer_parallel import LayerParallel, convergence_factor

    corpus = load_corpus(config.data)
    model = deep_gpt(
        config.n_layer, config.d_model, config.n_head, config.tokens, config.seed
    )
    batches = TokenBatches(
        corpus.train,
        block_size=config.tokens,
        batch_size=config.batch,
        seed=config.seed,
    )
    model.to(config.device)
    x, y = (t.to(config.device) for t in next(iter(batches)))

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        logits = model(x)
        lm_loss(logits, y).backward()
        grads = [p.grad.flatten() for _, p in sorted(model.named_parameters())]
        return logits.detach(), torch.cat(grads)

    serial_out, serial_grad = run()
    model.stack = LayerParallel(
        model.stack.steps,
        levels=config.levels,
        cf=config.cf,
        fwd_iters=config.fwd_iters,
        bwd_iters=config.bwd_iters,
    )
    parallel_out, parallel_grad = run()
    progress()
    # As the Controller measures it: twice the cycles, so each solve records at
    # least two residuals even when the first cycle skips the down-cycle.
    model.stack.set_iterations(2 * config.fwd_iters, 2 * config.bwd_iters)
    run()
    return DepthAccuracy(
        output_rel_diff=_rel(parallel_out, serial_out),
        grad_rel_diff=_rel(parallel_grad, serial_grad),
        forward_factor=convergence_factor(model.stack.stats.forward),
        backward_factor=convergence_factor(model.stack.stats.backward),
        n_params=model.num_params(),
    )


def time_two_processes(config: DepthConfig, *, progress: Callable[[], None]):
    """The exclusive job: :func:`measure_two_process` of the stack, or on CUDA
    :func:`~leantrain.compare.depth_device.time_on_device`."""
    if config.device != "cpu":
        return time_on_device(config.stack_spec(), gpt_blocks, config.device)
    return measure_two_process(config.stack_spec(), gpt_blocks)


def _one_device(timing) -> bool:
    """The timing is one GPU's: no layer-parallel step, messages assumed."""
    return not math.isfinite(timing.parallel)


def jobs(config: DepthConfig) -> list[Job]:
    """The two-process timing (exclusive) and the accuracy check."""
    per_rank = config.projected_layers
    for p in config.ranks:
        if per_rank % p or (per_rank // p) % config.cf ** (config.levels - 1):
            raise ValueError(
                f"projected_layers={per_rank} must split over {p} ranks into "
                f"multiples of cf**(levels-1) = {config.cf ** (config.levels - 1)}"
            )
    return [
        Job(
            key=("depth", "timing"),
            label="depth: 2-process timing",
            fn=time_two_processes,
            args=(config,),
            exclusive=True,
        ),
        Job(
            key=("depth", "accuracy"),
            label="depth: parallel vs serial",
            fn=depth_accuracy,
            args=(config,),
            cost=5.0,
        ),
    ]


def _simulate(config: DepthConfig, n: int, ranks: int, timing, comm: CommModel):
    return simulate(
        n,
        ranks,
        timing.layers,
        levels=config.levels,
        cf=config.cf,
        fwd_iters=config.fwd_iters,
        bwd_iters=config.bwd_iters,
        comm=comm,
        state_bytes=config.stack_spec().state_bytes,
    )


def summarise(config: DepthConfig, results: Mapping) -> dict:
    """Accuracy, measured and simulated two-process steps, and the projections."""
    accuracy = results[("depth", "accuracy")]
    timing = results[("depth", "timing")]
    simulated_two = _simulate(config, config.n_layer, 2, timing, timing.comm)
    comms = [("gpu", GPU_INTERCONNECT)]
    if not _one_device(timing):  # one GPU measures no message
        comms.insert(0, ("measured", timing.comm))
    projected = {
        name: {
            p: _simulate(config, config.projected_layers, p, timing, comm).speedup
            for p in config.ranks
        }
        for name, comm in comms
    }
    return {
        "accuracy": accuracy,
        "timing": timing,
        "simulated_two_serial": simulated_two.serial,
        "simulated_two_step": simulated_two.step,
        "simulated_two_speedup": simulated_two.speedup,
        "projected": projected,
    }


PROJECTIONS = {  # summary["projected"] key -> its label in the table and the plot
    "measured": "messages as measured",
    "gpu": "GPU interconnect (10 us, 25 GB/s)",
}


def table(summary: dict, config: DepthConfig) -> str:
    """Three Markdown tables of the depth axis: accuracy and the simulator's inputs
    (one number a row), the 2-process step measured and simulated (ms, speedup),
    and the projected speedups (one column a rank count)."""
    a, t = summary["accuracy"], summary["timing"]
    timed = ("depth", "timing") in summary.get("under_load", ())

    def marked(label: str) -> str:  # a row from the two-process timing
        return mark_under_load(label, timed)

    one_device = _one_device(t)
    messages = " (assumed: one GPU sends none)" if one_device else ""
    measured = f"measured on one GPU ({t.device})" if one_device else "measured"
    lt = t.layers
    layer_ms = {
        "layer forward (ms)": lt.forward,
        "layer forward with graph (ms)": lt.forward_record,
        "layer VJP (ms)": lt.backward,
        "layer VJP with parameters (ms)": lt.backward_params,
    }
    quantities = markdown_table(
        [
            ["quantity", "value"],
            ["---", "---:"],
            ["output rel. difference, parallel vs serial", f"{a.output_rel_diff:.2e}"],
            ["gradient rel. difference (all parameters)", f"{a.grad_rel_diff:.2e}"],
            ["MGRIT convergence factor, forward", f"{a.forward_factor:.3f}"],
            ["MGRIT convergence factor, adjoint", f"{a.backward_factor:.3f}"],
            *([marked(k), f"{v * 1e3:.3f}"] for k, v in layer_ms.items()),
            [
                marked(f"message latency (us){messages}"),
                f"{t.comm.latency * 1e6:.0f}",
            ],
            [
                marked(f"message bandwidth (MB/s){messages}"),
                f"{t.comm.bandwidth / 1e6:.0f}",
            ],
        ]
    )
    steps = markdown_table(
        [
            [
                f"step of the {config.n_layer}-block stack",
                "serial, 1 process (ms)",
                "layer-parallel, 2 processes (ms)",
                "speedup vs serial (x)",
            ],
            ["---", "---:", "---:", "---:"],
            [
                marked(measured),
                f"{t.serial * 1e3:.1f}",
                fmt(t.parallel * 1e3, ".1f"),
                fmt(t.speedup, ".2f"),
            ],
            [
                marked("simulated from the layer times and messages above"),
                f"{summary['simulated_two_serial'] * 1e3:.1f}",
                f"{summary['simulated_two_step'] * 1e3:.1f}",
                f"{summary['simulated_two_speedup']:.2f}",
            ],
        ]
    )
    header = [f"projected speedup vs serial (x), {config.projected_layers} layers"]
    projections = markdown_table(
        [
            header + [f"{p} ranks" for p in config.ranks],
            ["---"] + ["---:"] * len(config.ranks),
            *(
                [marked(PROJECTIONS[k])] + [fmt(v, ".2f") for v in by_rank.values()]
                for k, by_rank in summary["projected"].items()
            ),
        ]
    )
    return f"{quantities}\n\n{steps}\n\n{projections}"


def verdict(summary: dict, config: DepthConfig) -> str:
    """One sentence, worded from the numbers: what the depth axis means here."""
    if _one_device(summary["timing"]):
        return _one_device_verdict(summary, config)
    measured = summary["timing"].speedup
    if round(measured, 2) == 1:
        pace = "as fast as"
    else:
        pace = "slower than" if measured < 1 else "faster than"
    timed = ("depth", "timing") in summary.get("under_load", ())
    return (
        f"On 2 processes of this {os.cpu_count()}-core CPU layer-parallel is {pace} "
        f"serial ({measured:.2f}x measured{' under load' if timed else ''}, "
        f"{summary['simulated_two_speedup']:.2f}x simulated from the layer times "
        "and message cost measured here); the projection is what that simulator "
        f"predicts for {config.projected_layers} of these layers (cf = {config.cf}) "
        "on more ranks, messages as measured: "
        + _projected_speedups(summary["projected"]["measured"])
    )


def _one_device_verdict(summary: dict, config: DepthConfig) -> str:
    t = summary["timing"]
    return (
        f"On one GPU ({t.device}) the serial step of the {config.n_layer}-block stack "
        f"takes {t.serial * 1e3:.1f} ms; a layer-parallel step needs two devices, so "
        "it is not measured here. The projection is what the simulator predicts from "
        f"the layer times measured on this GPU for {config.projected_layers} of these "
        f"layers (cf = {config.cf}) on more GPUs linked as {PROJECTIONS['gpu']}: "
        + _projected_speedups(summary["projected"]["gpu"])
    )


def _projected_speedups(projected: dict) -> str:
    """The end of a verdict: the speedup at each rank count, then where it wins."""
    faster = [str(p) for p, v in projected.items() if v > 1]
    at = ", ".join(f"{v:.2f}x at {p}" for p, v in projected.items())
    if faster:
        return f"{at} ranks, faster than serial at {', '.join(faster)} ranks."
    return f"{at} ranks, slower than serial at every one of them."


def settings(config: DepthConfig, summary: dict) -> str:
    """One line: the model, the solver and the timing."""
    c = config
    return (
        f"GPT with {c.n_layer} blocks, d_model {c.d_model}, {c.n_head} heads, "
        f"h = 1/{c.n_layer} ({summary['accuracy'].n_params:,} params), batch "
        f"{c.batch} x {c.tokens} bytes, fp32; MGRIT L={c.levels}, cf={c.cf}, "
        f"{c.fwd_iters} forward / {c.bwd_iters} adjoint cycles; timing: the median "
        f"of {c.repeats} rounds" + ("" if c.device == "cpu" else f", on {c.device}")
    )


EXPLANATION = (
    "Differences: ||parallel - serial|| / ||serial|| on one training batch (the "
    "serial reference is the GPT's own residual stack). Convergence factor: the "
    "worst ratio of consecutive MGRIT residuals above the rounding floor, on a step "
    "with twice the cycles (below 1: each cycle shrinks the error). Step times: "
    "forward and backward of the block stack, one thread per process, the serial "
    "step in the same two processes while the other waits; the speedup is serial / "
    "parallel. Simulated and projected steps: the schedule simulator fed with the "
    "layer times and the message cost measured in this run (its serial step = N "
    "layers of forward with graph and VJP with parameters); the simulated row's "
    "speedup is its serial over its layer-parallel step, as in the projections, "
    "and the panel plots the two speedups of the table at 2 ranks."
)


def record(summary: dict) -> dict:
    """The axis' entries of compare.json."""
    t = summary["timing"]
    return {
        "accuracy": asdict(summary["accuracy"]),
        "serial_step_s": t.serial,
        "parallel_step_s": t.parallel,
        "measured_speedup": t.speedup,
        "layer_times_s": asdict(t.layers),
        "latency_s": t.comm.latency,
        "bandwidth_bytes_per_s": t.comm.bandwidth,
        "simulated_two_serial_s": summary["simulated_two_serial"],
        "simulated_two_step_s": summary["simulated_two_step"],
        "simulated_two_speedup": summary["simulated_two_speedup"],
        "projected_speedup": {
            name: {str(p): s for p, s in by_rank.items()}
            for name, by_rank in summary["projected"].items()
        },
    }


def plot(ax, summary: dict, config: DepthConfig) -> None:
    """Speedup over serial against ranks: the projections and the 2-process step,
    measured and simulated (the numbers of :func:`table`, labelled with them)."""
    for name, by_rank in summary["projected"].items():
        label = PROJECTIONS[name]
        ax.plot(
            list(by_rank), list(by_rank.values()), "o-", label=f"projected, {label}"
        )
    t = summary["timing"]
    timed = ("depth", "timing") in summary.get("under_load", ())
    points = (
        ("measured, 2 processes" + (" (under load)" if timed else ""), t.speedup),
        ("simulated, 2 processes", summary["simulated_two_speedup"]),
    )
    for (label, value), style in zip(points, ("k*", "kx"), strict=True):
        if not math.isfinite(value):  # one GPU: no layer-parallel step measured
            continue
        ax.plot([2], [value], style, markersize=10, label=label)
        ax.annotate(
            f"{value:.2f}x", (2, value), xytext=(6, 0), textcoords="offset points"
        )
    ax.axhline(1.0, color="0.5", linestyle=":")
    ax.set_xscale("log", base=2)
    ticks = [2, *config.ranks]
    ax.set_xticks(ticks, [str(p) for p in ticks])
    ax.set(
        xlabel="ranks",
        ylabel="speedup vs serial (x)",
        title=f"depth: {config.projected_layers}-layer projection",
    )
    ax.legend(fontsize=7)


def describe(config: DepthConfig) -> str:
    """What the axis runs, for ``leantrain compare depth --help``."""
    c = config
    return (
        f"The serial stack against LayerParallel: a GPT of {c.n_layer} blocks "
        f"(d_model {c.d_model}, {c.n_head} heads, context {c.tokens}, batch "
        f"{c.batch}, fp32) on the embedded text '{c.data}', run with its own "
        f"residual stack and with MGRIT (L={c.levels}, cf={c.cf}, {c.fwd_iters} "
        f"forward / {c.bwd_iters} adjoint cycles): the output and gradient "
        "differences, the convergence factors, the step times on two gloo "
        f"processes (median of {c.repeats} rounds; this timing runs alone, first) "
        f"and the simulator's projection to {', '.join(map(str, c.ranks))} ranks "
        f"for {c.projected_layers} layers."
    )
