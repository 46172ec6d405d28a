"""Byte-level text corpora: the Python standard library's own source, or local files.

Nothing is ever downloaded. The default corpus is the source of a fixed list of
well-known standard-library modules read from the running interpreter's installation
(``sysconfig.get_paths()["stdlib"]``), so every machine with Python has it. Tokens are
bytes (vocabulary 256): no tokenizer, and any UTF-8 text round-trips exactly.

The corpus is deterministic for a given interpreter (the module sources differ a little
between Python versions, so losses are comparable within one Python version).
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

VOCAB_SIZE = 256  # bytes

# Modules present in CPython 3.10-3.13. A module that became a package (pathlib in 3.13,
# zipfile in 3.12) is found as ``name/__init__.py``; a module missing from an unusual
# installation is skipped (the remaining files keep their fixed order).
STDLIB_MODULES: tuple[str, ...] = (
    "argparse", "ast", "base64", "bisect", "calendar", "collections", "contextlib",
    "copy", "csv", "dataclasses", "difflib", "enum", "fractions", "functools", "heapq",
    "inspect", "json.decoder", "json.encoder", "logging", "os", "pathlib", "pprint",
    "random", "shutil", "statistics", "string", "subprocess", "tempfile", "textwrap",
    "threading", "typing", "zipfile",
)  # fmt: skip

# Below this many bytes the corpus is too small for the demos to mean anything.
_MIN_STDLIB_BYTES = 100_000
_TEXT_SUFFIXES = (".txt", ".py", ".md")


@dataclass(frozen=True)
class TextCorpus:
    """A byte-level corpus with a fixed train/validation split.

    Attributes:
        name: where the text came from (``"stdlib"`` or the path given).
        files: the files read, in the order they were concatenated.
        train: uint8 tensor of the first ``1 - val_fraction`` of the bytes.
        val: uint8 tensor of the last ``val_fraction`` of the bytes.
        vocab_size: 256 (one token per byte value).

    Example:
        >>> corpus = load_stdlib_text()
        >>> corpus.vocab_size, corpus.train.dtype
        (256, torch.uint8)
        >>> corpus.decode(corpus.encode("def f(): pass"))
        'def f(): pass'
    """

    name: str
    files: tuple[str, ...]
    train: torch.Tensor
    val: torch.Tensor
    vocab_size: int = VOCAB_SIZE

    @staticmethod
    def encode(text: str) -> torch.Tensor:
        """UTF-8 bytes of ``text`` as an int64 tensor of token ids."""
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)

    @staticmethod
    def decode(tokens: torch.Tensor) -> str:
        """Text from token ids (invalid UTF-8, e.g. a cut multi-byte char, gives �)."""
        return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def stdlib_files() -> list[Path]:
    """The standard-library source files of the default corpus, in corpus order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for module in STDLIB_MODULES:
        rel = Path(*module.split("."))
        for candidate in (rel.with_suffix(".py"), rel / "__init__.py"):
            if (root / candidate).is_file():
                files.append(root / candidate)
                break
    return files


def split_bytes(data: bytes, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``data`` into (train, val) uint8 tensors; val is the last fraction.

    A contiguous tail (not a random subset of windows) keeps validation text unseen:
    random windows would overlap the training windows.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    n_val = int(round(len(tokens) * val_fraction))
    if n_val < 2 or len(tokens) - n_val < 2:
        raise ValueError(
            f"text of {len(tokens)} bytes is too short for val_fraction={val_fraction}"
        )
    return tokens[:-n_val].clone(), tokens[-n_val:].clone()


def _read_concatenated(files: list[Path]) -> bytes:
    # A newline between files so one file's last line never runs into the next file.
    return b"\n".join(f.read_bytes() for f in files)


def load_stdlib_text(val_fraction: float = 0.1) -> TextCorpus:
    """The default corpus: source of :data:`STDLIB_MODULES` (about 1.5 MB).

    Args:
        val_fraction: fraction of the concatenated bytes (taken from the end) held out
            for validation.

    Raises:
        ValueError: if the installation has too few of the listed modules.
    """
    files = stdlib_files()
    data = _read_concatenated(files)
    if len(data) < _MIN_STDLIB_BYTES:
        raise ValueError(
            f"found only {len(data)} bytes of stdlib source in "
            f"{sysconfig.get_paths()['stdlib']!r}; need {_MIN_STDLIB_BYTES}"
        )
    train, val = split_bytes(data, val_fraction)
    return TextCorpus("stdlib", tuple(str(f) for f in files), train, val)


def load_text(path: str | os.PathLike, val_fraction: float = 0.1) -> TextCorpus:
    """Load a local text file, or every .txt/.py/.md file under a folder (sorted).

    Args:
        path: a file, or a folder searched recursively; files are concatenated in
            sorted order of their path relative to the folder.
        val_fraction: fraction of the bytes (from the end) held out for validation.

    Raises:
        ValueError: if ``path`` does not exist, or a folder holds no text files.
    """
    p = Path(path)
    if p.is_file():
        files = [p]
    elif p.is_dir():
        files = sorted(
            (f for f in p.rglob("*") if f.is_file() and f.suffix in _TEXT_SUFFIXES),
            key=lambda f: f.relative_to(p).as_posix(),
        )
        if not files:
            raise ValueError(
                f"folder {str(p)!r} holds no {'/'.join(_TEXT_SUFFIXES)} files"
            )
    else:
        raise ValueError(f"text path {str(p)!r} does not exist")
    train, val = split_bytes(_read_concatenated(files), val_fraction)
    return TextCorpus(str(p), tuple(str(f) for f in files), train, val)


def load_corpus(source: str = "stdlib", val_fraction: float = 0.1) -> TextCorpus:
    """``"stdlib"``: the embedded corpus; else a path for :func:`load_text`."""
    if source == "stdlib":
        return load_stdlib_text(val_fraction)
    return load_text(source, val_fraction)
