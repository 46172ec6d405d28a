"""Gefen against AdamW on a longer run: where along training does a gap open?

Short runs (``leantrain compare``: 200 steps of a d = 128 GPT) hide a gap that grows
with training. This benchmark trains a GPT of d = 256 on the embedded stdlib text for
2,000 steps with a linear warm-up and a cosine decay (to 10 % of lr), once per
setting and seed, every setting from the same initial weights and the same batches
as AdamW of that seed. Each run evaluates the validation loss (a fixed set of
windows) at every 5 % of training and the training loss (mean over the steps since
the previous evaluation).

Every finished run is one JSON line of the results file, so a stopped campaign
continues where it stopped (a run is identified by setting, seed and the training
configuration); the table and the PNG are computed from that file alone. The table
gives, per setting, the validation loss as a ratio to AdamW of the same seed at 25,
50, 75 and 100 % of training (geometric mean over seeds, 95 % t-interval of the log
ratios, ``leantrain.compare.ratio_interval``), the training-loss ratio at the
end, and the optimizer's state in bytes per parameter.

Settings: ``adamw`` (``torch.optim.AdamW``, weight decay 1e-2);
``benchmarks/gefen_quality.py``'s ``BITS:PARTITION[...]`` specs (``8:auto`` is
Gefen's default, ``4:auto`` its 4-bit default, ``fp32:auto`` fp32 momentum with the
default second moment); such a spec with ``+element=GROUP[/GROUP]`` gives those
parameter groups AdamW's per-element second moment (a param group with
``partition="element"``), GROUP in :data:`GROUPS`; ``peer:NAME`` for a
``leantrain.compare.OPTIMIZERS`` optimizer (``peer:gefen-1.2.3``,
``peer:adam-mini-1.1.1``, ``peer:torchao-adamw8bit``; installed as docs/peers.md
says).

Run: ``nice -n 10 python benchmarks/gefen_long.py --seeds 0-2 --jobs 2`` (two
processes of one thread; d = 256, one block, context 32, batch 8: 0.04 s of CPU per
step, about 90 s per run on an idle core). ``--table`` prints the table of the
results file without training; ``--quick`` is a tiny configuration that runs in
seconds. Results:
docs/results.md, "Quality, long runs", and
docs/notebook/2026-12-03-gefen-long-run.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

# Sibling benchmarks: importable as run (python puts benchmarks/ first on the path).
from gefen_quality import make_optimizer
from gefen_seeds import parse_seeds

from leantrain.compare import OPTIMIZERS, ratio_interval, state_nbytes, warmup_cosine
from leantrain.compare.memory import seeded_gpt
from leantrain.data import TokenBatches, fixed_token_batches, load_stdlib_text
from leantrain.models.gpt import GPT, GPTConfig, lm_loss
from leantrain.optim import Gefen

DEFAULT_SETTINGS = "adamw,8:auto,4:auto"
POINTS = (0.25, 0.5, 0.75, 1.0)  # fractions of training the table reports
N_EVALS = 20  # validation every 5 % of training
WEIGHT_DECAY = 1e-2  # gefen_quality's AdamW and Gefen's default
# Parameter groups of the GPT, by name, for the per-element second-moment swaps.
GROUPS = ("embeddings", "qkv", "attn_out", "mlp", "head", "norms", "biases")


@dataclass(frozen=True)
class Config:
    """The training run; part of a result's identity in the results file."""

    d_model: int = 256
    n_layer: int = 1
    n_head: int = 8
    block_size: int = 32
    batch_size: int = 8
    steps: int = 2000
    lr: float = 1e-3
    warmup: int = 100
    val_batches: int = 16


QUICK = Config(
    d_model=32, n_layer=1, n_head=4, block_size=16, batch_size=4, steps=40, warmup=4,
    val_batches=2,
)  # fmt: skip


def group_of(name: str, param: torch.Tensor) -> str:
    """Which of :data:`GROUPS` a GPT parameter belongs to, from its name."""
    if name.startswith(("wte.", "wpe.")):
        return "embeddings"
    if name.startswith("lm_head."):
        return "head"
    if ".ln_" in name or name.startswith("ln_f."):
        return "norms"
    if param.ndim == 1:
        return "biases"
    if ".q_proj." in name or ".kv_proj." in name:
        return "qkv"
    if ".out_proj." in name:
        return "attn_out"
    if ".mlp." in name:
        return "mlp"
    raise ValueError(f"parameter {name!r} is in none of the groups {GROUPS}")


def build_optimizer(setting: str, model: torch.nn.Module, lr: float):
    """The optimizer a setting names (see the module docstring)."""
    if setting.startswith("peer:"):
        name = setting.removeprefix("peer:")
        if name not in OPTIMIZERS:
            raise ValueError(f"unknown peer {name!r}; known: {sorted(OPTIMIZERS)}")
        return OPTIMIZERS[name].factory(model, lr, WEIGHT_DECAY)
    base, _, swap = setting.partition("+element=")
    opt = make_optimizer(base, model, lr)
    if not swap:
        return opt
    if not isinstance(opt, Gefen):
        raise ValueError(f"{setting!r}: +element= needs a Gefen spec, not {base!r}")
    swapped = set(swap.split("/"))
    if not swapped <= set(GROUPS):
        raise ValueError(f"{setting!r}: unknown group(s) {swapped - set(GROUPS)}")
    named = list(model.named_parameters())
    own = [p for n, p in named if group_of(n, p) in swapped]
    rest = [p for n, p in named if group_of(n, p) not in swapped]
    groups = [{"params": own, "partition": "element"}, {"params": rest}]
    return Gefen([g for g in groups if g["params"]], **opt.defaults)


def eval_steps(steps: int) -> list[int]:
    """Steps after which the validation loss is measured (every 5 %)."""
    return sorted({max(1, round(steps * k / N_EVALS)) for k in range(1, N_EVALS + 1)})


def train(setting: str, seed: int, config: Config) -> dict:
    """One run: the result record (validation and training loss at every eval)."""
    corpus = load_stdlib_text()
    model = seeded_gpt(config, seed)
    opt = build_optimizer(setting, model, config.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, warmup_cosine(config.warmup, config.steps)
    )
    val = fixed_token_batches(
        corpus.val, config.val_batches, block_size=config.block_size,
        batch_size=16, seed=1234,
    )  # fmt: skip
    batches = iter(
        TokenBatches(
            corpus.train,
            block_size=config.block_size,
            batch_size=config.batch_size,
            seed=seed,
        )
    )
    evals, window, start = [], [], time.perf_counter()
    points = set(eval_steps(config.steps))
    for step in range(1, config.steps + 1):
        x, y = next(batches)
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        schedule.step()
        window.append(loss.item())
        if step in points:
            with torch.no_grad():
                val_loss = sum(lm_loss(model(a), b).item() for a, b in val) / len(val)
            evals.append(
                {"step": step, "val": val_loss, "train": sum(window) / len(window)}
            )
            window = []
    return {
        "setting": setting,
        "seed": seed,
        "config": asdict(config),
        "bytes_per_param": state_nbytes(opt)
        / sum(p.numel() for p in model.parameters()),
        "seconds": time.perf_counter() - start,
        "evals": evals,
    }


def load_results(path: Path) -> list[dict]:
    """The records of a results file (none if it does not exist)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def append_result(path: Path, record: dict) -> None:
    """One JSON line, appended in a single write (two workers share the file)."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _cli_config(config: Config) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in asdict(config).items()]


def run_campaign(
    jobs_todo: list[tuple[str, int]], config: Config, out: Path, jobs: int
):
    """Trains every (setting, seed) missing from ``out``; ``jobs`` at a time, each
    in its own one-thread process (in this process when ``jobs`` is 1)."""
    done = {
        (r["setting"], r["seed"])
        for r in load_results(out)
        if r["config"] == asdict(config)
    }
    todo = [job for job in jobs_todo if job not in done]
    print(f"{len(todo)} runs to do, {len(jobs_todo) - len(todo)} in {out}", flush=True)
    if jobs == 1:
        for setting, seed in todo:
            append_result(out, train(setting, seed, config))
        return
    env = dict(os.environ, OMP_NUM_THREADS="1")
    running: list[tuple[subprocess.Popen, str, int]] = []
    while todo or running:
        while todo and len(running) < jobs:
            setting, seed = todo.pop(0)
            cmd = [
                sys.executable,
                __file__,
                "--one",
                setting,
                str(seed),
                "--out",
                str(out),
            ]
            running.append(
                (subprocess.Popen(cmd + _cli_config(config), env=env), setting, seed)
            )
        time.sleep(2.0)  # runs take minutes; polling costs nothing
        for proc, setting, seed in list(running):
            if proc.poll() is not None:
                running.remove((proc, setting, seed))
                status = (
                    "done" if proc.returncode == 0 else f"FAILED ({proc.returncode})"
                )
                print(f"{setting} seed {seed}: {status}", flush=True)


def ratios_at(records: list[dict], config: Config) -> dict[str, dict]:
    """Per setting: its seeds, bytes/param and, at every eval step, the list of
    validation-loss ratios to AdamW of the same seed (and training-loss ratios);
    seeds without an AdamW run of the same configuration are left out."""
    mine = [r for r in records if r["config"] == asdict(config)]
    base = {r["seed"]: r for r in mine if r["setting"] == "adamw"}
    table: dict[str, dict] = {}
    for r in mine:
        if r["seed"] not in base:
            continue
        row = table.setdefault(
            r["setting"],
            {"seeds": [], "bytes": r["bytes_per_param"], "val": {}, "train": {}},
        )
        row["seeds"].append(r["seed"])
        ref = {e["step"]: e for e in base[r["seed"]]["evals"]}
        for e in r["evals"]:
            row["val"].setdefault(e["step"], []).append(
                e["val"] / ref[e["step"]]["val"]
            )
            row["train"].setdefault(e["step"], []).append(
                e["train"] / ref[e["step"]]["train"]
            )
    return table


def format_table(records: list[dict], config: Config, settings: list[str]) -> str:
    """The table: per setting, the ratio at each of :data:`POINTS` and the end."""
    table = ratios_at(records, config)
    steps = [round(config.steps * p) for p in POINTS]
    head = [f"{p:.0%} ({s})" for p, s in zip(POINTS, steps, strict=True)]
    lines = [
        f"GPT d={config.d_model}, n_layer {config.n_layer}, "
        f"context {config.block_size}, "
        f"batch {config.batch_size}, {config.steps} steps, lr {config.lr} "
        f"(warm-up {config.warmup}, cosine to 10 %); validation loss / AdamW's "
        "(same seed): geometric mean [95 % interval]",
        "| setting | seeds | B/param | "
        + " | ".join(head)
        + " | train loss, end | end, per seed |",
        "|---" * (len(head) + 5) + "|",
    ]
    order = [s for s in settings if s in table] + sorted(set(table) - set(settings))
    for setting in order:
        row = table[setting]
        cells = [_cell(row["val"][s]) for s in steps] + [_cell(row["train"][steps[-1]])]
        # Each seed's end ratio, in the order of the seeds column.
        by_seed = sorted(zip(row["seeds"], row["val"][steps[-1]], strict=True))
        cells.append(" ".join(f"{r:.3f}" for _, r in by_seed))
        seeds = ",".join(str(s) for s, _ in by_seed)
        lines.append(
            f"| {setting} | {seeds} | {row['bytes']:.3f} | " + " | ".join(cells) + " |"
        )
    adamw = [
        r for r in records if r["setting"] == "adamw" and r["config"] == asdict(config)
    ]
    if adamw:
        finals = [r["evals"][-1]["val"] for r in sorted(adamw, key=lambda r: r["seed"])]
        lines.append("")  # a paragraph of its own, not a row of the table
        lines.append(
            f"AdamW's final validation loss: {', '.join(f'{v:.4f}' for v in finals)}"
        )
    return "\n".join(lines)


def _cell(ratios: list[float]) -> str:
    mean, low, high = ratio_interval(ratios)
    if math.isnan(low):
        return f"{mean:.3f}"
    return f"{mean:.3f} [{low:.3f}, {high:.3f}]"


def write_plot(
    records: list[dict], config: Config, settings: list[str], path: Path
) -> None:
    """The geometric-mean ratio against steps per setting, its interval shaded."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    table = ratios_at(records, config)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for setting in [s for s in settings if s in table and s != "adamw"]:
        row = table[setting]
        steps = sorted(row["val"])
        stats = [ratio_interval(row["val"][s]) for s in steps]
        (line,) = ax.plot(steps, [m for m, _, _ in stats], label=setting)
        if all(math.isfinite(lo) for _, lo, _ in stats):
            lows, highs = [lo for _, lo, _ in stats], [hi for _, _, hi in stats]
            ax.fill_between(steps, lows, highs, color=line.get_color(), alpha=0.15)
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set(
        xlabel="step",
        ylabel="validation loss / AdamW's (same seed)",
        title=f"GPT d={config.d_model}: geometric mean over seeds, 95 % interval",
    )
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default=DEFAULT_SETTINGS)
    parser.add_argument("--seeds", default="0-2")
    parser.add_argument("--jobs", type=int, default=2, help="processes at a time")
    parser.add_argument("--out", type=Path, default=Path("gefen_long.jsonl"))
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG here")
    parser.add_argument("--quick", action="store_true", help="a tiny configuration")
    parser.add_argument("--table", action="store_true", help="print the table only")
    parser.add_argument(
        "--one", nargs=2, metavar=("SETTING", "SEED"), help=argparse.SUPPRESS
    )
    for key, value in asdict(Config()).items():
        parser.add_argument(
            f"--{key.replace('_', '-')}", type=type(value), default=None
        )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    base = QUICK if args.quick else Config()
    given = {k: getattr(args, k) for k in asdict(base) if getattr(args, k) is not None}
    config = Config(**{**asdict(base), **given})
    if args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    torch.set_num_threads(1)  # one thread per run: runs go side by side instead
    if args.one:
        setting, seed = args.one
        append_result(args.out, train(setting, int(seed), config))
        return
    settings = [s for s in args.settings.split(",") if s]
    for setting in [] if args.table else settings:  # fail now, not an hour in
        build_optimizer(setting, GPT(GPTConfig(n_layer=1, d_model=32, n_head=4)), 1e-3)
    if "adamw" not in settings:
        settings.insert(0, "adamw")
    if not args.table:
        todo = [(s, seed) for seed in parse_seeds(args.seeds) for s in settings]
        run_campaign(todo, config, args.out, args.jobs)
    records = load_results(args.out)
    print(format_table(records, config, settings))
    if args.plot is not None:
        write_plot(records, config, settings, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
