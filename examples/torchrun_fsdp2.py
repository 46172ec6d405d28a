"""A byte-level GPT trained with FSDP2 + Gefen, resumable from DCP checkpoints.

Run on CPU (gloo) or GPUs (nccl)::

    torchrun --nproc_per_node=2 examples/torchrun_fsdp2.py --steps 60 --ckpt /tmp/gpt
    # interrupt it (or let it finish), then resume, even on another world size:
    torchrun --nproc_per_node=4 examples/torchrun_fsdp2.py --steps 120 --ckpt /tmp/gpt

What it shows (docs/distributed.md):

* sharded init: the model is built on the meta device, sharded with
  ``fully_shard``, materialised with ``to_empty`` and initialised; the optimizer
  is created afterwards, on the sharded (DTensor) parameters;
* Gefen decides block periods and the codebook from the *global* first gradient,
  identical on every rank and to a one-process run;
* ``torch.distributed.checkpoint`` saves model + optimizer every ``--every`` steps
  and a restart continues from the latest one, on any number of ranks.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from leantrain.data import TokenBatches, load_stdlib_text
from leantrain.models import GPT, GPTConfig, lm_loss
from leantrain.models.blocks import init_weights
from leantrain.optim import Gefen


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60, help="train up to this step")
    p.add_argument("--every", type=int, default=20, help="checkpoint interval")
    p.add_argument("--ckpt", default="/tmp/leantrain_fsdp2", help="checkpoint root")
    p.add_argument("--batch", type=int, default=16, help="global batch size")
    p.add_argument("--lr", type=float, default=3e-3)
    return p.parse_args()


def build(device: torch.device) -> torch.nn.Module:
    """Sharded init: meta -> fully_shard -> to_empty -> initialise."""
    config = GPTConfig(block_size=64, n_layer=4, d_model=128)
    with torch.device("meta"):
        model = GPT(config)
    for block in model.stack.steps:
        fully_shard(block)  # one all-gather per block in forward and backward
    fully_shard(model)
    model.to_empty(device=device)
    torch.manual_seed(0)  # the same initial weights on every rank and world size
    model.apply(init_weights)  # DTensor-aware: each rank fills its shard
    return model


def latest(root: str) -> int:
    """Step of the newest complete checkpoint under ``root`` (0 when none)."""
    if not os.path.isdir(root):
        return 0
    done = [int(d.split("_")[1]) for d in os.listdir(root) if d.startswith("step_")]
    done = [s for s in done if os.path.exists(f"{root}/step_{s}/.metadata")]
    return max(done, default=0)


def main() -> None:
    args = parse()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise ValueError(f"--batch {args.batch} must be a multiple of {world} ranks")
    device = torch.device(
        f"cuda:{rank % torch.cuda.device_count()}" if backend == "nccl" else "cpu"
    )
    model = build(device)
    opt = Gefen(model.parameters(), lr=args.lr, weight_decay=0.1)
    start = latest(args.ckpt)
    if start:
        # DCP's template step (zero gradients at lr 0) leaves Gefen's state
        # provisional; the load then installs the saved periods and codebook.
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=f"{args.ckpt}/step_{start}")
        set_state_dict(
            model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        if rank == 0:
            print(f"resumed from step {start} on {world} ranks")
    corpus = load_stdlib_text()
    for step in range(start, args.steps):
        # the global batch of this step, the same for any world size
        x, y = TokenBatches(
            corpus.train, block_size=64, batch_size=args.batch, seed=step
        ).sample()
        per = args.batch // world
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        loss = lm_loss(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0 and (step + 1) % 10 == 0:
            print(f"step {step + 1:4d}  loss {loss.item():.4f}")
        if (step + 1) % args.every == 0 or step + 1 == args.steps:
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.save(
                {"model": model_sd, "optim": optim_sd},
                checkpoint_id=f"{args.ckpt}/step_{step + 1}",
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
