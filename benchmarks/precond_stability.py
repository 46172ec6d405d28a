"""Do the registry's preconditioners train at the learning rates people start with?

SOAP is in the list with the rest, around the same optimizers, although its
direction already holds Adam's momentum and scale (``PreconditionedOptimizer`` warns
when it wraps SGD with momentum; its own step is SGD without momentum).

Each method with the registry's defaults (``make_gradient_maker`` /
``precondition_in_loop``: K-FAC and EKFAC with their KL clip, Shampoo and PSGD
grafted from SGD) wraps ``SGD(lr=0.05, momentum=0.9)`` and ``AdamW(lr=1e-3)`` on
four models: ``GPT.default()`` on the standard library's text, the library's MLP
and CNN on the 8x8 digits, and a small transformer written here in plain PyTorch
(the kind of model a user brings). K-FAC, EKFAC and Shampoo run inside the loop
(``precondition_in_loop``); PSGD, which needs its own passes, through its gradient
maker. Every run starts from the same init and batches as the same optimizer
without preconditioning, for ``--steps`` steps and ``--seeds`` seeds.

A run **diverged** when a loss was not finite, a step was skipped for a
non-finite gradient, or its last-10-step mean loss ended above its first loss.
Printed per model: for each method and optimizer the diverged runs, and the final
loss (mean of the last 10 steps) over the unpreconditioned loop's, geometric mean
over seeds with the smallest and largest ratio.

Run: ``python benchmarks/precond_stability.py`` (300 steps, 5 seeds; about an hour
on 2 cores, ``--workers 2``); ``--quick`` for a 20-step smoke run.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from leantrain.data import TensorBatches, TokenBatches, load_digits, load_stdlib_text
from leantrain.models import CNN, GPT, MLP, lm_loss
from leantrain.precond import make_gradient_maker, precondition_in_loop

METHODS = ("plain", "kfac", "ekfac", "shampoo", "psgd", "soap")
IN_LOOP = {"kfac", "ekfac", "shampoo", "soap"}
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
}
LR = {"sgd": 0.05, "adamw": 1e-3}


class SmallTransformer(nn.Module):
    """Two pre-LN decoder blocks written out by hand: token embedding plus a
    learned position table (a parameter), causal attention, a GELU MLP, a head."""

    def __init__(self, vocab: int = 256, d: int = 64, heads: int = 4, depth: int = 2):
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(64, d))
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "ln1": nn.LayerNorm(d),
                    "qkv": nn.Linear(d, 3 * d),
                    "proj": nn.Linear(d, d),
                    "ln2": nn.LayerNorm(d),
                    "up": nn.Linear(d, 4 * d),
                    "down": nn.Linear(4 * d, d),
                }
            )
            for _ in range(depth)
        )
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        x = self.tok(idx) + self.pos[:T]
        for b in self.blocks:
            q, k, v = b["qkv"](b["ln1"](x)).chunk(3, dim=-1)
            q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + b["proj"](y.transpose(1, 2).reshape(B, T, -1))
            x = x + b["down"](F.gelu(b["up"](b["ln2"](x))))
        return self.head(self.ln(x))


def _task(name: str, seed: int):
    """(model, batch iterator, loss) of one model, seeded."""
    torch.manual_seed(seed)
    if name in ("gpt", "transformer"):
        model = GPT.default() if name == "gpt" else SmallTransformer()
        text = load_stdlib_text().train
        stream = TokenBatches(text, block_size=64, batch_size=16, seed=seed)
        return model, iter(stream), lm_loss
    digits = load_digits()
    model = MLP() if name == "mlp" else CNN()
    stream = TensorBatches(digits.train_x, digits.train_y, batch_size=64, seed=seed)
    return model, (stream.sample() for _ in iter(int, 1)), F.cross_entropy


def run(model_name: str, method: str, optimizer: str, seed: int, steps: int) -> dict:
    """One training run; its losses and skipped steps."""
    torch.set_num_threads(1)
    model, batches, loss_fn = _task(model_name, seed)
    opt = OPTIMIZERS[optimizer](model.parameters())
    maker = None
    losses, start = [], time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # coverage notes; skips are counted below
        if method in IN_LOOP:
            opt = precondition_in_loop(opt, model, method)
        elif method != "plain":
            maker = make_gradient_maker(method, model, lr=LR[optimizer])
        for _ in range(steps):
            x, y = next(batches)
            if maker is None:
                loss = loss_fn(model(x), y)
                loss.backward()
            else:
                out = maker.setup_model_call(model, x)
                maker.setup_loss_call(loss_fn, out, y)
                _, loss = maker.forward_and_backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
    gm = maker if maker is not None else getattr(opt, "maker", None)
    skipped = 0 if gm is None else gm.nonfinite_steps
    return {
        "model": model_name,
        "method": method,
        "optimizer": optimizer,
        "seed": seed,
        "losses": losses,
        "skipped": skipped,
        "seconds": time.perf_counter() - start,
    }


def final(losses: list[float]) -> float:
    return statistics.fmean(losses[-10:])


def diverged(r: dict) -> bool:
    losses = r["losses"]
    finite = all(math.isfinite(v) for v in losses)
    return not finite or r["skipped"] > 0 or final(losses) > losses[0]


def table(results: list[dict], model_name: str) -> list[str]:
    """Markdown rows of one model: method x optimizer."""
    rows = [
        f"**{model_name}**",
        "",
        "| method | optimizer | diverged | final loss / unpreconditioned "
        "(geo. mean [min, max]) | final loss (mean) |",
        "|---|---|---|---|---|",
    ]
    mine = [r for r in results if r["model"] == model_name]
    plain = {
        (r["optimizer"], r["seed"]): final(r["losses"])
        for r in mine
        if r["method"] == "plain"
    }
    for method in METHODS:
        for optimizer in OPTIMIZERS:
            runs = [
                r for r in mine if (r["method"], r["optimizer"]) == (method, optimizer)
            ]
            if not runs:
                continue
            bad = sum(diverged(r) for r in runs)
            ratios = [
                final(r["losses"]) / plain[(optimizer, r["seed"])]
                for r in runs
                if math.isfinite(final(r["losses"])) and (optimizer, r["seed"]) in plain
            ]
            cell = "n/a"
            if ratios:
                geo = math.exp(statistics.fmean(math.log(v) for v in ratios))
                cell = f"{geo:.3f} [{min(ratios):.3f}, {max(ratios):.3f}]"
            mean = statistics.fmean(final(r["losses"]) for r in runs)
            rows.append(
                f"| {method} | {optimizer} | {bad}/{len(runs)} | {cell} | {mean:.3f} |"
            )
    return [*rows, ""]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--models", default="gpt,mlp,cnn,transformer")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="20 steps, 1 seed")
    parser.add_argument("--out", default="precond_stability.json")
    args = parser.parse_args(argv)
    steps, seeds = (20, 1) if args.quick else (args.steps, args.seeds)
    models = args.models.split(",")
    methods = [m for m in args.methods.split(",") if m != "plain"]
    jobs = [
        (model, method, opt, seed, steps)
        for model in models
        for seed in range(seeds)
        for opt in OPTIMIZERS
        for method in ["plain", *methods]
    ]
    from tqdm import tqdm

    with ProcessPoolExecutor(args.workers) as pool:
        futures = [pool.submit(run, *job) for job in jobs]
        results = [f.result() for f in tqdm(futures, desc="training runs", unit="run")]
    Path(args.out).write_text(json.dumps(results))
    print(
        f"{steps} steps, seeds 0-{seeds - 1}; SGD lr 0.05 momentum 0.9, AdamW lr 1e-3"
    )
    for model in models:
        print("\n".join(table(results, model)))


if __name__ == "__main__":
    main()
