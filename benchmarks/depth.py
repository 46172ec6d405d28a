"""Depth: a deep, narrow GPT trained serially, pipeline-parallel and layer-parallel,
measured side by side on 2 processes and projected to 2..1024 ranks.

Part 1 (measured). For each depth N (16, 32, 64), the same GPT (d_model 128, 4 heads,
batch 8, 64 tokens, fp32, h = 1/N, AdamW lr 1e-3) starts from the same weights and
trains ``--steps`` steps on the same stdlib-text batches:

* serial: one process, one thread, plain autograd (rank 1 idles in a barrier);
* pipeline: ``torch.distributed.pipelining`` on 2 gloo processes, GPipe with 1, 2, 4,
  8 micro-batches and 1F1B with 2, 4, 8 (1F1B needs M >= stages);
* layer-parallel: ``LayerParallel`` parallelized over the same 2 processes, for
  each ``--lp`` setting ``levels,cf,fwd_iters,bwd_iters`` (``fwd_iters`` ``serial``:
  the exact serial forward with the MGRIT adjoint, ``forward_solver="serial"``).

Each run reports its median step time (steps after the first) as a ratio to serial,
the loss of the trained weights on a held-out batch (evaluated exactly, serially:
pipelines reproduce serial training, MGRIT does not), and each rank's peak resident
memory during the run (VmHWM, reset before the run). The layer times of every
micro-batch size and the message cost are measured in the same processes, while both
are busy, and fed to the two simulators; ``pred/meas`` is the simulated 2-process
step over the measured one.

Part 2 (projected). From those layer times and the measured gloo message cost: step
time of MGRIT (the best of the ``--lp`` settings and the ``--project-lp`` ones, which
are timed by the simulator only) and of the best pipeline (schedule and micro-batch
count up to the batch, layer time of each micro-batch size as measured) for
P = 2..1024 ranks and N = 16..1024 layers; the crossover where MGRIT wins, and a
plot.

Run: ``python benchmarks/depth.py`` (``--quick``: tiny sizes, a smoke test);
``--plot PATH`` for the PNG (default ``depth_projection.png``); ``--save PATH`` keeps
the measurements as JSON (rewritten after each depth, so a run cut short keeps the
depths it finished) and ``--load PATH`` reprints the tables and the projection from
such a file without measuring.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from leantrain.compare.depth import deep_gpt
from leantrain.compare.depth_plot import plot_projection
from leantrain.compare.measure import proc_status_kib, reset_peak_rss
from leantrain.compare.pipeline_baseline import (
    GPTPipeline,
    check_pipeline_settings,
)
from leantrain.data import TokenBatches, load_stdlib_text
from leantrain.layer_parallel import (
    LayerParallel,
    ParallelDims,
    parallelize,
)
from leantrain.layer_parallel.costs.launch import run_on_gloo
from leantrain.layer_parallel.costs.projection import (
    MGRITSetting,
    project,
    projection_table,
)
from leantrain.layer_parallel.costs.simulate import (
    CommModel,
    LayerTimes,
    OutsideTimes,
)
from leantrain.layer_parallel.costs.simulate_pipeline import simulate_pipeline
from leantrain.layer_parallel.costs.timing import (
    LayerSampler,
    OutsideSampler,
    measure_comm,
)
from leantrain.models import GPT, lm_loss

RANKS = 2
PROJECT_DEPTHS = [16, 32, 64, 128, 256, 512, 1024]
PROJECT_RANKS = [2**k for k in range(1, 11)]


@dataclass(frozen=True)
class Run:
    """One training configuration of part 1."""

    kind: str  # "serial", "gpipe", "1f1b", "lp"
    micro_batches: int = 1
    lp: MGRITSetting | None = None

    @property
    def label(self) -> str:
        if self.kind == "serial":
            return "serial (1 process)"
        if self.kind == "lp":
            return f"layer-parallel {self.lp.label}"
        return f"{'GPipe' if self.kind == 'gpipe' else '1F1B'} M={self.micro_batches}"


def parse_lp(spec: str) -> MGRITSetting:
    """``"levels,cf,fwd_iters,bwd_iters"``; ``fwd_iters`` may be ``serial``."""
    return MGRITSetting.parse(spec)


def check_settings(args: argparse.Namespace) -> list[Run]:
    """Every run of part 1, after refusing settings that cannot run.

    Raises:
        ValueError: naming the depth, micro-batch count or ``--lp`` setting.
    """
    settings = [parse_lp(s) for s in args.lp]
    runs = [Run("serial")]
    for m in args.micro_batches:
        for depth in args.depths:
            check_pipeline_settings(depth, RANKS, args.batch, m, "gpipe")
        runs.append(Run("gpipe", m))
    runs += [Run("1f1b", m) for m in args.micro_batches if m >= RANKS]
    for s in settings:
        for depth in args.depths:
            if not s.valid(depth, RANKS):
                raise ValueError(
                    f"depth {depth} on {RANKS} ranks: {depth // RANKS} layers per "
                    f"rank is not a multiple of cf**(levels-1) = "
                    f"{s.cf ** (s.levels - 1)} for --lp {s.label}"
                )
        runs.append(Run("lp", lp=s))
    if args.steps < 2:
        raise ValueError(f"--steps must be >= 2 (one warm-up), got {args.steps}")
    return runs


def _status_mb(field: str) -> float:
    return proc_status_kib(field) / 1024


def _model(args, depth: int) -> GPT:
    return deep_gpt(depth, args.d, args.heads, args.tokens)


def _train(run: Run, model: GPT, batches, args, sample=None) -> list[float]:
    """Train ``model`` in place; returns per-step seconds (the same on all ranks).

    ``sample()`` runs after every step on the ranks the run keeps busy (rank 0
    alone for serial), so its samples see the load the steps saw."""
    rank = dist.get_rank()
    if run.kind == "serial":
        params, step = list(model.parameters()), None
    elif run.kind == "lp":
        model.stack = LayerParallel(model.stack, **run.lp.options())
        parallelize(model, ParallelDims(lp=RANKS).build_mesh())
        # foreign layers keep grad None, so AdamW leaves them alone
        params, step = list(model.parameters()), None
    else:
        pipe = GPTPipeline(model, run.kind, run.micro_batches, args.batch, args.tokens)
        params = pipe.parameters()
        step = pipe.step
    opt = torch.optim.AdamW(params, lr=args.lr)
    times = []
    for x, y in batches:
        dist.barrier()
        t0 = time.perf_counter()
        if run.kind != "serial" or rank == 0:
            opt.zero_grad(set_to_none=True)
            if run.kind in ("serial", "lp"):
                lm_loss(model(x), y).backward()
            else:
                step(x, y)
            opt.step()
        times.append(time.perf_counter() - t0)
        if sample is not None and (run.kind != "serial" or rank == 0):
            sample()
    t = torch.tensor(times)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _gather_weights(run: Run, model: GPT) -> dict[str, torch.Tensor]:
    """The whole trained model's state on every rank (owners broadcast)."""
    if run.kind == "serial":
        src = {n: 0 for n in model.state_dict()}
    elif run.kind == "lp":
        model.stack.synchronize_layers()  # embed / head are equal on every rank
        return {k: v.clone() for k, v in model.state_dict().items()}
    else:
        per = model.config.n_layer // RANKS
        src = {}
        for name in model.state_dict():
            m = re.match(r"stack\.steps\.(\d+)\.", name)
            if m:
                src[name] = int(m.group(1)) // per
            else:  # embeddings on the first stage, the head on the last
                src[name] = 0 if name.startswith(("wte", "wpe")) else RANKS - 1
    state = model.state_dict()
    for name, tensor in state.items():
        dist.broadcast(tensor, src[name])
    return {k: v.clone() for k, v in state.items()}


def _run_samplers(args, block, x, ends_model, batch, sizes) -> list:
    """Fresh layer and outside-the-stack samplers, one pair per micro-batch size."""
    out = []
    for m in sizes:
        mb = args.batch // m
        out.append(
            (
                m,
                LayerSampler(block, x[:mb], 1 / 64),
                OutsideSampler(
                    ends_model,
                    (batch[0][:mb], batch[1][:mb]),
                    lr=args.lr,
                    loss_fn=lm_loss,
                ),
            )
        )
    return out


def _measure_run(
    run: Run, args, depth: int, batches, eval_batch, samplers=None
) -> dict:
    # Freed heap back to the system, then the peak reset: VmHWM measures this run,
    # not memory that earlier runs freed but the heap kept.
    gc.collect()
    reset_peak_rss()
    base = _status_mb("VmRSS")
    model = _model(args, depth)

    def sample() -> None:
        for _, layers, ends in samplers:
            layers()
            ends()

    times = _train(run, model, batches, args, sample if samplers else None)
    peak = torch.tensor([_status_mb("VmHWM"), _status_mb("VmHWM") - base])
    peaks = [torch.zeros(2) for _ in range(RANKS)]
    dist.all_gather(peaks, peak)
    state = _gather_weights(run, model)
    ref = _model(args, depth)
    ref.load_state_dict(state)
    with torch.no_grad():
        loss = float(lm_loss(ref(eval_batch[0]), eval_batch[1]))
    del model, ref, state
    out = {
        "step": statistics.median(times[1:]),
        "loss": loss,
        "peak": [p.tolist() for p in peaks],  # per rank: (peak, rise over start)
    }
    if samplers and samplers[0][1].samples:  # the first sample is a warm-up
        for _, layers, ends in samplers:
            layers.samples, ends.samples = layers.samples[1:], ends.samples[1:]
        out["times"] = {m: list(_fields(layers.times())) for m, layers, _ in samplers}
        out["outside"] = {m: list(_fields(ends.times())) for m, _, ends in samplers}
    return out


def _fields(t) -> tuple[float, ...]:
    if isinstance(t, LayerTimes):
        return (t.forward, t.backward, t.forward_record, t.backward_params)
    return (
        t.embed,
        t.head_forward,
        t.head_backward,
        t.optimizer_layer,
        t.optimizer_ends,
    )


def _activation_bytes(block: torch.nn.Module, x: torch.Tensor, dt: float) -> float:
    """Bytes one layer saves for its backward (distinct storages)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    xi = x.detach().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(xi, dt)
    seen.pop(xi.untyped_storage().data_ptr(), None)  # the input is the state
    return float(sum(seen.values()))


def _worker(rank: int, args, runs: list[Run]) -> dict | None:
    """One rank of the measurement: every run at every depth, the layer and
    outside-the-stack samples between them; rank 0 returns the results."""
    text = load_stdlib_text()
    stream = TokenBatches(
        text.train, block_size=args.tokens, batch_size=args.batch, seed=0
    )
    batches = [b for _, b in zip(range(args.steps), stream, strict=False)]
    held = TokenBatches(text.val, block_size=args.tokens, batch_size=32, seed=1)
    eval_batch = next(iter(held))
    results: dict = {"comm": measure_comm(rank), "depths": {}}
    # Layer times of each micro-batch size, sampled on both processes at once
    # (busy, as in the parallel runs) between the runs, so that they see the
    # same machine load as the runs; one warm-up sample each.
    block = copy.deepcopy(_model(args, 4).stack.steps[0])
    x = torch.randn(args.batch, args.tokens, args.d)
    samplers = {
        m: LayerSampler(block, x[: args.batch // m], 1 / 64)
        for m in sorted({1, *args.micro_batches})
    }
    # The work outside the stack (embedding, head, loss, AdamW) per micro-batch
    # size, sampled the same way; AdamW on a sampling copy of 8 layers.
    ends_model = _model(args, 8)
    ends = {
        m: OutsideSampler(
            ends_model,
            (batches[0][0][: args.batch // m], batches[0][1][: args.batch // m]),
            lr=args.lr,
            loss_fn=lm_loss,
        )
        for m in samplers
    }
    for sampler in [*samplers.values(), *ends.values()]:
        sampler()
        sampler.samples.clear()
    per_round = max(1, -(-args.layer_reps // (len(args.depths) * len(runs))))
    results["act"] = _activation_bytes(block, x, 1 / 64)
    results["state_bytes"] = float(x.numel() * x.element_size())
    for depth in args.depths:
        rows = {}
        for run in runs:
            per_run = _run_samplers(args, block, x, ends_model, batches[0], samplers)
            rows[run.label] = _measure_run(
                run, args, depth, batches, eval_batch, per_run
            )
            dist.barrier()
            for sampler in [*samplers.values(), *ends.values()]:
                for _ in range(per_round):
                    sampler()
        results["depths"][depth] = rows
        results["times"] = {m: smp.times() for m, smp in samplers.items()}
        results["outside"] = {m: smp.times() for m, smp in ends.items()}
        if rank == 0:  # each depth's table as soon as it is measured
            print_measured(args, runs, results, only=depth)
            if args.save:
                save(args.save, args, results)
    return results if rank == 0 else None


def measure(args, runs: list[Run]) -> dict:
    return run_on_gloo(_worker, RANKS, args, runs, timeout=7200)


_SAVED_ARGS = ("d", "heads", "batch", "tokens", "steps", "lr", "micro_batches", "lp")


def save(path: str, args, res: dict) -> None:
    """Write the measurements (so far) as JSON; ``--load`` reprints and reprojects."""
    out = {
        "args": {k: getattr(args, k) for k in _SAVED_ARGS},
        "load_average": os.getloadavg()[0],
        "comm": [res["comm"].latency, res["comm"].bandwidth],
        "state_bytes": res["state_bytes"],
        "act": res["act"],
        "times": {
            str(m): [t.forward, t.backward, t.forward_record, t.backward_params]
            for m, t in res["times"].items()
        },
        "outside": {
            str(m): list(dataclasses.astuple(t)) for m, t in res["outside"].items()
        },
        "depths": {str(n): rows for n, rows in res["depths"].items()},
    }
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


def load(path: str, args) -> dict:
    """The measurements saved by :func:`save`; sets the run's settings on ``args``."""
    with open(path) as f:
        data = json.load(f)
    for k, v in data["args"].items():
        setattr(args, k, v)
    args.depths = [int(n) for n in data["depths"]]
    args.load_average = data["load_average"]
    return {
        "comm": CommModel(*data["comm"]),
        "state_bytes": data["state_bytes"],
        "act": data["act"],
        "times": {int(m): LayerTimes(*t) for m, t in data["times"].items()},
        "outside": {
            int(m): OutsideTimes(*t) for m, t in data.get("outside", {}).items()
        }
        or None,
        "depths": {int(n): rows for n, rows in data["depths"].items()},
    }


def _predict(run: Run, depth: int, res: dict) -> tuple[float, list[float]]:
    """Simulated step seconds, and the activation bytes each rank holds at its peak
    (a layer's saved tensors times the layers and micro-batches in flight)."""
    times, comm, sb, act = (res[k] for k in ("times", "comm", "state_bytes", "act"))
    outside = res.get("outside") or {}
    row = res["depths"][depth][run.label]
    if "times" in row:  # sampled between this run's own steps
        times = {int(m): LayerTimes(*t) for m, t in row["times"].items()}
        outside = {int(m): OutsideTimes(*t) for m, t in row["outside"].items()}
    full = times[1]
    if run.kind == "serial":
        ends = outside[1].step(depth) if outside else 0.0
        return depth * full.serial_step + ends, [depth * act, 0.0]
    if run.kind == "lp":  # the final sweep keeps the graphs of the rank's layers
        per_rank = depth // RANKS * act
        step = run.lp.step(depth, RANKS, full, comm, sb, outside.get(1))
        return step, [per_rank] * RANKS
    m = run.micro_batches
    r = simulate_pipeline(
        depth,
        RANKS,
        m,
        times[m],
        schedule=run.kind,
        comm=comm,
        state_bytes=sb / m,
        serial_times=full,
        layer_activation_bytes=act / m,
        outside=outside.get(m),
        serial_outside=outside.get(1),
    )
    return r.step, list(r.activation_bytes)


def print_measured(args, runs: list[Run], res: dict, only: int | None = None) -> None:
    """The part-1 tables (of depth ``only``, with the layer times sampled so far)."""
    comm = res["comm"]
    so_far = " so far" if only else ""
    print(
        f"\n## Measured{so_far}: GPT d={args.d}, {args.heads} heads, batch "
        f"{args.batch}, {args.tokens} tokens, fp32, {args.steps} AdamW steps, "
        f"2 gloo processes x 1 thread; load average "
        f"{getattr(args, 'load_average', os.getloadavg()[0]):.1f}"
    )
    print(
        f"message {comm.latency * 1e6:.0f} us + {comm.bandwidth / 1e6:.0f} MB/s; layer"
        " ms (fwd / fwd+graph / vjp / vjp+params) per micro-batch count: "
        + "; ".join(f"M={m}: {_ms(t)}" for m, t in res["times"].items())
        + f"; a layer saves {res['act'] / 2**20:.1f} MB for its backward (batch)"
    )
    if res.get("outside"):
        print(
            "outside the stack ms (embed / head fwd / head bwd / AdamW per layer / "
            "AdamW embed+head) per micro-batch count: "
            + "; ".join(
                f"M={m}: "
                + " / ".join(f"{v * 1e3:.2f}" for v in dataclasses.astuple(t))
                for m, t in res["outside"].items()
            )
        )
    sys.stdout.flush()
    for depth, rows in res["depths"].items():
        if only is not None and depth != only:
            continue
        serial = rows[runs[0].label]["step"]
        print(f"\n### N = {depth}\n")
        print(
            "| run | step s | vs serial (time ratio) | predicted s | pred/meas "
            "| held-out loss | peak MB (rise) rank 0 / 1 | model activations MB |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for run in runs:
            r = rows[run.label]
            pred, act = _predict(run, depth, res)
            peak = " / ".join(f"{p:.0f} ({d:.0f})" for p, d in r["peak"])
            act_mb = " / ".join(f"{a / 2**20:.0f}" for a in act)
            print(
                f"| {run.label} | {r['step']:.3f} | {r['step'] / serial:.2f} | "
                f"{pred:.3f} | {pred / r['step']:.2f} | {r['loss']:.4f} | {peak} | "
                f"{act_mb} |"
            )
    sys.stdout.flush()


def _ms(t: LayerTimes) -> str:
    parts = (t.forward, t.forward_record, t.backward, t.backward_params)
    return " / ".join(f"{v * 1e3:.1f}" for v in parts)


def print_projection(args, settings: list[MGRITSetting], res: dict) -> list:
    # CPU layer steps dwarf any message here; a GPU projection needs GPU layer times
    cells = project(
        PROJECT_DEPTHS,
        PROJECT_RANKS,
        res["times"],
        settings,
        res["comm"],
        res["state_bytes"],
        res.get("outside"),
    )
    print(
        "\n## Projected, gloo messages as measured: best pipeline step / MGRIT step "
        "(> 1: layer-parallel faster, **bold**; -: a layout cannot run)\n"
    )
    print(projection_table(cells))
    return cells


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument(
        "--lp",
        nargs="+",
        default=["2,4,1,1", "2,4,2,1"],
        help="MGRIT settings levels,cf,fwd_iters,bwd_iters (fwd_iters 'serial': "
        "exact forward, MGRIT adjoint)",
    )
    parser.add_argument(
        "--project-lp",
        nargs="*",
        default=["3,4,1,1", "4,4,1,1"],
        help="more MGRIT settings for the projection only (not trained here)",
    )
    parser.add_argument(
        "--layer-reps",
        type=int,
        default=9,
        help="layer-time samples per micro-batch size, at least (spread over the runs)",
    )
    parser.add_argument("--plot", default="depth_projection.png")
    parser.add_argument(
        "--save",
        default=None,
        help="write the measurements as JSON to this path, after each depth",
    )
    parser.add_argument(
        "--load",
        default=None,
        help="reprint and reproject a --save file instead of measuring",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.depths, args.d, args.heads, args.tokens = [8, 16], 32, 2, 16
        args.steps, args.layer_reps = 3, 3
    if not any(",serial," in s for s in args.lp):
        args.lp.append("2,4,serial,1")
    runs = check_settings(args)
    for spec in args.project_lp:
        parse_lp(spec)  # refuse a malformed one before the long measurement
    start = time.perf_counter()
    if args.load:
        res = load(args.load, args)
        runs = [
            r for r in check_settings(args) if r.label in res["depths"][args.depths[0]]
        ]
    else:
        res = measure(args, runs)
    print_measured(args, runs, res)
    settings = [r.lp for r in runs if r.kind == "lp"]
    settings += [parse_lp(spec) for spec in args.project_lp]
    plot_projection(print_projection(args, settings, res), args.plot, "gloo")
    print(f"\nplot: {args.plot}")
    print(f"\n(total {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
