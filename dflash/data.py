"""Corpora, tokenization, packing and loss masks.

The embedded corpus is the Python standard library's own source: every Python
install has it, so the default run needs no download. Batches are a pure function
of (seed, batch index), so a run resumes from a stored index and a pipeline can
hand indices to ranks without coordinating anything else.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash.errors import DFlashError

# Byte-level vocabulary: ids 0..255 are raw bytes, then the special tokens.
PAD_ID, BOS_ID, EOS_ID, MASK_ID = 256, 257, 258, 259
BYTE_VOCAB_SIZE = 260

# Bump when the embedded token cache layout or the packing rules change.
_CACHE_VERSION = 2


class DataError(DFlashError):
    """The corpus cannot be used; the message is one line naming file (and line)."""


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


# --------------------------------------------------------------------------- batches


@dataclass(frozen=True)
class Batch:
    """One training batch: token rows and where the loss counts."""

    batch_id: int
    input_ids: torch.Tensor  # [B, T] long
    loss_mask: torch.Tensor  # [B, T] bool

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def to(self, device: torch.device | str) -> Batch:
        return Batch(
            self.batch_id,
            self.input_ids.to(device, non_blocking=True),
            self.loss_mask.to(device, non_blocking=True),
        )


class PackedDataset:
    """Fixed-length rows; `batch(i)` depends only on (seed, i).

    The infinite row order is the concatenation of per-epoch permutations, each
    seeded by (seed, epoch); batch i takes rows [i*B, (i+1)*B) of that order, so
    any batch can be rebuilt without replaying the ones before it.
    """

    def __init__(
        self,
        ids: np.ndarray,
        mask: np.ndarray,
        batch_size: int,
        seed: int,
        stream: np.ndarray | None = None,
    ) -> None:
        assert ids.shape == mask.shape and ids.ndim == 2 and len(ids) > 0
        self.ids, self.mask = ids, mask
        # The unpacked token stream, so eval prompts do not depend on --seq-len.
        self.stream = stream if stream is not None else ids.reshape(-1)
        self.batch_size, self.seed = batch_size, seed
        self._perms: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def seq_len(self) -> int:
        return self.ids.shape[1]

    def _perm(self, epoch: int) -> np.ndarray:
        with self._lock:
            if epoch not in self._perms:
                if len(self._perms) > 4:
                    self._perms.pop(min(self._perms))
                rng = np.random.default_rng([self.seed, epoch])
                self._perms[epoch] = rng.permutation(len(self.ids))
            return self._perms[epoch]

    def row_indices(self, index: int) -> np.ndarray:
        """Row numbers of batch `index`."""
        if index < 0:
            raise IndexError(f"batch index {index} < 0")
        num_rows = len(self.ids)
        flat = np.arange(index * self.batch_size, (index + 1) * self.batch_size)
        return np.array([self._perm(int(f // num_rows))[f % num_rows] for f in flat])

    def batch(self, index: int) -> Batch:
        rows = self.row_indices(index)
        ids = torch.from_numpy(self.ids[rows].astype(np.int64))
        mask = torch.from_numpy(self.mask[rows].copy())
        return Batch(index, ids, mask)


# --------------------------------------------------------------------------- tokenizing


def _is_byte_tokenizer(tokenizer: Any) -> bool:
    return isinstance(tokenizer, ByteTokenizer)


def encode_texts(tokenizer: Any, texts: list[str]) -> list[np.ndarray]:
    """Token ids of each text, without special tokens."""
    if _is_byte_tokenizer(tokenizer):
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int32) for t in texts]
    if not texts:
        return []
    out = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    return [np.asarray(ids, dtype=np.int32) for ids in out]


def _render_plain_chat(tokenizer: Any, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """Turn-by-turn rendering for tokenizers without a chat template."""
    ids: list[np.ndarray] = []
    mask: list[np.ndarray] = []
    for msg in messages:
        header, body = encode_texts(tokenizer, [f"<|{msg['role']}|>\n", msg["content"] + "\n"])
        ids += [header, body]
        mask += [np.zeros(len(header), bool), np.full(len(body), msg["role"] == "assistant")]
    return np.concatenate(ids), np.concatenate(mask)


def _render_template_chat(tokenizer: Any, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """Chat template rendered turn by turn; loss only on assistant replies.

    Templates with `{% generation %}` give the assistant mask directly; others are
    rendered prefix by prefix, the assistant header (generation prompt) kept out of
    the loss.
    """
    try:
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        mask = np.asarray(out["assistant_masks"], dtype=bool)
        if mask.any():
            return np.asarray(out["input_ids"], dtype=np.int32), mask
    except (ValueError, KeyError, TypeError):
        pass  # the template has no generation markers: render by prefixes below
    segments: list[tuple[str, bool]] = []
    done = ""
    for i, msg in enumerate(messages):
        if msg["role"] == "assistant":
            head = tokenizer.apply_chat_template(
                messages[:i], tokenize=False, add_generation_prompt=True
            )
            segments.append((head[len(done) :] if head.startswith(done) else head, False))
            done = head
        text = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        segment = text[len(done) :] if text.startswith(done) else text
        segments.append((segment, msg["role"] == "assistant"))
        done = text
    encoded = encode_texts(tokenizer, [s for s, _ in segments])
    mask_parts = [np.full(len(e), m) for e, (_, m) in zip(encoded, segments, strict=True)]
    return np.concatenate(encoded), np.concatenate(mask_parts)


def encode_chat(tokenizer: Any, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(ids, loss mask) of one conversation; the mask holds on assistant turns only."""
    if getattr(tokenizer, "chat_template", None):
        return _render_template_chat(tokenizer, messages)
    return _render_plain_chat(tokenizer, messages)


# --------------------------------------------------------------------------- sources


@dataclass
class Document:
    name: str
    ids: np.ndarray  # [n] int32
    mask: np.ndarray  # [n] bool
    templated: bool = False  # rendered by a chat template, which adds its own BOS


def _check_messages(messages: Any, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list")
    for m in messages:
        ok = isinstance(m, dict) and isinstance(m.get("role"), str)
        if not ok or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: each message needs string 'role' and 'content'")
    return messages


def read_jsonl(path: Path, tokenizer: Any) -> list[Document]:
    """Documents of a JSONL file: one object per line with `text` or `messages`."""
    docs: list[Document] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read {path}: {exc}") from exc
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: malformed JSON ({exc.msg})") from exc
        if isinstance(obj, dict) and isinstance(obj.get("text"), str):
            (ids,) = encode_texts(tokenizer, [obj["text"]])
            docs.append(Document(where, ids, np.ones(len(ids), bool)))
        elif isinstance(obj, dict) and "messages" in obj:
            ids, mask = encode_chat(tokenizer, _check_messages(obj["messages"], where))
            templated = bool(getattr(tokenizer, "chat_template", None))
            docs.append(Document(where, ids, mask, templated))
        else:
            raise DataError(f"{where}: expected an object with a 'text' string or 'messages'")
    return docs


def _read_text_file(path: Path, tokenizer: Any, name: str) -> list[Document]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read {path} as UTF-8 text: {exc}") from exc
    (ids,) = encode_texts(tokenizer, [text])
    return [Document(name, ids, np.ones(len(ids), bool))]


def read_documents(source: str, tokenizer: Any) -> list[Document]:
    """Documents of a text file, a JSONL file or a folder of them."""
    path = Path(source).expanduser()
    if not path.exists():
        raise DataError(f"--data {source!r}: no such file or folder")
    if path.is_file():
        if path.suffix == ".jsonl":
            return read_jsonl(path, tokenizer)
        return _read_text_file(path, tokenizer, path.name)
    docs: list[Document] = []
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        rel = file.relative_to(path)
        if any(part.startswith(".") for part in rel.parts):
            continue
        if file.suffix == ".jsonl":
            docs += read_jsonl(file, tokenizer)
            continue
        try:
            docs += _read_text_file(file, tokenizer, rel.as_posix())
        except DataError:
            continue  # binary files in a folder are skipped, not fatal
    return docs


# --------------------------------------------------------------------------- packing


def _stream(
    docs: list[Document], eos_id: int | None, bos_id: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate documents as [BOS] doc EOS, the framing the tiny target was trained on.

    BOS never counts for the loss (nothing predicts a document start); EOS counts
    where the document's last token did.
    """
    ids: list[np.ndarray] = []
    mask: list[np.ndarray] = []
    for doc in docs:
        if len(doc.ids) == 0:
            continue
        if bos_id is not None and not doc.templated:
            ids.append(np.array([bos_id], np.int32))
            mask.append(np.zeros(1, bool))
        ids.append(doc.ids)
        mask.append(doc.mask)
        if eos_id is not None:
            ids.append(np.array([eos_id], np.int32))
            mask.append(doc.mask[-1:].copy())
    if not ids:
        return np.zeros(0, np.int32), np.zeros(0, bool)
    return np.concatenate(ids).astype(np.int32), np.concatenate(mask)


def pack(ids: np.ndarray, mask: np.ndarray, seq_len: int, pad_id: int):
    """Cut a token stream into [R, seq_len] rows; a short stream pads one row."""
    num_rows = len(ids) // seq_len
    if num_rows == 0:
        row_ids = np.full((1, seq_len), pad_id, np.int32)
        row_mask = np.zeros((1, seq_len), bool)
        row_ids[0, : len(ids)], row_mask[0, : len(ids)] = ids, mask
        return row_ids, row_mask
    keep = num_rows * seq_len
    return ids[:keep].reshape(num_rows, seq_len), mask[:keep].reshape(num_rows, seq_len)


@dataclass
class Corpus:
    """Train and held-out token streams (before packing)."""

    train_ids: np.ndarray
    train_mask: np.ndarray
    heldout_ids: np.ndarray
    heldout_mask: np.ndarray


def cache_dir() -> Path:
    """${DFLASH_CACHE_DIR:-~/.cache/dflash-train}."""
    return Path(os.environ.get("DFLASH_CACHE_DIR") or Path.home() / ".cache" / "dflash-train")


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Stable id of a tokenizer's vocabulary, for cache keys."""
    if _is_byte_tokenizer(tokenizer):
        return f"byte-{tokenizer.vocab_size}"
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    return hashlib.sha256(vocab.encode("utf-8")).hexdigest()[:16]


def _special_ids(tokenizer: Any) -> tuple[int | None, int | None]:
    """(EOS, BOS) ids; chat documents rendered by a template already carry their own."""
    return getattr(tokenizer, "eos_token_id", None), getattr(tokenizer, "bos_token_id", None)


def _embedded_key(tokenizer: Any, heldout_fraction: float) -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    h = hashlib.sha256(f"v{_CACHE_VERSION} {sys.version} {heldout_fraction}".encode())
    h.update(tokenizer_fingerprint(tokenizer).encode())
    for path in stdlib_source_files():
        h.update(f"{path.relative_to(root)} {path.stat().st_size}\n".encode())
    return h.hexdigest()[:20]


def _save_npz_atomic(path: Path, arrays: dict[str, np.ndarray]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
    os.replace(tmp, path)


def embedded_tokens(tokenizer: Any, heldout_fraction: float = 0.05) -> Corpus:
    """The embedded corpus tokenized once per tokenizer and cached under cache_dir()."""
    path = cache_dir() / "tokens" / f"embedded-{_embedded_key(tokenizer, heldout_fraction)}.npz"
    if path.exists():
        try:
            with np.load(path) as z:
                return Corpus(*(z[k] for k in ("train_ids", "train_mask", "h_ids", "h_mask")))
        except (OSError, ValueError, KeyError):
            pass  # a damaged cache is rebuilt below
    eos, bos = _special_ids(tokenizer)
    streams = []
    for split in ("train", "heldout"):
        texts = embedded_corpus(split, heldout_fraction)
        ids = encode_texts(tokenizer, texts)
        streams.append(_stream([Document("", i, np.ones(len(i), bool)) for i in ids], eos, bos))
    corpus = Corpus(streams[0][0], streams[0][1], streams[1][0], streams[1][1])
    arrays = {"train_ids": corpus.train_ids, "train_mask": corpus.train_mask}
    arrays |= {"h_ids": corpus.heldout_ids, "h_mask": corpus.heldout_mask}
    _save_npz_atomic(path, arrays)
    return corpus


def load_corpus(source: str, tokenizer: Any, heldout_fraction: float = 0.05) -> Corpus:
    """Tokenized train/held-out streams of `--data` (documents split by name hash)."""
    if source == "embedded":
        return embedded_tokens(tokenizer, heldout_fraction)
    docs = read_documents(source, tokenizer)
    docs = [d for d in docs if len(d.ids) > 0]
    if not docs or not any(d.mask.any() for d in docs):
        raise DataError(f"--data {source!r}: corpus is empty (no tokens to train on)")
    eos, bos = _special_ids(tokenizer)
    train = [d for d in docs if not is_heldout(d.name, heldout_fraction)]
    heldout = [d for d in docs if is_heldout(d.name, heldout_fraction)]
    if not train:  # every document hashed to held-out: train on all, split rows later
        train, heldout = docs, []
    return Corpus(*_stream(train, eos, bos), *_stream(heldout, eos, bos))


def _pad_id(tokenizer: Any) -> int:
    for attr in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            return int(value)
    return 0


def build_datasets(
    source: str,
    tokenizer: Any,
    seq_len: int,
    batch_size: int,
    seed: int,
    heldout_fraction: float = 0.05,
) -> tuple[PackedDataset, PackedDataset]:
    """(train, held-out) datasets of packed rows.

    When the document split leaves nothing held out (one file, few lines) the
    last rows of the training stream are held out instead, so eval always has
    data that training never saw unless the corpus is a single row.
    """
    corpus = load_corpus(source, tokenizer, heldout_fraction)
    pad = _pad_id(tokenizer)
    train_ids, train_mask = pack(corpus.train_ids, corpus.train_mask, seq_len, pad)
    if len(corpus.heldout_ids) > 0:
        held_ids, held_mask = pack(corpus.heldout_ids, corpus.heldout_mask, seq_len, pad)
    elif len(train_ids) >= 2:
        num_held = max(1, round(heldout_fraction * len(train_ids)))
        held_ids, held_mask = train_ids[-num_held:], train_mask[-num_held:]
        train_ids, train_mask = train_ids[:-num_held], train_mask[:-num_held]
    else:
        held_ids, held_mask = train_ids, train_mask
    train = PackedDataset(train_ids, train_mask, batch_size, seed)
    held_stream = corpus.heldout_ids if len(corpus.heldout_ids) > 0 else None
    heldout = PackedDataset(held_ids, held_mask, batch_size, seed, stream=held_stream)
    return train, heldout


def heldout_prompts(
    heldout: PackedDataset, num_prompts: int, prompt_tokens: int
) -> list[list[int]]:
    """`num_prompts` windows of `prompt_tokens` tokens spread evenly over the held-out stream."""
    stream = heldout.stream
    length = min(prompt_tokens, len(stream))
    span = len(stream) - length
    starts = [(i * span) // max(num_prompts - 1, 1) for i in range(num_prompts)]
    return [[int(t) for t in stream[s : s + length]] for s in starts]
