"""Corpora, tokenization, packing and loss masks.

The embedded corpus is the Python standard library's own source: every Python
install has it, so the default run needs no download.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Byte-level vocabulary: ids 0..255 are raw bytes, then the special tokens.
PAD_ID, BOS_ID, EOS_ID, MASK_ID = 256, 257, 258, 259
BYTE_VOCAB_SIZE = 260


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes plus PAD/BOS/EOS/MASK; the tokenizer of the built-in tiny target."""

    vocab_size: int = BYTE_VOCAB_SIZE
    pad_token_id: int = PAD_ID
    bos_token_id: int = BOS_ID
    eos_token_id: int = EOS_ID
    mask_token_id: int = MASK_ID

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


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
    """Deterministic document-level split: a document's hash decides its side."""
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < heldout_fraction


def embedded_corpus(split: str = "train", heldout_fraction: float = 0.05) -> list[str]:
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
