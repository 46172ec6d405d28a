"""Tests of the synthetic tasks: each one's stated optimum is reached by its teacher."""

import math

import pytest
import torch
import torch.nn.functional as F

from leantrain.data import (
    sequence_task,
    teacher_classification,
    teacher_student_regression,
)


def test_regression_teacher_reaches_noise_variance():
    task = teacher_student_regression(n_val=4096, d_out=4, noise_std=0.3, seed=1)
    n = task.val_y.numel()
    mse = F.mse_loss(task.teacher(task.val_x), task.val_y).item()
    # Mean of n squared N(0, s^2) variables: relative std sqrt(2/n); allow 5 sigma.
    assert abs(mse / task.optimal_loss - 1) < 5 * math.sqrt(2 / n)
    assert task.optimal_loss == pytest.approx(0.09)


def test_regression_least_squares_student_approaches_the_optimum():
    task = teacher_student_regression(n_train=2048, n_val=2048, noise_std=0.2)
    ones = torch.ones(len(task.x), 1)
    A = torch.cat([task.x, ones], 1).double()
    sol = torch.linalg.lstsq(A, task.y.double()).solution
    W, b = sol[:-1].T.float(), sol[-1].float()
    torch.testing.assert_close(W, task.weight, atol=0.03, rtol=0)
    val = F.mse_loss(task.val_x @ W.T + b, task.val_y).item()
    # Excess risk of least squares is ~ opt * (d+1)/n; the optimum bounds it below.
    assert task.optimal_loss * 0.9 < val < task.optimal_loss * 1.15


def test_classification_labels_follow_the_teacher():
    task = teacher_classification(n_val=8192, n_classes=4, seed=2)
    with torch.no_grad():
        probs = F.softmax(task.teacher(task.val_x), -1)
        ce = F.cross_entropy(task.teacher(task.val_x), task.val_y, reduction="none")
    # Teacher's cross-entropy on sampled labels = its mean entropy, up to noise.
    tol = 5 * ce.std().item() / math.sqrt(len(ce))
    assert abs(ce.mean().item() - task.optimal_loss()) < tol
    # Label frequencies match the teacher's mean probabilities.
    freq = F.one_hot(task.val_y, 4).float().mean(0)
    mean_p = probs.mean(0)
    assert torch.all((freq - mean_p).abs() < 5 * (mean_p * (1 - mean_p) / 8192).sqrt())
    assert 0 < task.optimal_loss() < math.log(4)


def test_classification_temperature_sharpens_labels():
    soft = teacher_classification(temperature=2.0).optimal_loss()
    sharp = teacher_classification(temperature=0.1).optimal_loss()
    assert sharp < 0.3 < soft


def test_tasks_are_seeded_and_leave_the_global_rng_alone():
    torch.manual_seed(0)
    before = torch.rand(1)
    torch.manual_seed(0)
    a = teacher_classification(seed=3)
    after = torch.rand(1)
    assert torch.equal(before, after)
    b = teacher_classification(seed=3)
    assert torch.equal(a.y, b.y) and torch.equal(a.x, b.x)
    r1, r2 = teacher_student_regression(seed=4), teacher_student_regression(seed=4)
    assert torch.equal(r1.y, r2.y)


@pytest.mark.parametrize("kind", ["copy", "reverse"])
def test_sequence_targets(kind):
    task = sequence_task(kind, n_train=50, n_val=10, length=7, n_symbols=5)
    for src, tgt in zip(task.src.tolist(), task.tgt.tolist(), strict=True):
        assert tgt == (src if kind == "copy" else src[::-1])
    assert int(task.src.max()) < 5 and task.vocab_size == 7
    assert task.optimal_loss == 0.0
    dec_in = task.decoder_input(task.tgt)
    assert bool((dec_in[:, 0] == task.bos).all())
    assert torch.equal(dec_in[:, 1:], task.tgt[:, :-1])


def test_sequence_lm_pairs_layout():
    task = sequence_task("reverse", n_train=8, length=4)
    x, y = task.lm_pairs(task.src, task.tgt)
    assert x.shape == y.shape == (8, 8)
    assert torch.equal(x[:, :4], task.src) and bool((x[:, 4] == task.sep).all())
    assert bool((y[:, :4] == -100).all()) and torch.equal(y[:, 4:], task.tgt)
    # Position t predicts y[t] from x[:t+1]: target token k sits after SEP + k inputs.
    assert torch.equal(x[:, 5:], y[:, 4:-1])


@pytest.mark.parametrize(
    "call",
    [
        lambda: sequence_task("sort"),
        lambda: sequence_task(length=0),
        lambda: teacher_classification(n_classes=1),
        lambda: teacher_classification(temperature=0),
        lambda: teacher_student_regression(noise_std=-1),
        lambda: teacher_student_regression(d_in=0),
    ],
)
def test_bad_arguments_raise(call):
    with pytest.raises(ValueError):
        call()
