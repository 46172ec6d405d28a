"""Synthetic tasks whose optimal loss is known, so a training run can be judged.

- :func:`teacher_student_regression`: a linear teacher plus Gaussian noise; the best
  possible mean squared error is the noise variance.
- :func:`teacher_classification`: labels sampled from a fixed teacher MLP's softmax;
  the best possible cross-entropy is the mean entropy of the teacher's distribution.
- :func:`sequence_task`: copy or reverse a random sequence; the target is a function of
  the source, so the best loss on target tokens is 0 and the best accuracy is 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from leantrain.data.batches import _check_positive


@dataclass(frozen=True)
class RegressionTask:
    """``y = x @ weight.T + bias + noise_std * N(0, I)``.

    Attributes:
        x, y: training inputs (N, d_in) and targets (N, d_out).
        val_x, val_y: held-out data from the same distribution.
        weight, bias: the teacher, (d_out, d_in) and (d_out,).
        noise_std: standard deviation of the label noise.
    """

    x: torch.Tensor
    y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor
    noise_std: float

    @property
    def optimal_loss(self) -> float:
        """Expected MSE (``F.mse_loss``, mean over elements) of the best predictor."""
        return self.noise_std**2

    def teacher(self, x: torch.Tensor) -> torch.Tensor:
        """The noise-free teacher prediction, the Bayes-optimal predictor."""
        return x @ self.weight.T + self.bias


def teacher_student_regression(
    n_train: int = 1024,
    n_val: int = 1024,
    d_in: int = 16,
    d_out: int = 4,
    noise_std: float = 0.1,
    seed: int = 0,
) -> RegressionTask:
    """A linear teacher with Gaussian label noise (inputs ~ N(0, I)).

    Example:
        >>> task = teacher_student_regression(noise_std=0.5)
        >>> task.optimal_loss
        0.25
    """
    for name, value in [("n_train", n_train), ("n_val", n_val)]:
        _check_positive(name, value)
    _check_positive("d_in", d_in)
    _check_positive("d_out", d_out)
    if not noise_std >= 0:
        raise ValueError(f"noise_std must be >= 0, got {noise_std!r}")
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(d_out, d_in, generator=g) / math.sqrt(d_in)
    bias = torch.randn(d_out, generator=g)
    x = torch.randn(n_train + n_val, d_in, generator=g)
    y = (
        x @ weight.T
        + bias
        + noise_std * torch.randn(n_train + n_val, d_out, generator=g)
    )
    return RegressionTask(
        x[:n_train], y[:n_train], x[n_train:], y[n_train:], weight, bias, noise_std
    )


@dataclass(frozen=True)
class ClassificationTask:
    """Labels sampled from ``softmax(teacher(x) / temperature)``.

    Attributes:
        x, y: training inputs (N, d_in) and int64 labels (N,).
        val_x, val_y: held-out data from the same distribution.
        teacher: the fixed teacher MLP (outputs logits already divided by temperature).
    """

    x: torch.Tensor
    y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor
    teacher: nn.Module

    @torch.no_grad()
    def optimal_loss(self, x: torch.Tensor | None = None) -> float:
        r"""Bayes-optimal expected cross-entropy :math:`E_x[H(p(\cdot|x))]` on ``x``.

        Defaults to the validation inputs. No model can have a lower expected
        cross-entropy on labels drawn from the teacher (Gibbs' inequality).
        """
        logp = F.log_softmax(self.teacher(self.val_x if x is None else x), dim=-1)
        return float(-(logp.exp() * logp).sum(-1).mean())


def teacher_classification(
    n_train: int = 2048,
    n_val: int = 2048,
    d_in: int = 16,
    n_classes: int = 4,
    hidden: int = 32,
    temperature: float = 0.5,
    seed: int = 0,
) -> ClassificationTask:
    """A random tanh MLP teacher; labels are sampled from its softmax.

    Lower ``temperature`` makes the labels closer to deterministic (optimal loss -> 0).

    Example:
        >>> task = teacher_classification(n_classes=3)
        >>> 0.0 < task.optimal_loss() < math.log(3)
        True
    """
    for name, value in [("n_train", n_train), ("n_val", n_val), ("d_in", d_in)]:
        _check_positive(name, value)
    _check_positive("hidden", hidden)
    if not isinstance(n_classes, int) or n_classes < 2:
        raise ValueError(f"n_classes must be an int >= 2, got {n_classes!r}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    g = torch.Generator().manual_seed(seed)
    # skip_init + our own generator: building a task never touches the global RNG.
    teacher = nn.Sequential(
        skip_init(nn.Linear, d_in, hidden),
        nn.Tanh(),
        skip_init(nn.Linear, hidden, n_classes),
    )
    with torch.no_grad():
        teacher[0].weight.copy_(torch.randn(hidden, d_in, generator=g) / d_in**0.5)
        teacher[0].bias.zero_()
        teacher[2].weight.copy_(
            torch.randn(n_classes, hidden, generator=g) / (hidden**0.5 * temperature)
        )
        teacher[2].bias.zero_()
    teacher.requires_grad_(False)
    x = torch.randn(n_train + n_val, d_in, generator=g)
    with torch.no_grad():
        probs = F.softmax(teacher(x), dim=-1)
    y = torch.multinomial(probs, 1, generator=g).squeeze(1)
    return ClassificationTask(
        x[:n_train], y[:n_train], x[n_train:], y[n_train:], teacher
    )


SEQUENCE_KINDS = ("copy", "reverse")


@dataclass(frozen=True)
class SequenceTask:
    """Source sequences and their targets (copy or reverse).

    Symbols are ``0..n_symbols-1``; ``bos = n_symbols`` starts the decoder input and
    ``sep = n_symbols + 1`` separates source and target in the decoder-only form.

    Attributes:
        src, tgt: training pairs, int64 (N, L).
        val_src, val_tgt: held-out pairs.
        kind: ``"copy"`` or ``"reverse"``.
        n_symbols: number of data symbols.
    """

    src: torch.Tensor
    tgt: torch.Tensor
    val_src: torch.Tensor
    val_tgt: torch.Tensor
    kind: str
    n_symbols: int

    @property
    def bos(self) -> int:
        return self.n_symbols

    @property
    def sep(self) -> int:
        return self.n_symbols + 1

    @property
    def vocab_size(self) -> int:
        return self.n_symbols + 2

    @property
    def optimal_loss(self) -> float:
        """0: the target is a function of the source (best accuracy 1)."""
        return 0.0

    def decoder_input(self, tgt: torch.Tensor) -> torch.Tensor:
        """Teacher forcing input ``[BOS, tgt[:-1]]`` (N, L) for an encoder-decoder."""
        bos = torch.full_like(tgt[:, :1], self.bos)
        return torch.cat([bos, tgt[:, :-1]], dim=1)

    def lm_pairs(
        self, src: torch.Tensor, tgt: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoder-only form: ``x = [src, SEP, tgt[:-1]]`` and ``y`` (N, 2L) where only
        the last L positions (predicting ``tgt``) count; the rest are -100, the
        ``ignore_index`` of ``F.cross_entropy``, because random source tokens cannot
        be predicted."""
        sep = torch.full_like(src[:, :1], self.sep)
        x = torch.cat([src, sep, tgt[:, :-1]], dim=1)  # (N, 2L)
        ignore = torch.full_like(src, -100)
        y = torch.cat([ignore, tgt], dim=1)  # (N, 2L)
        return x, y


def sequence_task(
    kind: str = "reverse",
    n_train: int = 1024,
    n_val: int = 256,
    length: int = 8,
    n_symbols: int = 10,
    seed: int = 0,
) -> SequenceTask:
    """Uniform random sources of ``length`` symbols and their copy or reversal.

    Example:
        >>> task = sequence_task("reverse", n_train=4, length=5)
        >>> torch.equal(task.tgt, task.src.flip(1))
        True
    """
    if kind not in SEQUENCE_KINDS:
        raise ValueError(f"kind must be one of {SEQUENCE_KINDS}, got {kind!r}")
    for name, value in [("n_train", n_train), ("n_val", n_val), ("length", length)]:
        _check_positive(name, value)
    _check_positive("n_symbols", n_symbols)
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(n_symbols, (n_train + n_val, length), generator=g)
    tgt = src.clone() if kind == "copy" else src.flip(1)
    return SequenceTask(
        src[:n_train], tgt[:n_train], src[n_train:], tgt[n_train:], kind, n_symbols
    )
