"""Gefen in a Lightning ``LightningModule``.

``configure_optimizers`` returns a Gefen (alone, or with a learning-rate scheduler);
``lightning.Trainer`` steps it through a closure. A run checkpoints at step
``SAVE_AT`` (``ModelCheckpoint``); a fresh module and Trainer resumed from that file
(``fit(..., ckpt_path=...)``) end with parameters equal bit for bit to the
uninterrupted run's, and with the same optimizer state.
"""

from __future__ import annotations

import lightning
import pytest
import torch

from leantrain.optim import Gefen, GefenMuon, muon_param_groups
from tests._helpers.hf_models import tiny_gpt2, tiny_llama, token_batch

STEPS, SAVE_AT, BATCH = 6, 3, 4


class _LanguageModel(lightning.LightningModule):
    """A Hugging Face causal LM trained on its own loss by Gefen."""

    def __init__(self, build, optimizer: str) -> None:
        super().__init__()
        self.model = build()
        self.optimizer_kind = optimizer

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        if self.optimizer_kind == "gefen":
            return Gefen(self.parameters(), lr=1e-2)
        if self.optimizer_kind == "adamw":  # the reference
            return torch.optim.AdamW(self.parameters(), lr=1e-2)
        if self.optimizer_kind == "gefen4_cosine":
            optimizer = Gefen(self.parameters(), lr=1e-2, momentum_bits=4)
            schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, STEPS)
            return {"optimizer": optimizer, "lr_scheduler": schedule}
        groups = muon_param_groups(self.model, adamw_modules=[self.model.lm_head])
        return GefenMuon(groups, lr=0.02, adamw_lr=1e-2)


def _loader() -> torch.utils.data.DataLoader:
    # SAVE_AT batches per epoch: the checkpoint falls on an epoch boundary, where
    # Lightning resumes a plain (non-stateful) DataLoader exactly.
    data = token_batch(SAVE_AT * BATCH, seed=3)
    return torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False)


def _trainer(tmp_path, *callbacks) -> lightning.Trainer:
    return lightning.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=bool(callbacks),
        callbacks=list(callbacks),
        default_root_dir=str(tmp_path),
    )


BUILDERS = {"gpt2": tiny_gpt2, "llama": tiny_llama}
CASES = [("gefen", "gpt2"), ("gefen4_cosine", "gpt2"), ("gefen", "llama")]
CASES.append(("gefen_muon", "llama"))


@pytest.mark.parametrize(("optimizer", "family"), CASES)
def test_lightning_resume_is_bit_exact(optimizer, family, tmp_path):
    saver = lightning.pytorch.callbacks.ModelCheckpoint(
        dirpath=str(tmp_path / "ckpt"),
        every_n_train_steps=SAVE_AT,
        save_top_k=-1,
        filename="{step}",
    )
    full = _LanguageModel(BUILDERS[family], optimizer)
    first = _trainer(tmp_path / "full", saver)
    first.fit(full, _loader())
    assert first.global_step == STEPS
    kept = first.optimizers[0]
    assert isinstance(kept, GefenMuon if optimizer == "gefen_muon" else Gefen)
    checkpoint = tmp_path / "ckpt" / f"step={SAVE_AT}.ckpt"
    assert checkpoint.is_file(), sorted(p.name for p in (tmp_path / "ckpt").iterdir())

    resumed = _LanguageModel(BUILDERS[family], optimizer)
    second = _trainer(tmp_path / "resumed")
    second.fit(resumed, _loader(), ckpt_path=str(checkpoint))
    assert second.global_step == STEPS
    expected = dict(full.named_parameters())
    for name, value in resumed.named_parameters():
        assert torch.equal(value, expected[name]), name
    theirs = second.optimizers[0].state_dict()["state"]
    for index, state in kept.state_dict()["state"].items():
        for key, value in state.items():
            assert torch.equal(theirs[index][key], value), (index, key)


def _loss_after_fit(tmp_path, optimizer: str) -> tuple[float, float]:
    module = _LanguageModel(tiny_gpt2, optimizer)
    batch = token_batch(SAVE_AT * BATCH, seed=3)
    with torch.no_grad():
        before = float(module.training_step(batch, 0))
    _trainer(tmp_path).fit(module, _loader())
    with torch.no_grad():
        return before, float(module.training_step(batch, 0))


def test_lightning_gefen_trains_like_adamw(tmp_path):
    """Six Lightning steps with Gefen and with torch.optim.AdamW from the same init:
    both lower the loss (4.158 -> 3.883 and 3.858); final losses within 3%."""
    before, gefen = _loss_after_fit(tmp_path / "gefen", "gefen")
    _, adamw = _loss_after_fit(tmp_path / "adamw", "adamw")
    assert gefen < 0.97 * before and adamw < 0.97 * before, (before, gefen, adamw)
    assert abs(gefen / adamw - 1) < 0.03, (gefen, adamw)
