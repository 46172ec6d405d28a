"""The diagonal empirical Fisher maker against an independent float64 computation.

The reference (``reference_step`` in conftest) loops over examples with plain autograd,
no torch.func; every quantity is compared in float64.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from leantrain.precond import (
    DiagonalEmpiricalFisherGradientMaker,
    PreconditioningConfig,
)

# -- patterns: (model factory, setup on a maker, loss on a sub-batch, batch) --------


def _patterns(zoo):
    x, t = torch.randn(6, 5, dtype=torch.float64), torch.randint(0, 3, (6,))
    idx = torch.randint(0, 11, (4, 7))

    def lm_loss(m, b):
        out = m(b[0])
        return F.cross_entropy(out.reshape(-1, out.size(-1)), b[1].reshape(-1))

    def lm_setup(gm, m, b):
        # Targets stay batch-shaped (B, T) so the per-example pass can split them.
        y = gm.setup_model_call(m, b[0])
        gm.setup_loss_call(
            lambda logits, tgt: F.cross_entropy(logits, tgt.reshape(-1)),
            y.view(-1, y.size(-1)),
            b[1],
        )

    return {
        "logits": (
            zoo.MLP,
            lambda gm, m, b: gm.setup_loss_call(
                F.cross_entropy, gm.setup_model_call(m, b[0]), b[1]
            ),
            lambda m, b: F.cross_entropy(m(b[0]), b[1]),
            (x, t),
        ),
        "logits-and-loss": (
            zoo.LogitsAndLoss,
            lambda gm, m, b: gm.setup_loss_repr(gm.setup_model_call(m, *b)[1]),
            lambda m, b: m(*b)[1],
            (x, t),
        ),
        "dict": (
            zoo.DictOutput,
            lambda gm, m, b: gm.setup_loss_repr(
                F.cross_entropy(gm.setup_model_call(m, b[0])["logits"], b[1])
            ),
            lambda m, b: F.cross_entropy(m(b[0])["logits"], b[1]),
            (x, t),
        ),
        "dataclass": (
            zoo.DataclassOutput,
            lambda gm, m, b: gm.setup_loss_repr(
                gm.setup_model_call(m, b[0], labels=b[1]).loss
            ),
            lambda m, b: m(b[0], labels=b[1]).loss,
            (x, t),
        ),
        "lm-view": (zoo.TinyLM, lm_setup, lm_loss, (idx[:, :-1], idx[:, 1:])),
    }


PATTERNS = ["logits", "logits-and-loss", "dict", "dataclass", "lm-view"]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_preconditioned_grad_matches_float64_reference(zoo, pattern):
    make, setup, loss_of, batch = _patterns(zoo)[pattern]
    model = make().double()
    ref = zoo.twin(model)
    cfg = PreconditioningConfig(damping=1e-3)
    gm = DiagonalEmpiricalFisherGradientMaker(model, cfg)
    setup(gm, model, batch)
    _, loss = gm.forward_and_backward()
    expected, diag = zoo.reference_step(ref, loss_of, batch, damping=1e-3)
    zoo.assert_dicts_close(zoo.grads_of(model), expected, rtol=1e-9, atol=1e-12)
    zoo.assert_dicts_close(gm.curvature, diag, rtol=1e-9, atol=1e-14)
    torch.testing.assert_close(loss, loss_of(ref, batch).detach())


def test_sum_reduction(zoo):
    model = zoo.MLP().double()
    ref = zoo.twin(model)
    x, t = torch.randn(5, 5, dtype=torch.float64), torch.randint(0, 3, (5,))
    gm = DiagonalEmpiricalFisherGradientMaker(model, loss_reduction="sum")
    gm.setup_loss_call(
        F.cross_entropy, gm.setup_model_call(model, x), t, reduction="sum"
    )
    gm.forward_and_backward()

    def loss_of(m, b):
        return F.cross_entropy(m(b[0]), b[1], reduction="sum")

    expected, _ = zoo.reference_step(ref, loss_of, (x, t), damping=1e-7)
    zoo.assert_dicts_close(zoo.grads_of(model), expected, rtol=1e-9, atol=1e-12)


def test_stale_preconditioner_is_reused_between_updates(zoo):
    model = zoo.MLP().double()
    ref = zoo.twin(model)
    cfg = PreconditioningConfig(
        curvature_interval=3, preconditioner_interval=3, damping=1e-2
    )
    gm = DiagonalEmpiricalFisherGradientMaker(model, cfg)
    batches = [
        (torch.randn(4, 5, dtype=torch.float64), torch.randint(0, 3, (4,)))
        for _ in range(3)
    ]

    def loss_of(m, b):
        return F.cross_entropy(m(b[0]), b[1])

    _, curvature = zoo.reference_step(ref, loss_of, batches[0], damping=1e-2)
    for batch in batches:
        model.zero_grad()
        gm.setup_loss_call(
            F.cross_entropy, gm.setup_model_call(model, batch[0]), batch[1]
        )
        gm.forward_and_backward()
        expected, _ = zoo.reference_step(
            ref, loss_of, batch, damping=1e-2, curvature=curvature
        )
        zoo.assert_dicts_close(zoo.grads_of(model), expected, rtol=1e-9, atol=1e-12)
    assert gm.preconditioner_updates == 1


def test_ema_with_bias_correction(zoo):
    model = zoo.MLP().double()
    ref = zoo.twin(model)
    decay = 0.75
    cfg = PreconditioningConfig(ema_decay=decay, damping=1e-3)
    gm = DiagonalEmpiricalFisherGradientMaker(model, cfg)
    batches = [
        (torch.randn(4, 5, dtype=torch.float64), torch.randint(0, 3, (4,)))
        for _ in range(2)
    ]

    def loss_of(m, b):
        return F.cross_entropy(m(b[0]), b[1])

    raws = []
    for batch in batches:
        _, raw = zoo.reference_step(ref, loss_of, batch, damping=1e-3)
        raws.append(raw)
        gm.setup_loss_call(
            F.cross_entropy, gm.setup_model_call(model, batch[0]), batch[1]
        )
        gm.forward_and_backward()
        if len(raws) == 1:  # the first estimate is the raw value, not (1 - decay) * it
            zoo.assert_dicts_close(gm.curvature, raw, rtol=1e-9, atol=1e-14)
    expected = {
        n: (decay * (1 - decay) * raws[0][n] + (1 - decay) * raws[1][n])
        / (1 - decay**2)
        for n in raws[0]
    }
    zoo.assert_dicts_close(gm.curvature, expected, rtol=1e-9, atol=1e-14)


def test_ignored_parameters_keep_the_plain_gradient(zoo):
    model = zoo.MLP().double()
    ref = zoo.twin(model)
    x, t = torch.randn(4, 5, dtype=torch.float64), torch.randint(0, 3, (4,))
    gm = DiagonalEmpiricalFisherGradientMaker(
        model, PreconditioningConfig(ignore_modules=("fc2",), damping=1e-3)
    )
    gm.setup_loss_call(F.cross_entropy, gm.setup_model_call(model, x), t)
    gm.forward_and_backward()
    expected, _ = zoo.reference_step(
        ref, lambda m, b: F.cross_entropy(m(b[0]), b[1]), (x, t), damping=1e-3
    )
    F.cross_entropy(ref(x), t).backward()
    expected["fc2.weight"], expected["fc2.bias"] = (
        ref.fc2.weight.grad,
        ref.fc2.bias.grad,
    )
    zoo.assert_dicts_close(zoo.grads_of(model), expected, rtol=1e-9, atol=1e-12)
    assert sorted(gm.curvature) == ["fc1.bias", "fc1.weight"]


def test_batchnorm_in_training_mode_is_rejected_on_curvature_steps():
    model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))
    gm = DiagonalEmpiricalFisherGradientMaker(model)
    gm.setup_loss_repr(gm.setup_model_call(model, torch.randn(6, 5)).square().mean())
    with pytest.raises(ValueError, match="BatchNorm '1' is in training mode"):
        gm.forward_and_backward()
    model.eval()
    gm.forward_and_backward()
    assert gm.curvature_updates == 1


# -- state ----------------------------------------------------------------------------


def test_state_dict_round_trip_resumes_identically(zoo):
    cfg = PreconditioningConfig(
        curvature_interval=2, preconditioner_interval=4, ema_decay=0.8
    )
    x, t = torch.randn(4, 5, dtype=torch.float64), torch.randint(0, 3, (4,))
    model = zoo.MLP().double()
    twin = zoo.twin(model)

    def run(gm, m, steps):
        gm.setup_loss_call(F.cross_entropy, gm.setup_model_call(m, x), t)
        for _ in range(steps):
            m.zero_grad()
            gm.forward_and_backward()
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.1 * p.grad

    straight = DiagonalEmpiricalFisherGradientMaker(model, cfg)
    run(straight, model, 7)
    first = DiagonalEmpiricalFisherGradientMaker(twin, cfg)
    run(first, twin, 3)
    state = first.state_dict()
    assert (
        state["step"],
        state["curvature_updates"],
        state["preconditioner_updates"],
    ) == (3, 2, 1)
    resumed = DiagonalEmpiricalFisherGradientMaker(twin, cfg)
    resumed.load_state_dict(state)
    run(resumed, twin, 4)
    zoo.assert_dicts_close(
        zoo.grads_of(model), zoo.grads_of(twin), rtol=1e-12, atol=1e-14
    )
    assert straight.state_dict()["step"] == resumed.state_dict()["step"] == 7
    with pytest.raises(ValueError, match="keys"):
        resumed.load_state_dict({"step": 1})
    broken = dict(state, ema={"fc1.weight": [1.0]})
    with pytest.raises(TypeError, match="must be a tensor"):
        resumed.load_state_dict(broken)
    with pytest.raises(TypeError, match="must be an int"):
        resumed.load_state_dict(dict(state, step=1.0))
    assert resumed.step == 7  # failed loads change nothing


# -- DDP ------------------------------------------------------------------------------


def test_ddp_wrapped_model_single_process(zoo, tmp_path):
    own = not dist.is_initialized()
    if own:
        dist.init_process_group(
            "gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1
        )
    try:
        group = dist.new_group([dist.get_rank()])
        model = zoo.MLP().double()
        plain = zoo.twin(model)
        ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
        cfg = PreconditioningConfig(
            curvature_interval=2,
            preconditioner_interval=2,
            ignore_modules=("fc2",),
            damping=1e-3,
        )
        a = DiagonalEmpiricalFisherGradientMaker(ddp, cfg)
        b = DiagonalEmpiricalFisherGradientMaker(plain, cfg)
        assert [n for n, _ in a.modules()] == ["fc1"]  # names of the wrapped module
        with pytest.raises(ValueError, match="pass the wrapper itself"):
            a.setup_model_call(model, torch.randn(2, 5, dtype=torch.float64))
        x, t = torch.randn(4, 5, dtype=torch.float64), torch.randint(0, 3, (4,))
        for gm, m in ((a, ddp), (b, plain)):
            gm.setup_loss_call(F.cross_entropy, gm.setup_model_call(m, x), t)
            for _ in range(2):  # a curvature step (DDP bypassed) and a plain DDP step
                gm.forward_and_backward()
        zoo.assert_dicts_close(
            zoo.grads_of(model), zoo.grads_of(plain), rtol=1e-12, atol=1e-14
        )
    finally:
        if own:
            dist.destroy_process_group()


def _two_rank_worker(rank, store_path, out_path, state, x, t):
    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=2
    )
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
        model.load_state_dict(state)
        ddp = nn.parallel.DistributedDataParallel(model)
        gm = DiagonalEmpiricalFisherGradientMaker(
            ddp, PreconditioningConfig(damping=1e-3)
        )
        half = slice(2 * rank, 2 * rank + 2)
        gm.setup_loss_call(F.cross_entropy, gm.setup_model_call(ddp, x[half]), t[half])
        gm.forward_and_backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        torch.save(grads, f"{out_path}.{rank}")
        # DDP's reducer must be gone and both ranks done before the group is:
        # tearing gloo down under it aborted a rank once ("terminate called
        # without an active exception").
        del gm, ddp
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_two_ranks_match_one_process_on_the_union_batch(zoo, tmp_path):
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    x, t = torch.randn(4, 5, dtype=torch.float64), torch.randint(0, 3, (4,))
    args = (str(tmp_path / "store"), str(tmp_path / "grads"), model.state_dict(), x, t)
    mp.spawn(_two_rank_worker, args=args, nprocs=2, join=True)
    expected, _ = zoo.reference_step(
        model, lambda m, b: F.cross_entropy(m(b[0]), b[1]), (x, t), damping=1e-3
    )
    for rank in range(2):
        got = torch.load(tmp_path / f"grads.{rank}", weights_only=True)
        zoo.assert_dicts_close(got, expected, rtol=1e-9, atol=1e-12)


def test_curvature_equals_the_curvature_layers_diagonal_empirical_fisher(zoo):
    from leantrain.precond import curvature

    model = zoo.MLP().double()
    x, t = torch.randn(6, 5, dtype=torch.float64), torch.randint(0, 3, (6,))
    loss_fn = nn.CrossEntropyLoss()
    dense = curvature(model, loss_fn, x, t, kind="fisher_emp", shape="diag").to_dense()
    gm = DiagonalEmpiricalFisherGradientMaker(model)
    gm.setup_loss_call(F.cross_entropy, gm.setup_model_call(model, x), t)
    gm.forward_and_backward()
    mine = torch.cat([gm.curvature[n].reshape(-1) for n, _ in model.named_parameters()])
    torch.testing.assert_close(mine, torch.diagonal(dense), rtol=1e-9, atol=1e-14)


def test_equals_the_hooked_diagonal_natural_gradient_with_the_empirical_fisher():
    """Per-example gradients by vmap take the step of
    ``NaturalGradientMaker(shape="diag", fisher_type="fisher_emp")`` (hooks) over
    three steps of an EMA, in float64."""
    from leantrain.precond import NaturalGradientMaker

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    x, t = torch.randn(6, 5, dtype=torch.float64), torch.randint(0, 3, (6,))
    config = {"damping": 1e-2, "ema_decay": 0.9}
    makers = {
        "vmap": DiagonalEmpiricalFisherGradientMaker(
            model, PreconditioningConfig(**config)
        ),
        "hooked": NaturalGradientMaker(
            model,
            PreconditioningConfig(**config),
            shape="diag",
            fisher_type="fisher_emp",
        ),
    }
    steps = {}
    for name, gm in makers.items():
        steps[name] = []
        for s in range(3):
            model.zero_grad()
            y = gm.setup_model_call(model, x * (1 + s))
            gm.setup_loss_call(F.cross_entropy, y, t)
            gm.forward_and_backward()
            steps[name].append([p.grad.clone() for p in model.parameters()])
    for mine, hooked in zip(steps["vmap"], steps["hooked"], strict=True):
        for a, b in zip(mine, hooked, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
