"""Image data: scikit-learn's bundled 8x8 digits (no download), a PNG folder loader."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from leantrain._optional import optional_import


@dataclass(frozen=True)
class ImageSplit:
    """Images and labels with a fixed train/validation split.

    Attributes:
        train_x: float32 (N_train, C, H, W) in [0, 1].
        train_y: int64 (N_train,) class ids.
        val_x: float32 (N_val, C, H, W).
        val_y: int64 (N_val,).
        classes: class names, index = class id.
    """

    train_x: torch.Tensor
    train_y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor
    classes: tuple[str, ...]

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of one image."""
        return tuple(self.train_x.shape[1:])


def split_fixed(
    x: torch.Tensor, y: torch.Tensor, val_fraction: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shuffle rows with a seeded permutation and hold out the last ``val_fraction``.

    A shuffle (not a contiguous tail) because image datasets are often sorted by
    class or writer; the seed makes the split the same on every run.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    n = x.shape[0]
    n_val = int(round(n * val_fraction))
    if n_val < 1 or n_val >= n:
        raise ValueError(f"{n} samples are too few for val_fraction={val_fraction}")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    tr, va = perm[: n - n_val], perm[n - n_val :]
    return x[tr], y[tr], x[va], y[va]


def load_digits(val_fraction: float = 0.2, seed: int = 0) -> ImageSplit:
    """scikit-learn's 1797 handwritten digits, 8x8 grey levels 0..16 scaled to [0, 1].

    The data ship inside scikit-learn, so nothing is fetched.

    Args:
        val_fraction: fraction of images held out (default 360 of 1797).
        seed: seed of the fixed shuffle before the split.

    Raises:
        ImportError: scikit-learn is not installed: it comes with
            ``pip install "leantrain[compare]"``.

    Example:
        >>> d = load_digits()
        >>> d.train_x.shape[1:], d.num_classes
        (torch.Size([1, 8, 8]), 10)
    """
    datasets = optional_import("sklearn.datasets", "compare")
    bunch = datasets.load_digits()
    x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.long)
    tx, ty, vx, vy = split_fixed(x, y, val_fraction, seed)
    return ImageSplit(tx, ty, vx, vy, tuple(str(c) for c in bunch.target_names))


def load_image_folder(
    path: str | os.PathLike, val_fraction: float = 0.2, seed: int = 0
) -> ImageSplit:
    """PNG images in ``path/<class name>/*.png``, all of the same size.

    Class ids follow the sorted class-folder names. Grey images get C = 1; RGB(A)
    images keep their channels.

    Raises:
        ValueError: if the folder is missing, has no PNG files, or sizes differ.
        ImportError: matplotlib (which reads the PNGs) is not installed: it comes
            with ``pip install "leantrain[compare]"``.
    """
    mpimg = optional_import("matplotlib.image", "compare")

    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"image folder {str(root)!r} does not exist")
    classes = sorted(d.name for d in root.iterdir() if d.is_dir())
    images, labels = [], []
    for label, name in enumerate(classes):
        for f in sorted((root / name).glob("*.png")):
            img = np.asarray(mpimg.imread(f), dtype=np.float32)  # PNG -> [0, 1] floats
            img = img[None] if img.ndim == 2 else img.transpose(2, 0, 1)  # (C, H, W)
            if images and img.shape != images[0].shape:
                raise ValueError(
                    f"{f} has shape {img.shape}, expected {images[0].shape} "
                    "(all images must have the same size)"
                )
            images.append(img)
            labels.append(label)
    if not images:
        raise ValueError(f"no PNG files in class folders under {str(root)!r}")
    x = torch.from_numpy(np.stack(images))
    y = torch.tensor(labels, dtype=torch.long)
    tx, ty, vx, vy = split_fixed(x, y, val_fraction, seed)
    return ImageSplit(tx, ty, vx, vy, tuple(classes))
