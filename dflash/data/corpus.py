"""The embedded corpus: the standard library's own source.

Every Python install has it, so the default run needs no download. Its tokens are
framed once per tokenizer and cached under cache_dir().
"""

from __future__ import annotations

import hashlib
import sys
import sysconfig
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from dflash.config.settings import DataConfig
from dflash.data.packing import Document, frame, stream
from dflash.data.sources import DataReport
from dflash.data.tokenizer import Tokenizer, encode_texts, special_ids, tokenizer_fingerprint
from dflash.files import cache_dir, replacing

# `--data embedded` (the default) trains on the target's own continuations of the
# corpus' held-in prefixes (dflash.offline.regenerate.embedded_regeneration, cached);
# `--data embedded-corpus` on the standard library source as it is. Both evaluate on
# the corpus' held-out files.
EMBEDDED = "embedded"
EMBEDDED_CORPUS = "embedded-corpus"

# Bump when the embedded token cache layout or the packing rules change.
_CACHE_VERSION = 3


def stdlib_source_files() -> list[Path]:
    """The standard library's top-level-package .py files, sorted for determinism.

    Tests and site-packages are excluded so the corpus is the same on every
    install of one Python version.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if rel[0] in ("site-packages", "dist-packages", "test", "idlelib", "lib2to3"):
            continue
        if any(p in ("tests", "test") for p in rel[:-1]):
            continue
        files.append(path)
    return files


def is_heldout(name: str, heldout_fraction: float) -> bool:
    """Deterministic document-level split: the hash of a document's key decides its side
    (data files: dflash.data.packing.content_key; the embedded corpus keys its files by
    their name inside the standard library, the same on every machine)."""
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < heldout_fraction


def embedded_corpus(
    split: str = "train", heldout_fraction: float = DataConfig.heldout_fraction
) -> list[str]:
    """Texts of the embedded corpus for `split` ('train' or 'heldout')."""
    if split not in ("train", "heldout"):
        raise ValueError(f"unknown split {split!r}: expected 'train' or 'heldout'")
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for path in stdlib_source_files():
        name = path.relative_to(root).as_posix()
        if is_heldout(name, heldout_fraction) != (split == "heldout"):
            continue
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return texts


@dataclass
class Corpus:
    """Framed train and held-out documents (before packing)."""

    train: list[Document]
    heldout: list[Document]
    report: DataReport = field(default_factory=DataReport)

    @cached_property
    def train_stream(self) -> tuple[np.ndarray, np.ndarray]:
        return stream(self.train)

    @cached_property
    def heldout_stream(self) -> tuple[np.ndarray, np.ndarray]:
        return stream(self.heldout)

    @property
    def train_ids(self) -> np.ndarray:
        return self.train_stream[0]

    @property
    def heldout_ids(self) -> np.ndarray:
        return self.heldout_stream[0]


def embedded_key(tokenizer: Tokenizer, heldout_fraction: float) -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    h = hashlib.sha256(f"v{_CACHE_VERSION} {sys.version} {heldout_fraction}".encode())
    h.update(tokenizer_fingerprint(tokenizer).encode())
    for path in stdlib_source_files():
        h.update(f"{path.relative_to(root)} {path.stat().st_size}\n".encode())
    return h.hexdigest()[:20]


def _split_stream(ids: np.ndarray, mask: np.ndarray, starts: np.ndarray) -> list[Document]:
    bounds = list(starts[1:]) if len(starts) else []
    return [
        Document("", i, m)
        for i, m in zip(np.split(ids, bounds), np.split(mask, bounds), strict=True)
    ]


def embedded_tokens(
    tokenizer: Tokenizer, heldout_fraction: float = DataConfig.heldout_fraction
) -> Corpus:
    """The embedded corpus tokenized and framed once per tokenizer, cached under cache_dir()."""
    path = cache_dir() / "tokens" / f"embedded-{embedded_key(tokenizer, heldout_fraction)}.npz"
    names = ("train", "h")
    if path.exists():
        try:
            with np.load(path) as z:
                splits = [
                    _split_stream(*(z[f"{n}_{k}"] for k in ("ids", "mask", "starts")))
                    for n in names
                ]
            return Corpus(*splits)
        except (OSError, ValueError, KeyError):
            pass  # a damaged cache is rebuilt below
    eos, bos = special_ids(tokenizer)
    splits, arrays = [], {}
    for name, split in zip(names, ("train", "heldout"), strict=True):
        texts = embedded_corpus(split, heldout_fraction)
        plain = [Document("", i, np.ones(len(i), bool)) for i in encode_texts(tokenizer, texts)]
        docs = [frame(d, bos, eos) for d in plain if len(d.ids)]
        splits.append(docs)
        arrays[f"{name}_ids"], arrays[f"{name}_mask"] = stream(docs)
        arrays[f"{name}_starts"] = np.cumsum([0] + [len(d.ids) for d in docs[:-1]]).astype(np.int64)
    with replacing(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, **arrays)
    return Corpus(*splits)
