"""Synthetic images with a known answer: small shapes at random places, in noise.

Each class is one fixed ``k x k`` binary shape. An image of class ``c`` is shape ``c``
pasted at a uniformly random position of an empty ``H x H`` canvas, plus Gaussian
pixel noise. The noise makes classes overlap, so even the best classifier has a
loss above 0, and that loss is known exactly: the posterior over classes is a sum
over the ``(H - k + 1)^2`` positions of Gaussian likelihoods
(:meth:`ShapesTask.bayes_logits`). Any number of images can be drawn, so training
can see fresh images every step and a validation set can be made large: the final
validation loss of a run is then a property of the training, not of a few
hard validation images (unlike the 360 digits).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from leantrain.data.batches import _check_positive
from leantrain.data.images import ImageSplit


@dataclass(frozen=True)
class ShapesTask:
    """Shape images and the exact Bayes posterior of their generator.

    Attributes:
        split: training and validation images (N, 1, H, H) with labels.
        templates: (n_classes, k, k) float32 binary shapes, one per class.
        noise: standard deviation of the Gaussian pixel noise.
    """

    split: ImageSplit
    templates: torch.Tensor
    noise: float
    label_noise: float = 0.0

    @torch.no_grad()
    def bayes_logits(self, images: torch.Tensor) -> torch.Tensor:
        r"""Log-posterior of each label, (B, n_classes): the Bayes classifier's logits.

        :math:`\log p(x | c) = \log \frac{1}{P} \sum_{pos}
        \exp(-\lVert x - T_{c,pos} \rVert^2 / 2\sigma^2)`; the term
        :math:`\lVert x \rVert^2` is the same for every class and drops out, leaving
        the correlation of ``x`` with the shape at each position (a ``conv2d``).
        Classes are equally likely; label noise mixes in the uniform distribution.
        """
        t = self.templates.to(images.dtype).unsqueeze(1)  # (C, 1, k, k)
        corr = F.conv2d(images, t)  # (B, C, P_h, P_w): <x, T_c at pos>
        half_norm = 0.5 * t.square().sum(dim=(1, 2, 3)).view(1, -1, 1, 1)
        energy = (corr - half_norm) / self.noise**2
        clean = torch.log_softmax(torch.logsumexp(energy.flatten(2), dim=-1), dim=-1)
        if self.label_noise == 0.0:
            return clean
        # A label is kept with probability 1 - eps, else drawn uniformly:
        # p(label | x) = (1 - eps) p(shape | x) + eps / C.
        n_classes = clean.shape[-1]
        return torch.logaddexp(
            clean + math.log1p(-self.label_noise),
            torch.full_like(clean, math.log(self.label_noise / n_classes)),
        )

    def optimal_loss(self) -> float:
        """Bayes-optimal cross-entropy on the validation images (no model does better
        in expectation)."""
        logits = self.bayes_logits(self.split.val_x.double())
        return float(F.cross_entropy(logits, self.split.val_y))


def _distinct_shapes(n: int, k: int, lit: int, g: torch.Generator) -> torch.Tensor:
    """``n`` different ``k x k`` binary shapes with ``lit`` pixels each, none a shift
    of another inside the ``k x k`` box (a shifted copy would be a second class with
    the same look at most positions)."""
    shapes: list[torch.Tensor] = []
    seen: set[bytes] = set()
    for _ in range(10_000):
        if len(shapes) == n:
            break
        flat = torch.zeros(k * k)
        flat[torch.randperm(k * k, generator=g)[:lit]] = 1.0
        shape = flat.view(k, k)
        rows, cols = shape.nonzero(as_tuple=True)
        # Normal form up to shifts: the lit pixels moved to the top-left corner.
        key = torch.stack([rows - rows.min(), cols - cols.min()]).numpy().tobytes()
        if key not in seen:
            seen.add(key)
            shapes.append(shape)
    if len(shapes) < n:
        raise ValueError(f"cannot draw {n} distinct {k}x{k} shapes with {lit} pixels")
    return torch.stack(shapes)


def _render(
    templates: torch.Tensor,
    n: int,
    image_size: int,
    noise: float,
    label_noise: float,
    g: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    n_classes, k, _ = templates.shape
    span = image_size - k + 1
    y = torch.randint(n_classes, (n,), generator=g)
    rows = torch.randint(span, (n,), generator=g)
    cols = torch.randint(span, (n,), generator=g)
    x = torch.zeros(n, image_size, image_size)
    for dr in range(k):  # paste: k^2 vectorised scatters instead of n Python loops
        for dc in range(k):
            x[torch.arange(n), rows + dr, cols + dc] = templates[y, dr, dc]
    x += noise * torch.randn(n, image_size, image_size, generator=g)
    relabel = torch.rand(n, generator=g) < label_noise
    labels = torch.where(relabel, torch.randint(n_classes, (n,), generator=g), y)
    return x.unsqueeze(1), labels


def shape_images(
    n_train: int = 32768,
    n_val: int = 4096,
    image_size: int = 8,
    n_classes: int = 8,
    shape_size: int = 3,
    lit: int = 5,
    noise: float = 0.6,
    label_noise: float = 0.0,
    seed: int = 0,
) -> ShapesTask:
    """Draw a shapes task (see the module docstring); deterministic for a seed.

    Args:
        n_train, n_val: number of training and validation images.
        image_size: side H of the square grey images (1 channel).
        n_classes: number of shapes.
        shape_size: side k of a shape (``k <= H``).
        lit: pixels set to 1 in each shape (``1 <= lit <= k*k``).
        noise: standard deviation of the pixel noise (> 0).
        label_noise: probability that a label is replaced by a uniformly drawn
            class (in [0, 1)); the images stay those of the true shape.
        seed: seed of the task's own generator (the global RNG is not touched).

    Example:
        >>> task = shape_images(n_train=64, n_val=256, n_classes=4)
        >>> task.split.train_x.shape, 0.0 < task.optimal_loss() < math.log(4)
        (torch.Size([64, 1, 8, 8]), True)
    """
    for name, value in [
        ("n_train", n_train),
        ("n_val", n_val),
        ("image_size", image_size),
        ("shape_size", shape_size),
        ("lit", lit),
    ]:
        _check_positive(name, value)
    if isinstance(n_classes, bool) or not isinstance(n_classes, int) or n_classes < 2:
        raise ValueError(f"n_classes must be an int >= 2, got {n_classes!r}")
    if shape_size > image_size:
        raise ValueError(
            f"shape_size={shape_size} must be at most image_size={image_size}"
        )
    if lit > shape_size**2:
        raise ValueError(f"lit={lit} must be at most shape_size**2={shape_size**2}")
    if not (isinstance(noise, (int, float)) and math.isfinite(noise) and noise > 0):
        raise ValueError(f"noise must be a finite number > 0, got {noise!r}")
    if not (isinstance(label_noise, (int, float)) and 0 <= label_noise < 1):
        raise ValueError(f"label_noise must be in [0, 1), got {label_noise!r}")
    g = torch.Generator().manual_seed(seed)
    templates = _distinct_shapes(n_classes, shape_size, lit, g)
    draw = (image_size, float(noise), float(label_noise), g)
    tx, ty = _render(templates, n_train, *draw)
    vx, vy = _render(templates, n_val, *draw)
    classes = tuple(f"shape{c}" for c in range(n_classes))
    split = ImageSplit(tx, ty, vx, vy, classes)
    return ShapesTask(split, templates, float(noise), float(label_noise))
