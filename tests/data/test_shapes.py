"""Tests of the shape images: the stated Bayes posterior against a brute-force one."""

import math

import pytest
import torch
import torch.nn.functional as F

from leantrain.data import shape_images


def _brute_force_log_posterior(task, images: torch.Tensor) -> torch.Tensor:
    """log p(label | x) by summing full Gaussian densities over every class and
    position, in float64 (keeps the ||x||^2 term the fast version drops)."""
    templates = task.templates.double()
    n_classes, k, _ = templates.shape
    size = images.shape[-1]
    x = images.double().squeeze(1)
    span = size - k + 1
    log_lik = torch.empty(x.shape[0], n_classes, dtype=torch.float64)
    for c in range(n_classes):
        terms = []
        for r in range(span):
            for s in range(span):
                canvas = torch.zeros(size, size, dtype=torch.float64)
                canvas[r : r + k, s : s + k] = templates[c]
                sq = (x - canvas).square().sum(dim=(1, 2))
                terms.append(-sq / (2 * task.noise**2))
        log_lik[:, c] = torch.logsumexp(torch.stack(terms, 1), 1) - math.log(span**2)
    clean = log_lik.softmax(-1)
    eps = task.label_noise
    return ((1 - eps) * clean + eps / n_classes).log()


@pytest.mark.parametrize("shape_size, label_noise", [(3, 0.0), (6, 0.2), (8, 0.1)])
def test_bayes_logits_equal_brute_force(shape_size, label_noise):
    task = shape_images(
        n_train=8,
        n_val=64,
        n_classes=5,
        shape_size=shape_size,
        lit=min(5, shape_size**2),
        noise=0.7,
        label_noise=label_noise,
        seed=3,
    )
    x = task.split.val_x
    got = task.bayes_logits(x.double())
    want = _brute_force_log_posterior(task, x)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_optimal_loss_beats_a_miscalibrated_classifier():
    task = shape_images(n_train=8, n_val=8192, noise=0.6, label_noise=0.1, seed=1)
    x, y = task.split.val_x.double(), task.split.val_y
    best = task.optimal_loss()
    assert 0.0 < best < math.log(8)
    # The same posterior, too sharp or too flat: worse on labels drawn from it.
    for scale in (0.7, 1.4):
        assert F.cross_entropy(scale * task.bayes_logits(x), y).item() > best


def test_label_noise_sets_the_floor_when_pixels_are_clean():
    eps, n_classes = 0.2, 8
    task = shape_images(
        n_train=8, n_val=4096, shape_size=8, lit=32, noise=0.05, label_noise=eps
    )
    keep = 1 - eps + eps / n_classes
    other = eps / n_classes
    floor = -(keep * math.log(keep) + (n_classes - 1) * other * math.log(other))
    # The shape is certain, so the expected loss is the label noise's entropy;
    # the sample mean of 4096 losses is within a few standard errors of it.
    assert task.optimal_loss() == pytest.approx(floor, rel=0.05)
    # And about eps * (1 - 1/C) of the labels disagree with the Bayes guess.
    guess = task.bayes_logits(task.split.val_x.double()).argmax(-1)
    wrong = (guess != task.split.val_y).double().mean().item()
    assert wrong == pytest.approx(eps * (1 - 1 / n_classes), abs=0.025)


def test_shapes_are_distinct_up_to_shifts_and_have_lit_pixels():
    task = shape_images(n_train=8, n_val=8, n_classes=10, shape_size=3, lit=4, seed=5)
    keys = set()
    for t in task.templates:
        assert t.sum().item() == 4
        rows, cols = t.nonzero(as_tuple=True)
        shifted = (rows - rows.min(), cols - cols.min())
        keys.add(tuple(tuple(v.tolist()) for v in shifted))
    assert len(keys) == 10


def test_deterministic_and_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = shape_images(n_train=32, n_val=16, seed=7)
    assert torch.equal(torch.get_rng_state(), before)
    b = shape_images(n_train=32, n_val=16, seed=7)
    c = shape_images(n_train=32, n_val=16, seed=8)
    assert torch.equal(a.split.train_x, b.split.train_x)
    assert torch.equal(a.split.val_y, b.split.val_y)
    assert not torch.equal(a.split.train_x, c.split.train_x)
    assert a.split.train_x.shape == (32, 1, 8, 8)
    assert a.split.train_x.dtype == torch.float32
    assert a.split.train_y.dtype == torch.int64
    assert a.split.num_classes == 8


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"n_train": 0}, "n_train"),
        ({"n_val": 2.5}, "n_val"),
        ({"n_classes": 1}, "n_classes"),
        ({"shape_size": 9}, "shape_size=9"),
        ({"lit": 10}, "lit=10"),
        ({"noise": 0.0}, "noise"),
        ({"noise": float("nan")}, "noise"),
        ({"label_noise": 1.0}, "label_noise"),
        ({"label_noise": -0.1}, "label_noise"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        shape_images(**kwargs)


def test_too_many_shapes_for_the_box_raises():
    # A 2x2 box with 1 lit pixel has a single shape up to shifts.
    with pytest.raises(ValueError, match="distinct"):
        shape_images(n_classes=2, shape_size=2, lit=1)
