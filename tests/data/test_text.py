"""Tests of the byte-level text corpora."""

import sysconfig
from pathlib import Path

import pytest
import torch

from leantrain.data import (
    STDLIB_MODULES,
    TextCorpus,
    load_corpus,
    load_stdlib_text,
    load_text,
    split_bytes,
    stdlib_files,
)


def test_stdlib_files_are_the_listed_modules_in_order():
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files()
    assert len(files) >= len(STDLIB_MODULES) - 2  # an odd installation may lack one
    names = [f.relative_to(root).as_posix() for f in files]
    # Each file is module.py or module/__init__.py, in STDLIB_MODULES order.
    expected = []
    for m in STDLIB_MODULES:
        rel = m.replace(".", "/")
        for cand in (rel + ".py", rel + "/__init__.py"):
            if (root / cand).is_file():
                expected.append(cand)
                break
    assert names == expected


def test_stdlib_corpus_is_the_concatenated_files_split_at_90_percent():
    corpus = load_stdlib_text()
    raw = b"\n".join(Path(f).read_bytes() for f in corpus.files)
    n_val = round(len(raw) * 0.1)
    assert corpus.train.dtype == torch.uint8 and corpus.vocab_size == 256
    assert bytes(corpus.train.tolist()) == raw[:-n_val]
    assert bytes(corpus.val.tolist()) == raw[-n_val:]
    assert len(raw) > 500_000
    again = load_corpus("stdlib")
    assert torch.equal(again.train, corpus.train) and again.files == corpus.files


def test_encode_decode_round_trip():
    text = "déf f(x):\n    return x ** 2  # ünïcode"
    tokens = TextCorpus.encode(text)
    assert tokens.dtype == torch.long and int(tokens.max()) < 256
    assert len(tokens) == len(text.encode("utf-8"))
    assert TextCorpus.decode(tokens) == text


def test_load_text_file_and_folder(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.py").write_text("print('z')\n" * 20)
    (tmp_path / "a.txt").write_text("hello world\n" * 20)
    (tmp_path / "skip.bin").write_bytes(b"\x00" * 100)
    folder = load_text(tmp_path)
    raw = (tmp_path / "a.txt").read_bytes() + b"\n" + (tmp_path / "b/z.py").read_bytes()
    assert folder.files == (str(tmp_path / "a.txt"), str(tmp_path / "b" / "z.py"))
    assert bytes(torch.cat([folder.train, folder.val]).tolist()) == raw
    single = load_corpus(str(tmp_path / "a.txt"), val_fraction=0.5)
    assert len(single.train) == len(single.val) == 120


def test_load_text_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_text(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="holds no"):
        load_text(tmp_path)
    (tmp_path / "tiny.txt").write_text("ab")
    with pytest.raises(ValueError, match="too short"):
        load_text(tmp_path / "tiny.txt")
    with pytest.raises(ValueError, match="val_fraction"):
        split_bytes(b"x" * 100, 1.0)
