"""Real text with no download: the Python standard library's own source files.

The default corpus is every ``*.py`` file under the running interpreter's standard
library folder (``sysconfig.get_paths()["stdlib"]``, skipping ``site-packages``), read in
sorted path order, so the same interpreter always yields the same bytes. Tokens are bytes
(vocabulary 256). ``path`` may instead name any text file or folder of text files.

The last ``val_fraction`` of the token stream is held out for validation loss.
"""
from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

VOCAB_SIZE = 256  # byte-level tokens
DEFAULT_MAX_BYTES = 4_000_000  # enough text for the labs, quick to read (~0.1 s)
TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".c", ".h", ".json", ".toml", ".cfg", ".ini", ".csv", ".tex"}


def stdlib_files() -> list[Path]:
    """The standard library's ``*.py`` files in a fixed (sorted) order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__", "dist-packages"))
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def text_files(path: str | os.PathLike) -> list[Path]:
    """Text files under ``path`` (or ``path`` itself), sorted.

    Raises FileNotFoundError (no such path, or a folder without text files) and ValueError
    (``path`` exists but is neither a regular file nor a folder, e.g. ``/dev/null``)."""
    if not str(path).strip():  # Path("") is the current folder: never read it by accident
        raise ValueError(f"--data {str(path)!r}: an empty path; give a text file or folder, or leave --data out "
                         f"for the Python standard library")
    p = Path(path)
    if p.is_file():
        if not os.access(p, os.R_OK):
            raise PermissionError(f"--data {path!s}: the file is not readable (permission denied)")
        return [p]
    if p.exists() and not p.is_dir():
        raise ValueError(f"--data {path!s}: exists but is not a regular text file or folder")
    if not p.is_dir():
        raise FileNotFoundError(f"--data {path!s}: no such file or folder")
    unreadable: list[str] = []
    files = []
    for dirpath, dirnames, filenames in os.walk(p, onerror=lambda e: unreadable.append(e.filename)):
        dirnames.sort()
        for name in filenames:
            f = Path(dirpath) / name
            if f.suffix.lower() in TEXT_SUFFIXES and f.is_file():
                (files if os.access(f, os.R_OK) and _readable(f) else unreadable).append(f)
            elif f.suffix.lower() in TEXT_SUFFIXES and f.is_symlink() and not f.exists():
                unreadable.append(f)   # a link to nothing
    files.sort(key=lambda f: f.relative_to(p).as_posix())
    if unreadable:   # never train on part of what was asked for without a word
        raise PermissionError(f"--data {path!s}: {len(unreadable)} file(s) or folder(s) in it cannot be read "
                              f"(permission denied, or a link to nothing), e.g. {unreadable[0]}; make them "
                              f"readable, or give a folder without them")
    if not files:
        raise FileNotFoundError(f"--data {path!s}: folder holds no text files ({sorted(TEXT_SUFFIXES)})")
    return files


def _readable(f: Path) -> bool:
    """True when ``f`` can be opened for reading (tried: root passes any ``os.access`` test)."""
    try:
        with open(f, "rb"):
            return True
    except OSError:
        return False


def looks_binary(data: bytes) -> bool:
    """True when ``data`` does not look like text: it holds a NUL byte, or over 30% of its first
    8 KiB are control bytes other than tab/newline/carriage return/form feed (UTF-8 text passes)."""
    head = data[:8192]
    if b"\0" in head:
        return True
    control = sum(1 for b in head if b < 32 and b not in (9, 10, 12, 13))
    return bool(head) and control > 0.3 * len(head)


def load_bytes(path: str | os.PathLike | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """The corpus as bytes: ``path`` (file or folder) or, when None, the standard library.

    Reads at most ``max_bytes`` in all (a 1 GB file costs ``max_bytes`` of memory, not 1 GB).
    Raises ValueError for a file given as ``path`` that does not look like text
    (:func:`looks_binary`); binary files found inside a folder are skipped."""
    files = stdlib_files() if path is None else text_files(path)
    chunks, total = [], 0
    for f in files:
        with open(f, "rb") as fh:
            data = fh.read(max_bytes - total)
        if path is not None and looks_binary(data):
            if Path(path).is_file():
                raise ValueError(f"--data {path!s}: does not look like text (binary bytes in its first 8 KiB)")
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(chunks)


@dataclass
class Corpus:
    """Byte tokens split into ``train`` and ``val`` (1-D ``torch.long`` tensors).

    ``get_batch(split, batch_size, block_size, step, seed)`` returns ``(x, y)`` of shape
    ``[batch_size, block_size]`` where ``y`` is ``x`` shifted by one token; the batch is a
    pure function of ``(split, step, seed)`` so every rank and the single-device reference
    draw the same data without communicating.
    """

    train: torch.Tensor
    val: torch.Tensor
    source: str

    @classmethod
    def load(cls, path=None, val_fraction: float = 0.1, max_bytes: int = DEFAULT_MAX_BYTES,
             block_size: int | None = None) -> "Corpus":
        """Read the corpus (see :func:`load_bytes`) and split off the last ``val_fraction``.

        ``block_size``: the sequence length the caller will ask for; checked here (ValueError naming
        both sizes) so that a too-short file fails before any training, not at validation.
        Raises FileNotFoundError / ValueError (see :func:`text_files`, :func:`load_bytes`)."""
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        raw = load_bytes(path, max_bytes)
        if len(raw) < 1024:
            where = "the standard library" if path is None else path
            raise ValueError(f"corpus from {where} has {len(raw)} bytes; need >= 1024")
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
        n_val = max(int(len(data) * val_fraction), 256)
        source = str(path) if path is not None else f"Python {sysconfig.get_python_version()} standard library"
        corpus = cls(data[:-n_val], data[-n_val:], source)
        if block_size is not None:
            corpus.check_block_size(block_size)
        return corpus

    def check_block_size(self, block_size: int) -> None:
        """ValueError unless both splits hold more than ``block_size + 1`` tokens."""
        for split in ("train", "val"):
            n = len(getattr(self, split))
            if n <= block_size + 1:
                raise ValueError(f"--data {self.source}: the {split} split has {n} tokens, too few for sequences "
                                 f"of {block_size} tokens (needs > {block_size + 1}); use a longer text or a "
                                 f"shorter --seq")

    def get_batch(self, split: str, batch_size: int, block_size: int, step: int = 0, seed: int = 0):
        """``(x, y)`` [batch_size, block_size] long. Raises ValueError for a split other than
        "train"/"val" or a block_size the split is too short for."""
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        data = {"train": self.train, "val": self.val}[split]
        if len(data) <= block_size + 1:
            raise ValueError(f"{split} split has {len(data)} tokens; block_size={block_size} needs more")
        g = torch.Generator().manual_seed(seed * 1_000_003 + step * 2 + (split == "val"))
        ix = torch.randint(len(data) - block_size - 1, (batch_size,), generator=g)
        x = torch.stack([data[i:i + block_size] for i in ix.tolist()])
        y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix.tolist()])
        return x, y
