import json

import numpy as np
import pytest
import torch

from dflash.data.datasets import build_datasets
from dflash.data.documents import (
    anchor_context_start,
    document_causal_mask,
    document_positions,
    document_starts,
)
from dflash.data.packing import Document, frame, pack_documents
from dflash.data.sources import DataError
from dflash.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, ByteTokenizer


def _text(n: int, start: int = 0) -> Document:
    ids = (np.arange(n) + start).astype(np.int32) % 200
    return frame(Document(f"t{start}", ids, np.ones(n, bool)), BOS_ID, EOS_ID)


def _rows_of(rows, r):
    return rows.ids[r], rows.mask[r], rows.doc_ids[r], rows.positions[r]


def test_text_documents_fill_rows_as_separate_documents() -> None:
    rows = pack_documents([_text(10), _text(30, 50)], 16, PAD_ID, EOS_ID)
    assert rows.ids.shape == (3, 16) and rows.report.padding_tokens == 4  # 44 tokens
    ids, mask, docs, pos = _rows_of(rows, 0)
    # [BOS] 0..9 EOS (12 tokens), then the first 4 tokens of the second document.
    assert ids[:12].tolist() == [BOS_ID, *range(10), EOS_ID] and ids[12] == BOS_ID
    assert docs.tolist() == [0] * 12 + [1] * 4
    assert pos.tolist() == list(range(12)) + list(range(4))
    assert not mask[0] and not mask[12] and mask[1:12].all()
    # The rest of the long document continues the next row as a new document at position 0.
    assert rows.ids[1, 0] == 53 % 200 and rows.positions[1, 0] == 0


def test_short_last_piece_pads_instead_and_short_last_row_is_dropped() -> None:
    rows = pack_documents([_text(27), _text(5)], 32, PAD_ID, EOS_ID)
    # 29 tokens, 3 left: below seq_len/8, so the next document starts a new row ...
    assert rows.ids[0, 29:].tolist() == [PAD_ID] * 3 and not rows.mask[0, 29:].any()
    assert rows.doc_ids[0, 29:].tolist() == [1] * 3  # padding is its own document
    assert rows.positions[0, 29:].tolist() == [0, 1, 2]
    # ... which holds 7 of 32 tokens: less than half full, dropped.
    assert len(rows) == 1


def _chat(turns: list[tuple[str, str]]) -> Document:
    from dflash.data.chat import render_chat

    messages = [{"role": r, "content": c} for r, c in turns]
    chat = render_chat(ByteTokenizer(), messages)
    return frame(Document("c", chat.ids, chat.mask, False, chat.turn_ends), BOS_ID, EOS_ID)


def test_long_chat_is_truncated_at_a_turn_end_or_dropped() -> None:
    tok = ByteTokenizer()
    chat = _chat(
        [("user", "hi"), ("assistant", "hello"), ("user", "more"), ("assistant", "x" * 40)]
    )
    rows = pack_documents([chat], 40, PAD_ID, EOS_ID)  # the first exchange is 34 tokens
    text = tok.decode(rows.ids[0][rows.doc_ids[0] == 0].tolist())
    assert text.endswith("<|assistant|>\nhello\n") and "more" not in text
    assert rows.ids[0][rows.doc_ids[0] == 0][-1] == EOS_ID
    assert rows.report.truncated_chats == 1 and rows.report.dropped_chats == 0
    hopeless = _chat([("user", "q" * 40), ("assistant", "a")])
    rows = pack_documents([hopeless, chat], 40, PAD_ID, EOS_ID)
    assert rows.report.dropped_chats == 1 and rows.report.truncated_chats == 1


def test_a_chat_that_does_not_fit_the_rest_of_a_row_starts_a_new_row() -> None:
    first = _chat([("user", "a"), ("assistant", "b" * 6)])
    second = _chat([("user", "c"), ("assistant", "d")])
    rows = pack_documents([first, second], 32, PAD_ID, EOS_ID)
    for r in range(len(rows)):
        for d in np.unique(rows.doc_ids[r]):
            piece = rows.ids[r][rows.doc_ids[r] == d]
            assert piece[0] in (BOS_ID, PAD_ID)  # every chat starts whole at a row or doc start


def test_document_tensors() -> None:
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2]])
    assert document_starts(doc_ids).tolist() == [[0, 0, 0, 3, 3, 5]]
    assert document_positions(doc_ids).tolist() == [[0, 1, 2, 0, 1, 0]]
    mask = document_causal_mask(doc_ids)[0, 0]
    assert mask[4].tolist() == [False, False, False, True, True, False]
    assert mask[2].tolist() == [True, True, True, False, False, False]
    anchors = torch.tensor([[1, 4, 5]])
    assert anchor_context_start(anchors, doc_ids).tolist() == [[0, 3, 5]]


def test_packing_flag_and_both_modes(tmp_path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i} " * 8}) + "\n" for i in range(20)))
    docs, _ = build_datasets(str(path), ByteTokenizer(), 32, 2, 0, packing="docs")
    concat, _ = build_datasets(str(path), ByteTokenizer(), 32, 2, 0, packing="concat")
    assert docs.batch(0).doc_ids is not None and concat.batch(0).doc_ids is None
    assert docs.fingerprint() != concat.fingerprint()
    batch = docs.batch(1)
    assert torch.equal(batch.position_ids, document_positions(batch.doc_ids))
    with pytest.raises(DataError, match="--packing 'rows'"):
        build_datasets(str(path), ByteTokenizer(), 32, 2, 0, packing="rows")
