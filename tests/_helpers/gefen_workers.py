"""Worker functions for the Gefen distributed tests (module level: they are pickled)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from leantrain.optim import Gefen

STEPS = 20
GLOBAL_BATCH = 16  # split evenly over 1, 2 or 4 ranks: every run sees the same data


def make_model(seed: int = 0) -> nn.Module:
    """float64 so that the union-batch gradient rounds to the same fp32 on every
    layout; shapes chosen so that blocks straddle shard boundaries."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(12, 37), nn.Tanh(), nn.Linear(37, 64), nn.Tanh(), nn.Linear(64, 48)
    ).double()


# 4-bit runs clip every element's step at 0.5 lr ("auto" would clip only factored
# matrices and per-element groups, which the shards here do not have), so the clamp
# of the sharded and the straddling paths is held to one process's; it binds on
# about a fifth of the element steps.
UPDATE_CLIP = {8: "auto", 4: 0.5, None: "auto"}


def make_optimizer(
    model: nn.Module, bits: int | None = 8, second_moment: str = "auto"
) -> Gefen:
    first, rest = (
        list(model[0].parameters()),
        [p for m in list(model)[1:] for p in m.parameters()],
    )
    return Gefen(
        [{"params": first, "partition": 100}, {"params": rest}],
        lr=3e-3,
        weight_decay=0.01,
        momentum_bits=bits,
        second_moment=second_moment,
        update_clip=UPDATE_CLIP[bits],
    )


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 12, generator=g, dtype=torch.float64)
    y = torch.randn(GLOBAL_BATCH, 48, generator=g, dtype=torch.float64)
    return x, y


def train(model, opt, steps, world, rank, start=0):
    for step in range(start, start + steps):
        x, y = batch(step)
        per = GLOBAL_BATCH // world
        lo, hi = rank * per, (rank + 1) * per
        loss = (model(x[lo:hi]) - y[lo:hi]).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def full_params(model) -> list[torch.Tensor]:
    out = []
    for p in model.parameters():
        p = p.detach()
        out.append(p.full_tensor() if hasattr(p, "full_tensor") else p.clone())
    return out


def summary(opt) -> dict:
    periods = [int(s["period"]) for s in opt.state.values()]
    codebook = next(s["codebook"] for s in opt.state.values() if "codebook" in s)
    return {"periods": periods, "codebook": codebook.clone()}


def reference(
    world: int, bits: int | None = 8, steps: int = STEPS, second_moment: str = "auto"
):
    """Single process, union batch (the world's batches concatenated)."""
    model = make_model()
    opt = make_optimizer(model, bits, second_moment)
    for step in range(steps):
        x, y = batch(step)
        (model(x) - y).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return full_params(model), summary(opt)


def shard(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def ddp_and_fsdp2(rank: int, world: int) -> dict:
    """20 steps under DDP and under FSDP2 (8- and 4-bit), each versus one process."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    for bits in (8, 4):
        ref_params, ref_summary = reference(world, bits)
        ddp_model = DDP(make_model())
        opt = make_optimizer(ddp_model.module, bits)
        train(ddp_model, opt, STEPS, world, rank)
        out[f"ddp{bits}"] = (full_params(ddp_model.module), summary(opt))
        model = shard(make_model())
        opt = make_optimizer(model, bits)
        train(model, opt, STEPS, world, rank)
        out[f"fsdp{bits}"] = (full_params(model), summary(opt))
        out[f"ref{bits}"] = (ref_params, ref_summary)
    out["init"] = sharded_init(rank, world)
    out["nonfinite"] = nonfinite_on_one_rank(rank, world)
    dist.barrier()
    return out


def nonfinite_on_one_rank(rank: int, world: int) -> dict:
    """A NaN in the last rank's shard only: every rank skips the step together."""
    import warnings

    model = shard(make_model())
    opt = make_optimizer(model)
    train(model, opt, 2, world, rank)
    before = full_params(model)
    x, y = batch(2)
    (model(x) - y).square().mean().backward()
    if rank == world - 1:
        model[0].weight.grad.to_local().view(-1)[-1] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        opt.step()
    after = full_params(model)
    return {
        "skipped": opt.nonfinite_steps,
        "unchanged": all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
    }


def sharded_init(rank: int, world: int) -> dict:
    """FSDP2 sharded init: meta device, shard, materialise, then the optimizer."""
    with torch.device("meta"):
        model = make_model()
    shard(model)
    model.to_empty(device="cpu")
    source = make_model()
    from torch.distributed.tensor import distribute_tensor

    for p, q in zip(model.parameters(), source.parameters(), strict=True):
        p.data.copy_(distribute_tensor(q.data, p.device_mesh, p.placements))
    opt = make_optimizer(model)
    train(model, opt, 5, world, rank)
    return {"params": full_params(model), "summary": summary(opt)}


def state_bytes(rank: int, world: int) -> dict:
    """Per-rank Gefen state bytes under FSDP2 (for benchmarks/gefen_fsdp.py)."""
    from leantrain.optim import optimizer_state_nbytes

    model = shard(make_model()) if world > 1 else make_model()
    opt = make_optimizer(model)
    train(model, opt, 1, world, rank)
    numel = sum(p.numel() for p in model.parameters())
    return {"bytes": optimizer_state_nbytes(opt), "numel": numel}


# ------------------------------------------------------------------------- DCP
def dcp_save(model, opt, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def dcp_load(model, opt, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)  # DCP's zero-step template
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )


# Checkpoints that cross world sizes hold the layout every world size has: blocks (a
# one-process "auto" factors every matrix, which FSDP2 shards cannot hold).
DCP_SECOND_MOMENT = "blocks"


def build(world: int, bits: int | None = 8):
    model = shard(make_model()) if world > 1 else make_model()
    return model, make_optimizer(model, bits, DCP_SECOND_MOMENT)


def resume(world: int, rank: int, path: str, bits: int | None = 8):
    """Loads ``path`` into a fresh model/optimizer and trains steps 10..19."""
    model, opt = build(world, bits)
    dcp_load(model, opt, path)
    train(model, opt, STEPS // 2, world, rank, start=STEPS // 2)
    return full_params(model), summary(opt)


def first_half(world: int, rank: int, path: str, bits: int | None = 8):
    model, opt = build(world, bits)
    train(model, opt, STEPS // 2, world, rank)
    dcp_save(model, opt, path)


def _fails(fn) -> str:
    try:
        fn()
    except BaseException as err:  # noqa: BLE001 - DCP raises CheckpointException(BaseException)
        return f"{type(err).__name__}: {err}"
    return ""


def dcp_checks(rank: int, world: int, root: str, sources: tuple[str, ...]) -> dict:
    """DCP on ``world`` ranks: template step is a no-op, same-size resume is
    bit-exact, checkpoints saved by other world sizes (``root/<source>``) load,
    mismatches fail."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    out = {}
    # DCP's zero-gradient lr-0 initialisation changes nothing
    plain, opt = build(world)
    train(plain, opt, STEPS, world, rank)
    out["uninterrupted"] = full_params(plain)
    model, opt = build(world)
    get_optimizer_state_dict(model, opt)
    out["template_periods"] = [int(s["period"]) for s in opt.state.values()]
    train(model, opt, STEPS, world, rank)
    out["after_template"] = full_params(model)
    # same world size: bit-exact
    path = f"{root}/w{world}"
    first_half(world, rank, path)
    dist.barrier()
    out["resumed"] = resume(world, rank, path)
    # from other world sizes
    out["from"] = {src: resume(world, rank, f"{root}/{src}")[0] for src in sources}

    # mismatches
    def other_model():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 64)).double()
        m = shard(m) if world > 1 else m
        dcp_load(m, make_optimizer(m), path)

    def other_bits():
        m, o = build(world, 4)
        dcp_load(m, o, path)

    def adamw():
        m = build(world)[0]
        dcp_load(m, torch.optim.AdamW(m.parameters()), path)

    def factored():  # a factored second moment cannot span row shards
        m = build(world)[0]
        opt = Gefen(m.parameters(), second_moment="factored")
        x, y = batch(0)
        (m(x) - y).square().mean().backward()
        opt.step()

    def auto_four_bits() -> bool:  # "auto" factors 4-bit matrices unless sharded
        m = build(world)[0]
        opt = Gefen(m.parameters(), momentum_bits=4)
        x, y = batch(0)
        (m(x) - y).square().mean().backward()
        opt.step()
        return any("factored" in state for state in opt.state.values())

    out["auto_4bit_factored"] = auto_four_bits()
    out["errors"] = {
        "model": _fails(other_model),
        "bits": _fails(other_bits),
        "adamw": _fails(adamw),
        "factored": _fails(factored),
    }
    return out


def everything(rank: int, world: int, root: str, sources: tuple[str, ...]) -> dict:
    """All checks of one world size in one spawned group (spawning is the cost)."""
    return {
        "train": ddp_and_fsdp2(rank, world),
        "dcp": dcp_checks(rank, world, root, sources),
    }


def save_first_half(rank: int, world: int, path: str) -> None:
    first_half(world, rank, path)
