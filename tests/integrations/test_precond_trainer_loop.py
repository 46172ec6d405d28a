"""Preconditioning inside HF ``Trainer`` and Lightning equals the gradient maker.

The trainer runs its own forward, ``loss.backward()`` and ``optimizer.step()`` with a
:class:`~leantrain.precond.PreconditionedOptimizer`; a forward pre-hook records the
batches it trained on, and a reference loop runs the gradient maker on the same
batches from the same initial model. Final parameters must agree (float64).
"""

from __future__ import annotations

import copy

import lightning  # the test extra installs it
import pytest
import torch
import transformers

from leantrain.precond import make_gradient_maker, precondition_in_loop
from tests._helpers.hf_models import tiny_llama, token_batch

LR = 0.05
STEPS = 3
# Llama computes its RMSNorm and its loss in float32 even in a float64 model, so a
# scale applied before or after the backward rounds differently, unless it is a
# power of two: with 16 positions per step (sqrt(1/r) = 4) the empirical Fisher's
# rescaling is exact and so is the comparison.
SEQ, POSITIONS = 8, 16
# Curvature every 2nd step after one warm-up step, so the schedule matters.
CONFIG = {
    "damping": 1e-2,
    "ema_decay": 0.9,
    "warmup_steps": 1,
    "curvature_interval": 2,
    "preconditioner_interval": 2,
}
METHODS = {
    "kfac-emp": ("kfac", CONFIG, {"fisher_type": "fisher_emp"}),
    "kfac-mc": ("kfac", CONFIG, {}),
    "ekfac-emp": ("ekfac", CONFIG, {"fisher_type": "fisher_emp"}),
    "shampoo": ("shampoo", CONFIG, {}),
}


def llama(seed: int = 0):
    return tiny_llama(dtype=torch.float64, tied=False, seed=seed)


def record_batches(model) -> list[dict[str, torch.Tensor]]:
    """Each training forward's ``input_ids`` and ``labels``, in order."""
    seen: list[dict[str, torch.Tensor]] = []

    def hook(module, args, kwargs):
        if module.training and torch.is_grad_enabled():
            seen.append({k: kwargs[k].clone() for k in ("input_ids", "labels")})

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def reference(model, method, config, kwargs, steps: list[list[dict]]) -> None:
    """The gradient maker on each step's union of micro-batches, then SGD (the
    maker told SGD's learning rate, which the KL clip reads in the loop form)."""
    gm = make_gradient_maker(method, model, config=config, lr=LR, **kwargs)
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    for micro in steps:
        ids = torch.cat([b["input_ids"] for b in micro])
        labels = torch.cat([b["labels"] for b in micro])
        sgd.zero_grad()
        y = gm.setup_model_call(model, input_ids=ids, labels=labels)
        gm.setup_loss_repr(y.loss)
        gm.forward_and_backward()
        sgd.step()


def assert_same_parameters(a, b, tol=1e-9) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        scale = float(q.detach().abs().max())
        err = float((p.detach() - q.detach()).abs().max())
        assert err <= tol * scale, (name, err, scale)


def assert_trained(model, initial) -> None:
    change = max(
        float((p.detach() - q.detach()).abs().max())
        for p, q in zip(model.parameters(), initial.parameters(), strict=True)
    )
    assert change > 1e-4


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.ids = token_batch(n, SEQ, seed=3)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


# Accumulation with the empirical Fisher: Monte-Carlo draws on two micro-batches
# are other samples than one draw on their union.
@pytest.mark.parametrize(
    ("case", "accumulate"),
    [(c, 1) for c in sorted(METHODS)]
    + [("kfac-emp", 2), ("ekfac-emp", 2), ("shampoo", 2)],
)
def test_hf_trainer_equals_gradient_maker(case, accumulate, tmp_path):
    method, config, kwargs = METHODS[case]
    model = llama()
    initial = copy.deepcopy(model)
    seen = record_batches(model)
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    opt = precondition_in_loop(sgd, model, method, config=config, **kwargs)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=STEPS,
        per_device_train_batch_size=POSITIONS // SEQ // accumulate,
        gradient_accumulation_steps=accumulate,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,  # no clipping: the reference does not clip either
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=_Tokens(STEPS * POSITIONS // SEQ),
        optimizers=(opt, None),
    )
    trainer.train()
    assert opt.maker.step == STEPS and len(seen) == STEPS * accumulate
    ref = copy.deepcopy(initial)
    steps = [seen[i : i + accumulate] for i in range(0, len(seen), accumulate)]
    reference(ref, method, config, kwargs, steps)
    assert_same_parameters(model, ref)
    assert_trained(model, initial)


def _trainer(model, opt, out, steps: int, device="cpu") -> transformers.Trainer:
    """Four steps' worth of data (the same shuffle for every run), a checkpoint
    every two steps; on ``device`` (the Trainer moves the model there after the
    preconditioner was built on the CPU)."""
    args = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=POSITIONS // SEQ,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        save_strategy="steps",
        save_steps=2,
        report_to=[],
        use_cpu=device == "cpu",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    return transformers.Trainer(
        model=model,
        args=args,
        train_dataset=_Tokens(4 * POSITIONS // SEQ),
        optimizers=(opt, None),
    )


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_hf_trainer_resume_restores_the_curvature(device, tmp_path):
    # Resuming from the step-2 checkpoint reproduces the uninterrupted run: the
    # checkpoint's optimizer state carries the factors, the EMA and the counters.
    if device == "cuda" and not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device")
    method, config, kwargs = METHODS["kfac-emp"]

    def wrapped(model):
        sgd = torch.optim.SGD(model.parameters(), lr=LR)
        return precondition_in_loop(sgd, model, method, config=config, **kwargs)

    full = llama()
    _trainer(full, wrapped(full), tmp_path / "full", 4, device).train()
    assert next(full.parameters()).device.type == device
    first = llama()
    _trainer(first, wrapped(first), tmp_path / "cut", 2, device).train()
    resumed = llama(seed=1)  # other weights: the checkpoint must restore them
    opt = wrapped(resumed)
    trainer = _trainer(resumed, opt, tmp_path / "cut", 4, device)
    trainer.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-2"))
    assert (opt.maker.step, opt.maker.curvature_updates) == (4, 3)  # steps 0, 1, 3
    assert_same_parameters(resumed, full)


class _LitLM(lightning.LightningModule):
    def __init__(self, net, method, config, kwargs, manual: bool) -> None:
        super().__init__()
        self.net = net
        self.method, self.config, self.kwargs = method, config, kwargs
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        loss = self.net(input_ids=batch, labels=batch).loss
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return None

    def configure_optimizers(self):
        sgd = torch.optim.SGD(self.net.parameters(), lr=LR)
        # The maker watches the HF model: its call returns the logits.
        return precondition_in_loop(
            sgd, self.net, self.method, config=self.config, **self.kwargs
        )


@pytest.mark.parametrize(
    ("case", "manual", "accumulate"),
    [
        ("kfac-emp", False, 1),
        ("kfac-mc", True, 1),
        ("ekfac-emp", False, 2),
        ("shampoo", True, 1),
    ],
)
def test_lightning_equals_gradient_maker(case, manual, accumulate):
    method, config, kwargs = METHODS[case]
    net = llama()
    initial = copy.deepcopy(net)
    seen = record_batches(net)
    module = _LitLM(net, method, config, kwargs, manual)
    loader = torch.utils.data.DataLoader(
        token_batch(STEPS * POSITIONS // SEQ, SEQ, seed=4),
        batch_size=POSITIONS // SEQ // accumulate,
    )
    trainer = lightning.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        devices=1,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader)
    assert len(seen) == STEPS * accumulate
    ref = copy.deepcopy(initial)
    steps = [seen[i : i + accumulate] for i in range(0, len(seen), accumulate)]
    reference(ref, method, config, kwargs, steps)
    assert_same_parameters(net, ref)
    assert_trained(net, initial)


def _checkpointed_loop(model, method: str, kwargs: dict) -> None:
    opt = precondition_in_loop(
        torch.optim.SGD(model.parameters(), lr=LR),
        model,
        method,
        config=CONFIG,
        **kwargs,
    )
    for step in range(3):  # warm-up, then a step without and one with curvature
        ids = token_batch(POSITIONS // SEQ, SEQ, seed=10 + step)
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()


@pytest.mark.parametrize(
    ("case", "reentrant"),
    [("kfac-emp", False), ("kfac-mc", False), ("kfac-emp", True)],
)
def test_activation_checkpointing_equals_the_plain_model(case, reentrant):
    method, _, kwargs = METHODS[case]
    model, ref = llama(), llama()
    model.activation_checkpointing_enable({"use_reentrant": reentrant})
    _checkpointed_loop(model, method, kwargs)
    _checkpointed_loop(ref, method, kwargs)
    assert_same_parameters(model, ref, tol=1e-12)


def test_reentrant_checkpointing_with_monte_carlo_vectors_is_refused():
    model = llama()
    model.activation_checkpointing_enable({"use_reentrant": True})
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        _checkpointed_loop(model, "kfac", {})


def test_lightning_checkpoint_restores_the_curvature(tmp_path):
    # Two steps, a checkpoint, two more from it in a fresh process-like setup: the
    # maker on the four recorded batches gives the same parameters, so the
    # checkpoint carried the factors, the EMA and the counters.
    method, config, kwargs = METHODS["kfac-emp"]
    ids = token_batch(4, SEQ, seed=4)

    def fit(net, ckpt_path=None):
        module = _LitLM(net, method, config, kwargs, manual=False)
        trainer = lightning.Trainer(
            max_steps=2 if ckpt_path is None else 4,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        loader = torch.utils.data.DataLoader(ids, batch_size=POSITIONS // SEQ)
        trainer.fit(module, loader, ckpt_path=ckpt_path)
        return trainer

    first = llama()
    initial = copy.deepcopy(first)
    seen = record_batches(first)
    fit(first).save_checkpoint(tmp_path / "two.ckpt")
    resumed = llama(seed=1)  # other weights: the checkpoint must restore them
    seen_after = record_batches(resumed)
    trainer = fit(resumed, ckpt_path=tmp_path / "two.ckpt")
    maker = trainer.optimizers[0].maker
    assert (maker.step, maker.curvature_updates) == (4, 3)  # steps 0, 1, 3
    assert len(seen) == len(seen_after) == 2
    ref = copy.deepcopy(initial)
    reference(ref, method, config, kwargs, [[b] for b in seen + seen_after])
    assert_same_parameters(resumed, ref)
