"""Tokens: the byte tokenizer of the built-in target, and encoding with any tokenizer.

A tokenizer here is either `ByteTokenizer` or a Hugging Face tokenizer; these helpers
are the only place that tells the two apart.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

import numpy as np

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

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


Tokenizer: TypeAlias = "ByteTokenizer | PreTrainedTokenizerBase"
"""What every `tokenizer` argument of dflash is (annotations only: never evaluated)."""


def encode_texts(tokenizer: Tokenizer, texts: list[str]) -> list[np.ndarray]:
    """Token ids (int32) of each text, without special tokens."""
    if isinstance(tokenizer, ByteTokenizer):
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int32) for t in texts]
    if not texts:
        return []
    out = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    return [np.asarray(ids, dtype=np.int32) for ids in out]


def decode_text(tokenizer: Tokenizer, ids: list[int]) -> str:
    """Text of token ids, special tokens left out."""
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.decode(ids)
    return tokenizer.decode(ids, skip_special_tokens=True)


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """Stable id of a tokenizer's vocabulary, for cache keys."""
    if isinstance(tokenizer, ByteTokenizer):
        return f"byte-{tokenizer.vocab_size}"
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    return hashlib.sha256(vocab.encode("utf-8")).hexdigest()[:16]


def special_ids(tokenizer: Tokenizer) -> tuple[int | None, int | None]:
    """(EOS, BOS) ids; chat documents rendered by a template already carry their own BOS."""
    return getattr(tokenizer, "eos_token_id", None), getattr(tokenizer, "bos_token_id", None)
