"""The datasets training and evaluation read: corpora packed into rows, and batches.

Batches are a pure function of (seed, batch index), so a run resumes from a stored
index and a pipeline can hand indices to ranks without coordinating anything else.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from dflash.config.settings import DataConfig
from dflash.data.corpus import EMBEDDED, EMBEDDED_CORPUS, Corpus, embedded_tokens, is_heldout
from dflash.data.packing import (
    PACKING_MODES,
    Document,
    Rows,
    frame,
    pack_concat,
    pack_documents,
    stream,
)
from dflash.data.sources import DataError, DataReport, read_documents
from dflash.data.tokenizer import Tokenizer, special_ids

# --------------------------------------------------------------------------- batches


@dataclass(frozen=True)
class Batch:
    """One training batch: token rows, where the loss counts, and (for `docs`
    packing) which document each token belongs to and its position in it."""

    batch_id: int
    input_ids: torch.Tensor  # [B, T] long
    loss_mask: torch.Tensor  # [B, T] bool
    doc_ids: torch.Tensor | None = None  # [B, T] long; None: each row is one document
    position_ids: torch.Tensor | None = None  # [B, T] long, restarting at 0 per document

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def to(self, device: torch.device | str) -> Batch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return Batch(
            self.batch_id,
            self.input_ids.to(device, non_blocking=True),
            self.loss_mask.to(device, non_blocking=True),
            move(self.doc_ids),
            move(self.position_ids),
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
        doc_ids: np.ndarray | None = None,
        positions: np.ndarray | None = None,
        report: DataReport | None = None,
    ) -> None:
        assert ids.shape == mask.shape and ids.ndim == 2 and len(ids) > 0
        assert (doc_ids is None) == (positions is None)
        self.ids, self.mask, self.doc_ids, self.positions = ids, mask, doc_ids, positions
        # The unpacked token stream, so eval prompts do not depend on --seq-len.
        self.stream = stream if stream is not None else ids.reshape(-1)
        self.batch_size, self.seed = batch_size, seed
        self.report = report or DataReport()
        self._perms: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def seq_len(self) -> int:
        return self.ids.shape[1]

    @property
    def packing(self) -> str:
        return "concat" if self.doc_ids is None else "docs"

    def fingerprint(self) -> str:
        """Hash of the rows and of how batches are drawn from them."""
        h = hashlib.sha256(f"{self.batch_size} {self.seed} {self.packing}".encode())
        for array in (self.ids, self.mask, self.doc_ids):
            if array is not None:
                h.update(f"{array.shape} {array.dtype}".encode())
                h.update(np.ascontiguousarray(array).tobytes())
        return h.hexdigest()[:20]

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
        if self.doc_ids is None or self.positions is None:
            return Batch(index, ids, mask)
        doc_ids = torch.from_numpy(self.doc_ids[rows].astype(np.int64))
        positions = torch.from_numpy(self.positions[rows].astype(np.int64))
        return Batch(index, ids, mask, doc_ids, positions)


# --------------------------------------------------------------------------- corpora


def load_corpus(
    source: str,
    tokenizer: Tokenizer,
    heldout_fraction: float = DataConfig.heldout_fraction,
    keep_cut: bool = False,
    rendering: str = DataConfig.chat_rendering,
) -> Corpus:
    """Framed train/held-out documents of `--data` (documents split by name hash); chats
    rendered by `rendering` (--chat-rendering)."""
    if source in (EMBEDDED, EMBEDDED_CORPUS):
        return embedded_tokens(tokenizer, heldout_fraction)
    report = DataReport()
    read = read_documents(source, tokenizer, report, keep_cut, rendering)
    docs = [d for d in read if len(d.ids) > 0]
    if not docs or not any(d.mask.any() for d in docs):
        why = f" (skipped {report.skipped_lines} lines; first: {report.first_bad_line})"
        files = f" (skipped {report.skipped_files} files; first: {report.first_skipped_file})"
        raise DataError(
            f"--data {source!r}: corpus is empty (no tokens to train on)"
            + (why if report.skipped_lines else "")
            + (files if report.skipped_files else "")
        )
    eos, bos = special_ids(tokenizer)
    docs = [frame(d, bos, eos) for d in docs]
    train = [d for d in docs if not is_heldout(d.name, heldout_fraction)]
    heldout = [d for d in docs if is_heldout(d.name, heldout_fraction)]
    if not train:  # every document hashed to held-out: train on all, split rows later
        train, heldout = docs, []
    return Corpus(train, heldout, report)


def pad_id(tokenizer: Tokenizer) -> int:
    for attr in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            return int(value)
    return 0


def pack_split(
    docs: list[Document], seq_len: int, pad_id: int, eos_id: int | None, packing: str
) -> Rows:
    """Rows of one split by `packing` (`docs` or `concat`)."""
    if packing not in PACKING_MODES:
        raise DataError(f"--packing {packing!r}: expected one of {', '.join(PACKING_MODES)}")
    if packing == "docs":
        return pack_documents(docs, seq_len, pad_id, eos_id)
    return Rows(*pack_concat(*stream(docs), seq_len, pad_id))


def build_datasets(
    source: str,
    tokenizer: Tokenizer,
    seq_len: int,
    batch_size: int,
    seed: int,
    heldout_fraction: float = DataConfig.heldout_fraction,
    *,
    packing: str = DataConfig.packing,
    log: Callable[[str], None] | None = None,
    keep_cut: bool = False,
    rendering: str = DataConfig.chat_rendering,
) -> tuple[PackedDataset, PackedDataset]:
    """(train, held-out) datasets of packed rows of `source` (see `datasets_from_corpus`);
    `embedded` here is the corpus as it is (the run substitutes the regenerated text)."""
    if packing not in PACKING_MODES:
        raise DataError(f"--packing {packing!r}: expected one of {', '.join(PACKING_MODES)}")
    corpus = load_corpus(source, tokenizer, heldout_fraction, keep_cut, rendering)
    return datasets_from_corpus(
        corpus, tokenizer, seq_len, batch_size, seed, heldout_fraction, packing=packing, log=log
    )


def datasets_from_corpus(
    corpus: Corpus,
    tokenizer: Tokenizer,
    seq_len: int,
    batch_size: int,
    seed: int,
    heldout_fraction: float = DataConfig.heldout_fraction,
    *,
    packing: str = DataConfig.packing,
    log: Callable[[str], None] | None = None,
) -> tuple[PackedDataset, PackedDataset]:
    """(train, held-out) datasets of packed rows.

    When the document split leaves nothing held out (one file, few lines) the
    last rows of the training stream are held out instead, so eval always has
    data that training never saw unless the corpus is a single row. `log` gets
    one line per thing the user should know (skipped lines, truncated chats).
    """
    pad, eos = pad_id(tokenizer), special_ids(tokenizer)[0]
    train = pack_split(corpus.train, seq_len, pad, eos, packing)
    corpus.report.pack = train.report
    if corpus.heldout:
        held = pack_split(corpus.heldout, seq_len, pad, eos, packing)
    elif len(train) >= 2:
        num_held = max(1, round(heldout_fraction * len(train)))
        train, held = train.take(slice(None, -num_held)), train.take(slice(-num_held, None))
    else:
        held = train
    if log is not None:
        for line in corpus.report.lines(seq_len):
            log(line)

    def dataset(rows: Rows, stream: np.ndarray | None) -> PackedDataset:
        layout = {"doc_ids": rows.doc_ids, "positions": rows.positions, "report": corpus.report}
        return PackedDataset(rows.ids, rows.mask, batch_size, seed, stream=stream, **layout)

    held_stream = corpus.heldout_ids if corpus.heldout else None
    return dataset(train, None), dataset(held, held_stream)


def heldout_prompts(
    heldout: PackedDataset, num_prompts: int, prompt_tokens: int
) -> list[list[int]]:
    """`num_prompts` windows of `prompt_tokens` tokens spread evenly over the held-out stream."""
    stream = heldout.stream
    length = min(prompt_tokens, len(stream))
    span = len(stream) - length
    starts = [(i * span) // max(num_prompts - 1, 1) for i in range(num_prompts)]
    return [[int(t) for t in stream[s : s + length]] for s in starts]
