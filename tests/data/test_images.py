"""Tests of the digits loader and the PNG folder loader."""

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits as sk_load_digits

from leantrain.data import load_digits, load_image_folder


def test_digits_split_is_fixed_and_complete():
    d = load_digits()
    sk = sk_load_digits()
    assert d.image_shape == (1, 8, 8) and d.num_classes == 10
    assert len(d.train_y) + len(d.val_y) == len(sk.target) == 1797
    assert len(d.val_y) == round(1797 * 0.2)
    # Every sklearn image appears exactly once, scaled to [0, 1].
    all_x = torch.cat([d.train_x, d.val_x]).flatten(1) * 16
    ref = torch.tensor(sk.data, dtype=torch.float32)
    key = lambda t: sorted(map(tuple, t.round().int().tolist()))  # noqa: E731
    assert key(all_x) == key(ref)
    assert float(d.train_x.max()) == 1.0 and float(d.train_x.min()) == 0.0
    again = load_digits()
    assert torch.equal(again.val_x, d.val_x) and torch.equal(again.val_y, d.val_y)
    assert not torch.equal(load_digits(seed=1).val_y, d.val_y)


def test_digits_labels_match_images():
    d = load_digits()
    sk = sk_load_digits()
    lookup = {
        tuple(row): int(t)
        for row, t in zip(sk.data.astype(int), sk.target, strict=True)
    }
    rows = (d.val_x.flatten(1) * 16).round().int().tolist()
    hits = [lookup.get(tuple(r)) == int(y) for r, y in zip(rows, d.val_y, strict=True)]
    assert all(hits)


def test_image_folder_loader(tmp_path):
    import matplotlib.image as mpimg

    rng = np.random.default_rng(0)
    for cls in ("cat", "dog"):
        (tmp_path / cls).mkdir()
        for i in range(5):
            mpimg.imsave(tmp_path / cls / f"{i}.png", rng.random((6, 6, 3)))
    split = load_image_folder(tmp_path, val_fraction=0.2)
    assert split.classes == ("cat", "dog")
    assert split.image_shape[1:] == (6, 6) and split.image_shape[0] in (3, 4)
    assert len(split.train_y) == 8 and len(split.val_y) == 2
    assert sorted(torch.cat([split.train_y, split.val_y]).tolist()) == [0] * 5 + [1] * 5


def test_image_folder_errors(tmp_path):
    import matplotlib.image as mpimg

    with pytest.raises(ValueError, match="does not exist"):
        load_image_folder(tmp_path / "nope")
    with pytest.raises(ValueError, match="no PNG"):
        load_image_folder(tmp_path)
    (tmp_path / "a").mkdir()
    mpimg.imsave(tmp_path / "a" / "0.png", np.zeros((4, 4)))
    mpimg.imsave(tmp_path / "a" / "1.png", np.zeros((5, 5)))
    with pytest.raises(ValueError, match="same size"):
        load_image_folder(tmp_path)
