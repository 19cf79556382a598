import json

import numpy as np
import pytest

from dflash.data.chat import render_chat
from dflash.data.corpus import embedded_tokens
from dflash.data.datasets import PackedDataset, build_datasets, heldout_prompts
from dflash.data.packing import pack_concat
from dflash.data.sources import DataError
from dflash.data.tokenizer import EOS_ID, ByteTokenizer


def _dataset(num_rows: int = 10, seq_len: int = 4, batch_size: int = 3, seed: int = 1):
    ids = np.arange(num_rows * seq_len, dtype=np.int32).reshape(num_rows, seq_len)
    return PackedDataset(ids, np.ones_like(ids, dtype=bool), batch_size, seed)


def test_batches_are_a_pure_function_of_seed_and_index() -> None:
    a, b = _dataset(), _dataset()
    for index in (7, 0, 3, 12):  # any order, fresh object: same rows
        assert np.array_equal(a.batch(index).input_ids, b.batch(index).input_ids)
    assert not np.array_equal(_dataset(seed=2).batch(0).input_ids, a.batch(0).input_ids)


def test_each_epoch_visits_every_row_once() -> None:
    ds = _dataset(num_rows=9, batch_size=3)
    rows = np.concatenate([ds.row_indices(i) for i in range(3)])
    assert sorted(rows.tolist()) == list(range(9))
    second = np.concatenate([ds.row_indices(i) for i in range(3, 6)])
    assert sorted(second.tolist()) == list(range(9)) and not np.array_equal(rows, second)


def test_batch_larger_than_the_dataset_wraps_epochs() -> None:
    ds = _dataset(num_rows=2, batch_size=5)
    assert ds.batch(0).input_ids.shape == (5, 4)


def test_pack_cuts_rows_and_pads_short_streams() -> None:
    ids, mask = np.arange(10, dtype=np.int32), np.ones(10, bool)
    rows, _ = pack_concat(ids, mask, 4, pad_id=99)
    assert rows.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    rows, row_mask = pack_concat(ids[:3], mask[:3], 4, pad_id=99)
    assert rows.tolist() == [[0, 1, 2, 99]] and row_mask.tolist() == [[True, True, True, False]]


def test_text_folder_with_heldout_split(tmp_path) -> None:
    for i in range(40):
        (tmp_path / f"doc{i}.txt").write_text(f"document number {i} " * 20)
    train, heldout = build_datasets(str(tmp_path), ByteTokenizer(), 32, 2, 0, 0.2)
    train_rows = {tuple(r) for r in train.ids.tolist()}
    assert len(heldout) > 0 and not any(tuple(r) in train_rows for r in heldout.ids.tolist())
    assert EOS_ID in train.ids  # documents are separated


def test_single_file_still_gets_a_heldout_part(tmp_path) -> None:
    path = tmp_path / "one.txt"
    path.write_text("x" * 1000)
    for packing in ("docs", "concat"):
        train, heldout = build_datasets(str(path), ByteTokenizer(), 50, 2, 0, packing=packing)
        assert len(train) >= 1 and len(heldout) >= 1
        assert len(train) + len(heldout) == 1001 // 50


def test_jsonl_text_and_chat_masks(tmp_path) -> None:
    path = tmp_path / "d.jsonl"
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    path.write_text(json.dumps({"text": "plain"}) + "\n\n" + json.dumps({"messages": chat}) + "\n")
    rendered = render_chat(ByteTokenizer(), chat)
    ids, mask = rendered.ids, rendered.mask
    text = ByteTokenizer().decode(ids.tolist())
    learned = ByteTokenizer().decode(ids[mask].tolist())
    assert "hi" in text and learned == "yo\n"
    # Rows long enough for the whole chat: a chat is never cut mid-turn, so a shorter
    # row would drop it and leave the result to the path-hashed train/held-out split.
    train, _ = build_datasets(str(path), ByteTokenizer(), 64, 1, 0)
    assert train.mask.any()


def test_chat_template_masks_only_assistant_turns() -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "<s>", "user", "assistant", ":", "hi", "yo"])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]")
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant : {% endif %}"
    )
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    rendered = render_chat(tok, chat)
    ids, mask = rendered.ids, rendered.mask
    assert tok.convert_ids_to_tokens(ids[mask].tolist()) == ["yo"]


@pytest.mark.parametrize(
    ("bad", "fragment"),
    [
        ("{not json}", ":2: malformed JSON"),
        ('{"other": 1}', ":2: expected an object with a 'text'"),
        ("[1, 2]", ":2: expected an object, got list"),
        ('{"messages": [{"role": "user"}]}', ":2: each message"),
        ('{"messages": [{"role": "robot", "content": "x"}]}', ":2: unknown role 'robot'"),
    ],
)
def test_bad_jsonl_lines_are_skipped_counted_and_named(tmp_path, bad, fragment) -> None:
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"text": "usable text " * 10})
    path.write_text("\n".join([good, bad, good, bad]) + "\n")
    lines: list[str] = []
    train, _ = build_datasets(str(path), ByteTokenizer(), 16, 1, 0, log=lines.append)
    assert train.report.skipped_lines == 2
    assert fragment in train.report.first_bad_line and "bad.jsonl" in train.report.first_bad_line
    assert any("skipped 2 unusable JSONL lines" in line and fragment in line for line in lines)
    path.write_text(bad + "\n" + bad + "\n")
    with pytest.raises(DataError, match="skipped 2 lines") as info:
        build_datasets(str(path), ByteTokenizer(), 8, 1, 0)
    assert fragment.replace(":2:", ":1:") in str(info.value)


def test_empty_or_missing_corpus_is_a_data_error(tmp_path) -> None:
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="empty"):
        build_datasets(str(tmp_path / "empty.txt"), ByteTokenizer(), 8, 1, 0)
    with pytest.raises(DataError, match="no such file"):
        build_datasets(str(tmp_path / "missing"), ByteTokenizer(), 8, 1, 0)
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(DataError, match="bin.txt"):
        build_datasets(str(tmp_path / "bin.txt"), ByteTokenizer(), 8, 1, 0)


def test_embedded_tokens_are_cached(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path))
    first = embedded_tokens(ByteTokenizer())
    files = list((tmp_path / "tokens").glob("*.npz"))
    assert len(files) == 1 and len(first.train_ids) > 5 * len(first.heldout_ids) > 0
    monkeypatch.setattr("dflash.data.corpus.embedded_corpus", lambda *a: pytest.fail("not cached"))
    second = embedded_tokens(ByteTokenizer())
    assert np.array_equal(first.train_ids, second.train_ids)


def test_heldout_prompts_do_not_depend_on_seq_len(tmp_path) -> None:
    for i in range(30):
        (tmp_path / f"d{i}.txt").write_text(f"text {i} " * 50)
    _, held_a = build_datasets(str(tmp_path), ByteTokenizer(), 16, 1, 0, 0.3)
    _, held_b = build_datasets(str(tmp_path), ByteTokenizer(), 64, 1, 0, 0.3)
    prompts = heldout_prompts(held_a, 3, 10)
    assert prompts == heldout_prompts(held_b, 3, 10)
    assert len(prompts) == 3 and all(len(p) == 10 for p in prompts)


def test_per_turn_documents_of_one_conversation_share_its_name_and_side_of_the_split(
    tmp_path,
) -> None:
    from dflash.data.packing import content_key
    from dflash.data.sources import read_jsonl

    def chat(n: int) -> list[dict[str, str]]:
        return [
            {"role": "user", "content": f"q1 of {n}"},
            {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "a2"},
        ]

    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": chat(n)}) + "\n" for n in range(3)))
    whole = read_jsonl(path, ByteTokenizer())
    turns = read_jsonl(path, ByteTokenizer(), rendering="per-turn")
    keys = [content_key({"messages": chat(n)}) for n in range(3)]
    assert [d.name for d in whole] == keys
    assert [d.name for d in turns] == [key for key in keys for _ in range(2)]
    assert sum(int(d.mask.sum()) for d in turns) == sum(int(d.mask.sum()) for d in whole)
    assert all(d.turn_ends.tolist() == [len(d.ids)] for d in turns)


def test_the_held_out_split_is_by_content_the_same_data_at_another_path_splits_alike(
    tmp_path,
) -> None:
    from dflash.data.datasets import load_corpus

    texts = [f"document {i}: " + "lorem ipsum " * (i % 7 + 1) for i in range(60)]
    records = "".join(json.dumps({"text": t}) + "\n" for t in texts)
    first, second = tmp_path / "a" / "data.jsonl", tmp_path / "b" / "renamed.jsonl"
    for path in (first, second):
        path.parent.mkdir()
        path.write_text(records)
    split = [
        load_corpus(str(path), ByteTokenizer(), heldout_fraction=0.2) for path in (first, second)
    ]
    held = [sorted(d.ids.tobytes() for d in corpus.heldout) for corpus in split]
    assert held[0] and held[0] == held[1]
    assert len(split[0].train) == len(split[1].train) == len(texts) - len(held[0])
    # Lines in another order: the same documents are held out.
    second.write_text("".join(reversed(records.splitlines(keepends=True))))
    shuffled = load_corpus(str(second), ByteTokenizer(), heldout_fraction=0.2)
    assert sorted(d.ids.tobytes() for d in shuffled.heldout) == held[0]
