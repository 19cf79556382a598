"""Packing documents into fixed-length rows.

`docs` packing keeps documents apart: each row records which document every token
belongs to (`doc_ids`) and its position inside that document. Plain text fills
rows completely (a long text continues in the next row as a new document); a
conversation is never split mid-turn: too long for a row, it is truncated at a
turn end, or dropped when not even its first reply fits. `concat` packing is the
older behaviour: one token stream cut into rows, documents running into each other.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import numpy as np

PACKING_MODES = ("docs", "concat")


def content_key(content: str | dict) -> str:
    """What decides a document's side of the held-out split: a hash of its content (a
    text, or a JSONL record), so the same data splits alike at any path, on any machine;
    duplicates land on one side."""
    text = content if isinstance(content, str) else json.dumps(content, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


@dataclass
class Document:
    name: str  # its key in the held-out split (`content_key`)
    ids: np.ndarray  # [n] int32
    mask: np.ndarray  # [n] bool
    templated: bool = False  # rendered by a chat template, which adds its own BOS
    turn_ends: np.ndarray | None = None  # chats: clean cut points (token counts); None = text


@dataclass
class PackReport:
    """What packing did to the documents it was given."""

    documents: int = 0
    truncated_chats: int = 0  # cut at a turn end to fit a row
    dropped_chats: int = 0  # not even the first reply fits a row
    padding_tokens: int = 0

    def lines(self, seq_len: int) -> list[str]:
        out = []
        if self.truncated_chats:
            out.append(
                f"data: {self.truncated_chats} conversations longer than --seq-len {seq_len} "
                "truncated at a turn end"
            )
        if self.dropped_chats:
            out.append(
                f"data: {self.dropped_chats} conversations dropped: their first reply does "
                f"not fit --seq-len {seq_len}"
            )
        return out


@dataclass
class Rows:
    """Packed rows; doc_ids/positions are None for concat packing (one document a row)."""

    ids: np.ndarray  # [R, T] int32
    mask: np.ndarray  # [R, T] bool
    doc_ids: np.ndarray | None = None  # [R, T] int32, numbering documents within a row
    positions: np.ndarray | None = None  # [R, T] int32, restarting at 0 per document
    report: PackReport = field(default_factory=PackReport)

    def __len__(self) -> int:
        return len(self.ids)

    def take(self, sl: slice) -> Rows:
        pick = lambda a: None if a is None else a[sl]  # noqa: E731
        return Rows(
            self.ids[sl], self.mask[sl], pick(self.doc_ids), pick(self.positions), self.report
        )


def frame(doc: Document, bos_id: int | None, eos_id: int | None) -> Document:
    """[BOS] doc EOS, the framing the tiny target was trained on.

    BOS never counts for the loss (nothing predicts a document start); EOS counts
    where the document's last token did. Templated chats carry their own BOS, and end
    with the template's end-of-turn marker: an EOS after it would be learned as a
    token the target never writes there.
    """
    ids, mask, shift = [doc.ids], [doc.mask], 0
    if bos_id is not None and not doc.templated:
        ids.insert(0, np.array([bos_id], np.int32))
        mask.insert(0, np.zeros(1, bool))
        shift = 1
    if eos_id is not None and not doc.templated:
        ids.append(np.array([eos_id], np.int32))
        mask.append(doc.mask[-1:].copy())
    ends = None
    if doc.turn_ends is not None:
        ends = doc.turn_ends + shift
    return Document(
        doc.name, np.concatenate(ids).astype(np.int32), np.concatenate(mask), doc.templated, ends
    )


def truncate_chat(doc: Document, seq_len: int, eos_id: int | None) -> Document | None:
    """A framed chat cut at its last turn end that fits seq_len (EOS re-appended, unless
    the template ends its turns itself); None when no cut keeps a learned token."""
    if doc.templated:
        eos_id = None
    extra = 1 if eos_id is not None else 0
    assert doc.turn_ends is not None
    for cut in sorted((int(c) for c in doc.turn_ends), reverse=True):
        if cut + extra > seq_len or not doc.mask[:cut].any():
            continue
        ids, mask = doc.ids[:cut], doc.mask[:cut]
        if eos_id is not None:
            ids = np.concatenate([ids, np.array([eos_id], np.int32)])
            mask = np.concatenate([mask, mask[-1:]])
        return Document(doc.name, ids, mask, doc.templated, doc.turn_ends[doc.turn_ends <= cut])
    return None


def stream(docs: list[Document]) -> tuple[np.ndarray, np.ndarray]:
    """Framed documents concatenated into one token stream."""
    docs = [d for d in docs if len(d.ids)]
    if not docs:
        return np.zeros(0, np.int32), np.zeros(0, bool)
    return np.concatenate([d.ids for d in docs]).astype(np.int32), np.concatenate(
        [d.mask for d in docs]
    )


def pack_concat(ids: np.ndarray, mask: np.ndarray, seq_len: int, pad_id: int):
    """Cut a token stream into [R, seq_len] rows; a short stream pads one row."""
    num_rows = len(ids) // seq_len
    if num_rows == 0:
        row_ids = np.full((1, seq_len), pad_id, np.int32)
        row_mask = np.zeros((1, seq_len), bool)
        row_ids[0, : len(ids)], row_mask[0, : len(ids)] = ids, mask
        return row_ids, row_mask
    keep = num_rows * seq_len
    return ids[:keep].reshape(num_rows, seq_len), mask[:keep].reshape(num_rows, seq_len)


class RowBuilder:
    """Rows filled piece by piece; every piece is a document of its own in the row."""

    def __init__(self, seq_len: int, pad_id: int) -> None:
        self.seq_len, self.pad_id = seq_len, pad_id
        self.rows: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self.padding = 0
        self._new_row()

    def _new_row(self) -> None:
        t = self.seq_len
        self.ids, self.mask = np.full(t, self.pad_id, np.int32), np.zeros(t, bool)
        self.doc, self.pos = np.zeros(t, np.int32), np.zeros(t, np.int32)
        self.used, self.num_docs = 0, 0

    @property
    def space(self) -> int:
        return self.seq_len - self.used

    def add(self, ids: np.ndarray, mask: np.ndarray) -> None:
        n, at = len(ids), self.used
        assert 0 < n <= self.space
        self.ids[at : at + n], self.mask[at : at + n] = ids, mask
        self.doc[at : at + n], self.pos[at : at + n] = self.num_docs, np.arange(n)
        self.used, self.num_docs = at + n, self.num_docs + 1
        if self.space == 0:
            self.flush()

    def flush(self) -> None:
        if self.used == 0:
            return
        rest = self.space
        if rest:  # padding is a document of its own: nothing real attends to it
            self.doc[self.used :], self.pos[self.used :] = self.num_docs, np.arange(rest)
            self.padding += rest
        self.rows.append((self.ids, self.mask, self.doc, self.pos))
        self._new_row()


def pack_documents(docs: list[Document], seq_len: int, pad_id: int, eos_id: int | None) -> Rows:
    """Framed documents -> rows that never mix documents in what a token sees.

    A text piece shorter than seq_len/8 is not started at a row's end (that space
    is padded); a last row less than half full is dropped unless it is the only one.
    """
    report = PackReport(documents=len(docs))
    builder = RowBuilder(seq_len, pad_id)
    min_piece = max(2, seq_len // 8)
    for doc in docs:
        if doc.turn_ends is not None:
            if len(doc.ids) > seq_len:
                cut = truncate_chat(doc, seq_len, eos_id)
                if cut is None:
                    report.dropped_chats += 1
                    continue
                doc = cut
                report.truncated_chats += 1
            if len(doc.ids) > builder.space:
                builder.flush()
            builder.add(doc.ids, doc.mask)
            continue
        start = 0
        while start < len(doc.ids):
            left = len(doc.ids) - start
            if builder.space < min(min_piece, left):
                builder.flush()
            take = min(builder.space, left)
            builder.add(doc.ids[start : start + take], doc.mask[start : start + take])
            start += take
    last_used = builder.used
    if last_used and (last_used * 2 >= seq_len or not builder.rows):
        builder.flush()
    report.padding_tokens = builder.padding
    if not builder.rows:
        builder.add(np.full(1, pad_id, np.int32), np.zeros(1, bool))
        builder.flush()
    ids, mask, doc_ids, positions = (np.stack(a) for a in zip(*builder.rows, strict=True))
    return Rows(ids, mask, doc_ids, positions, report)
