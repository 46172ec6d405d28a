"""A GPT cut into pipeline stages and trained with ``torch.distributed.pipelining``.

Pipeline parallelism is the usual alternative to layer-parallel MGRIT for a model too
deep for one device: rank ``p`` of ``P`` owns the contiguous layers
``p N/P .. (p+1) N/P - 1`` (the same layers MGRIT's chunk ``p`` owns), the batch is cut
into ``M`` micro-batches, and a schedule (GPipe: all forwards, then all backwards;
1F1B: one forward, one backward in the steady state) streams them through the
stages. The gradients are exact: the mean of the micro-batch mean losses, with
``scale_grads``, is the full-batch mean loss.

:class:`GPTPipeline` wraps the stage of one rank: the first stage also embeds the
tokens, the last one applies the head and the loss. Every rank builds the whole model
from the same seed and keeps references to the parts it owns, so parameter names and
checkpoints stay those of :class:`~leantrain.models.GPT`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from leantrain.layer_parallel._checks import check_int
from leantrain.models.gpt import GPT, lm_loss

SCHEDULES = ("gpipe", "1f1b")


def check_pipeline_settings(
    n_layer: int, stages: int, batch: int, micro_batches: int, schedule: str
) -> None:
    """Refuse a pipeline layout that cannot run, naming the offending value.

    Raises:
        ValueError: when ``stages`` does not divide ``n_layer``, ``micro_batches``
            does not divide ``batch``, the schedule is unknown, or 1F1B has fewer
            micro-batches than stages (it needs one in flight per stage).
    """
    check_int("n_layer", n_layer, 1)
    check_int("stages", stages, 1)
    check_int("batch", batch, 1)
    check_int("micro_batches", micro_batches, 1)
    if n_layer % stages:
        raise ValueError(
            f"depth n_layer={n_layer} is not divisible by the {stages} pipeline "
            "stages (ranks); every stage must own the same number of layers"
        )
    if batch % micro_batches:
        raise ValueError(
            f"micro_batches={micro_batches} does not divide the batch size {batch}"
        )
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if schedule == "1f1b" and micro_batches < stages:
        raise ValueError(
            f"schedule '1f1b' needs micro_batches >= stages, got micro_batches="
            f"{micro_batches} for {stages} stages (use 'gpipe')"
        )


class GPTStage(nn.Module):
    """Layers ``first .. last - 1`` of a GPT, plus the embedding or head at the ends.

    Holds references to ``model``'s own modules (no copies): gradients land on the
    model's parameters.
    """

    def __init__(self, model: GPT, stage: int, stages: int) -> None:
        super().__init__()
        per = len(model.stack.steps) // stages
        self.is_first, self.is_last = stage == 0, stage == stages - 1
        self.dt = model.stack.dt
        self.blocks = nn.ModuleList(model.stack.steps[stage * per : (stage + 1) * per])
        if self.is_first:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        if self.is_last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:  # token ids -> embedded state
            pos = torch.arange(x.size(1), device=x.device)
            x = self.drop(self.wte(x) + self.wpe(pos))
        for block in self.blocks:
            x = block(x, self.dt)
        return self.lm_head(self.ln_f(x)) if self.is_last else x


class GPTPipeline:
    """One rank's stage of a GPT trained with a ``torch.distributed.pipelining``
    schedule over the default process group (one stage per rank).

    Args:
        model: the whole GPT, built identically on every rank (same seed).
        schedule: ``"gpipe"`` or ``"1f1b"``.
        micro_batches: micro-batches ``M`` per step.
        batch: the batch size (micro-batch shapes are fixed up front).
        seq_len: tokens per sequence.

    Raises:
        ValueError: for a layout :func:`check_pipeline_settings` refuses.
    """

    def __init__(
        self, model: GPT, schedule: str, micro_batches: int, batch: int, seq_len: int
    ) -> None:
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
        )

        self.rank, self.stages = dist.get_rank(), dist.get_world_size()
        n_layer = len(model.stack.steps)
        check_pipeline_settings(n_layer, self.stages, batch, micro_batches, schedule)
        self.module = GPTStage(model, self.rank, self.stages)
        mb = batch // micro_batches
        dtype = next(model.parameters()).dtype
        self.device = device = next(model.parameters()).device
        d, vocab = model.config.d_model, model.config.vocab_size
        # The example tensors are the stage's static metadata; requires_grad on
        # them is what makes a stage send and expect activation gradients.
        hidden = torch.zeros(
            mb, seq_len, d, dtype=dtype, device=device, requires_grad=True
        )
        first, last = self.module.is_first, self.module.is_last
        tokens = torch.zeros(mb, seq_len, dtype=torch.long, device=device)
        example_in = tokens if first else hidden
        logits = torch.zeros(
            mb, seq_len, vocab, dtype=dtype, device=device, requires_grad=True
        )
        example_out = logits if last else hidden
        self.stage = PipelineStage(
            self.module,
            self.rank,
            self.stages,
            device,
            input_args=(example_in,),
            output_args=(example_out,),
        )
        cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        self.schedule = cls(self.stage, micro_batches, loss_fn=lm_loss)

    def parameters(self) -> list[nn.Parameter]:
        """The parameters this rank owns and trains."""
        return list(self.module.parameters())

    def step(self, idx: torch.Tensor, targets: torch.Tensor) -> float:
        """Forward and backward of one batch; returns the full-batch mean loss
        (broadcast from the last stage, so every rank returns the same number).

        Gradients accumulate on the owned parameters (zero them before).
        """
        losses: list[torch.Tensor] = []
        if self.module.is_first:
            self.schedule.step(idx, target=targets, losses=losses)
        else:
            self.schedule.step(target=targets, losses=losses)
        loss = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.module.is_last:
            loss = torch.stack([v.detach() for v in losses]).double().mean()
        dist.broadcast(loss, self.stages - 1)
        return float(loss)
