"""Gradient makers on a GPT whose LayerParallel stack is spread over gloo ranks.

2 processes (``parallelize`` over an ``lp`` mesh): every first-order maker's
preconditioned gradient of each rank's own layers, and of the embedding and head every
rank runs, equals the serial GPT's (computed in the same process) to 1e-8; the makers
that need double backward, or couple all layers (SMW-NG), raise naming LayerParallel. 4
processes (slow): a ``dp x lp`` = 2 x 2 mesh, the stack over ``lp`` and
``DistributedDataParallel`` over ``dp`` (the makers average gradients and factors over
its group), equals one serial process on the union batch.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from leantrain.layer_parallel import LayerParallel
from leantrain.models import GPT
from leantrain.models.gpt import GPTConfig, lm_loss
from leantrain.precond import unwrap_model
from leantrain.precond.registry import make_gradient_maker
from tests._helpers.launchers import parallelize_over_all_ranks, run_distributed

pytestmark = pytest.mark.distributed

VOCAB, T = 16, 6
EXACT = {"levels": 2, "cf": 2, "fwd_iters": 2, "bwd_iters": 2}
MAKERS = {
    "kfac": {},
    "ekfac": {},
    "shampoo": {},
    "kbfgs": {},
    "seng": {"sketching_size": 4, "truncated_rank": 2},
    "ng_unit": {},
    "ng_diag": {},
    "psgd": {"mode": "whitening"},
}
STEPS = {"kbfgs": 2, "psgd": 2}


def _serial_gpt():
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=VOCAB,
        block_size=T,
        n_layer=4,
        n_head=2,
        d_model=8,
        mlp_ratio=2,
        t_final=1.0,
    )
    return GPT(config).double()


def _batch(step, n=3):
    g = torch.Generator().manual_seed(step + 1)
    x = torch.randint(0, VOCAB, (n, T), generator=g)
    return x, torch.randint(0, VOCAB, (n, T), generator=g)


def _maker(name, model, **extra):
    config = {"damping": 1e-2, "ignore_modules": ["wpe"]}
    return make_gradient_maker(name, model, config=config, **{**MAKERS[name], **extra})


def _train(gm, model, steps, batch=_batch):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        out = gm.setup_model_call(model, x)
        gm.setup_loss_call(lm_loss, out, y)
        gm.forward_and_backward()
        if step < steps - 1:
            opt.step()
    inner = unwrap_model(gm.model)
    return {n: p.grad for n, p in inner.named_parameters() if p.grad is not None}


def _relative(want, got, names):
    a = torch.cat([want[n].reshape(-1) for n in names])
    b = torch.cat([got[n].reshape(-1) for n in names])
    return float((a - b).norm() / a.norm())


def _owned_names(model, stack):
    owned = set(stack.owned_layers)
    return [
        n
        for n, _ in model.named_parameters()
        if not n.startswith("stack.") or int(n.split(".")[2]) in owned
    ]


def _two_process_makers(rank, world):
    errors = {}
    for name in MAKERS:
        serial = _serial_gpt()
        layered = copy.deepcopy(serial)
        layered.stack = parallelize_over_all_ranks(
            LayerParallel(layered.stack, t_final=1.0, **EXACT)
        )
        steps = STEPS.get(name, 1)
        want = _train(_maker(name, serial), serial, steps)
        got = _train(_maker(name, layered), layered, steps)
        names = [n for n in _owned_names(layered, layered.stack) if n in want]
        # Other ranks' layers: no gradient, or the zeros a maker fills in for a
        # parameter its pass did not reach.
        foreign = [n for n in set(got) - set(names) if bool(got[n].any())]
        errors[name] = (_relative(want, got, names), sorted(foreign))
    for name in ("hessian_free", "smw_ng"):
        layered = _serial_gpt()
        layered.stack = parallelize_over_all_ranks(
            LayerParallel(layered.stack, t_final=1.0, **EXACT)
        )
        config = {"damping": 1e-2, "ignore_modules": ["wpe"]}
        try:
            _train(make_gradient_maker(name, layered, config=config), layered, 1)
            errors[name] = "no error"
        except RuntimeError as err:
            errors[name] = str(err)
    return errors


def test_makers_on_two_processes_equal_serial():
    for rank_errors in run_distributed(_two_process_makers, 2, timeout=300):
        for name in MAKERS:
            err, foreign = rank_errors[name]
            assert err < 1e-8, (name, err)
            assert foreign == [], (name, foreign)
        assert "LayerParallel" in rank_errors["hessian_free"]
        # SMW-NG's system couples every layer: a rank holds only its own.
        assert "distribute" in rank_errors["smw_ng"]


def _union(step):
    return _batch(step, n=4)


def _mesh_kfac(rank, world):
    from leantrain.layer_parallel import ParallelDims, parallelize
    from leantrain.layer_parallel.mesh import LayerParallelConfig

    dims = ParallelDims(dp=2, lp=2)
    mesh = dims.build_mesh()
    d = rank // dims.lp  # this rank's data replica: half of the union batch

    def half(step):
        x, y = _union(step)
        return x[2 * d : 2 * d + 2], y[2 * d : 2 * d + 2]

    out = {}
    for name in ("kfac", "shampoo"):
        serial = _serial_gpt()
        layered = copy.deepcopy(serial)
        layered.stack = LayerParallel(layered.stack, t_final=1.0, **EXACT)
        parallelize(layered, mesh, config=LayerParallelConfig(average_gradients=False))
        ddp = nn.parallel.DistributedDataParallel(
            layered, process_group=mesh["dp"].get_group(), find_unused_parameters=True
        )
        extra = {"fisher_type": "fisher_emp"} if name == "kfac" else {}
        want = _train(_maker(name, serial, **extra), serial, 2, _union)
        got = _train(_maker(name, ddp, **extra), ddp, 2, half)
        names = [n for n in _owned_names(layered, layered.stack) if n in want]
        out[name] = _relative(want, got, names)
    return out


@pytest.mark.slow
def test_dp_by_lp_mesh_equals_one_process_on_the_union_batch():
    for errors in run_distributed(_mesh_kfac, 4, timeout=600):
        for name, err in errors.items():
            assert err < 1e-8, (name, err)
