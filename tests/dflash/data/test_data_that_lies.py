"""Data that lies is caught, not learned: chats in a JSON array are chats, compressed
files in a folder are read, binary ones named, lines the parser cannot take (200,000
nested brackets, a lone surrogate escape) skipped and counted, and a `regenerate` output
that is still being written, or was left unfinished, refused in one line."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
from pathlib import Path

import pytest

from dflash.data.datasets import load_corpus
from dflash.data.sources import DataError, DataReport, read_documents, read_source
from dflash.data.tokenizer import ByteTokenizer
from dflash.files import output_lock_path, record_path
from dflash.run.folder import FolderLock
from tests.dflash.app_fixtures import tiny_target  # noqa: F401 - fixture
from tests.dflash.cli.test_output_checks import invoke, refused, train_args

TOK = ByteTokenizer()
CHATS = [
    {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
    for i in range(6)
]


def _jsonl(records: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def _same(a: list, b: list) -> bool:
    return [(d.name, d.ids.tolist(), d.mask.tolist()) for d in a] == [
        (d.name, d.ids.tolist(), d.mask.tolist()) for d in b
    ]


def test_a_json_array_of_chats_is_read_as_the_same_chats_as_jsonl(tmp_path) -> None:
    plain = tmp_path / "chats.jsonl"
    plain.write_text(_jsonl(CHATS))
    array = tmp_path / "chats.json"
    array.write_text(json.dumps(CHATS, indent=2))
    docs = read_documents(str(array), TOK)
    assert len(docs) == len(CHATS) and not all(d.mask.all() for d in docs)  # replies only
    assert _same(docs, read_documents(str(plain), TOK))
    one = tmp_path / "one.json"  # a single record is one, too
    one.write_text(json.dumps(CHATS[0]))
    assert _same(read_documents(str(one), TOK), read_documents(str(plain), TOK)[:1])


def test_bad_items_of_a_json_array_are_skipped_and_counted_by_index(tmp_path) -> None:
    array = tmp_path / "chats.json"
    wizard = {"messages": [{"role": "wizard", "content": "x"}]}
    array.write_text(json.dumps([CHATS[0], wizard, "text", CHATS[1]]))
    report = DataReport()
    assert len(read_documents(str(array), TOK, report)) == 2
    assert report.skipped_lines == 2
    assert report.first_bad_line.startswith(f"{array}[1]: unknown role 'wizard' (expected")


def test_a_json_file_of_no_records_is_refused_alone_and_text_in_a_folder(tmp_path) -> None:
    config = tmp_path / "code" / "package.json"
    config.parent.mkdir()
    config.write_text('{"name": "x", "version": "1.0"}\n')
    with pytest.raises(DataError, match=r"package.json': a JSON file that holds no records"):
        read_documents(str(config), TOK)
    (doc,) = read_documents(str(config.parent), TOK)  # a folder of code: its text
    assert bytes(doc.ids.tolist()).decode() == config.read_text()


@pytest.mark.parametrize(
    "suffix,opener", [(".gz", gzip.open), (".bz2", bz2.open), (".xz", lzma.open)]
)
def test_compressed_files_in_a_folder_are_read_as_what_they_hold(tmp_path, suffix, opener) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "chats.jsonl").write_text(_jsonl(CHATS))
    (plain / "notes.txt").write_text("def f(x):\n    return x\n")
    packed = tmp_path / "packed"
    packed.mkdir()
    with opener(packed / f"chats.jsonl{suffix}", "wt") as f:
        f.write(_jsonl(CHATS))
    with opener(packed / f"notes.txt{suffix}", "wt") as f:
        f.write("def f(x):\n    return x\n")
    assert _same(read_documents(str(packed), TOK), read_documents(str(plain), TOK))
    alone = read_documents(str(packed / f"chats.jsonl{suffix}"), TOK)
    assert _same(alone, read_documents(str(plain / "chats.jsonl"), TOK))


def test_a_damaged_gzip_is_one_line_naming_it(tmp_path) -> None:
    with gzip.open(tmp_path / "chats.jsonl.gz", "wt") as f:
        f.write(_jsonl(CHATS * 50))
    data = (tmp_path / "chats.jsonl.gz").read_bytes()
    (tmp_path / "chats.jsonl.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"cannot decompress .*chats.jsonl.gz: Compressed file"):
        read_documents(str(tmp_path), TOK)


def test_binary_files_of_a_folder_are_counted_and_named(tmp_path) -> None:
    (tmp_path / "a.txt").write_text("some text " * 10)
    (tmp_path / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    (tmp_path / "old.tar.gz").write_bytes(gzip.compress(b"tar bytes"))
    report = DataReport()
    assert len(read_documents(str(tmp_path), TOK, report)) == 1
    assert report.skipped_files == 2
    (line,) = [x for x in report.lines(64) if "files" in x]
    assert line == (
        f"data: skipped 2 files that are not UTF-8 text (first: {tmp_path / 'logo.png'}: "
        "not UTF-8 (byte 0: invalid start byte))"
    )
    with pytest.raises(DataError, match="corpus is empty .*skipped 1 files; first: .*logo.png"):
        load_corpus(str(_only(tmp_path, "logo.png")), TOK)


def _only(folder: Path, name: str) -> Path:
    lone = folder / "lone"
    lone.mkdir()
    (lone / name).write_bytes((folder / name).read_bytes())
    return lone


def test_lines_the_parser_cannot_take_are_skipped_and_counted(tmp_path) -> None:
    path = tmp_path / "data.jsonl"
    good = json.dumps({"text": "fine"})
    surrogate = '{"text": "half \\ud800 of a pair"}'
    pair = '{"text": "a whole pair \\ud83d\\ude00"}'
    path.write_text("\n".join(["[" * 200_000, good, surrogate, pair, "{" * 200_000]) + "\n")
    report = DataReport()
    docs = read_documents(str(path), TOK, report)
    assert [bytes(d.ids.tolist()).decode() for d in docs] == ["fine", "a whole pair 😀"]
    assert report.skipped_lines == 3
    assert report.first_bad_line == f"{path}:1: malformed JSON (nested too deeply to read)"
    report = DataReport()
    list(read_source(str(tmp_path / "data.jsonl"), report))
    assert report.skipped_lines == 3


def _regenerate_output(tmp_path: Path, written: int, total: int) -> Path:
    """An output as `regenerate` leaves it: `written` of `total` lines, and its record."""
    out = tmp_path / "regen.jsonl"
    out.write_text(_jsonl([{"text": f"line {i} " * 4} for i in range(written)]))
    record = {"format": 2, "target": "builtin:tiny", "target_hash": "x", "data": "y"}
    record |= {"lines": total, "settings": {"max_new_tokens": 8}}
    record_path(out).write_text(json.dumps(record))
    return out


def test_a_regenerate_output_still_being_written_is_refused(tmp_path) -> None:
    out = _regenerate_output(tmp_path, 448, 2834)
    lock = FolderLock.for_output(out, "--output")
    assert lock.path == output_lock_path(out)  # the lock regenerate takes is the one read
    with lock:
        with pytest.raises(DataError) as caught:
            read_documents(str(out), TOK)
    assert str(caught.value).startswith(
        f"--data {str(out)!r} is still being written by dflash-train regenerate (pid "
    )
    assert "448 of its 2,834 lines so far" in str(caught.value)
    with pytest.raises(DataError, match=r"unfinished regenerate output: 448 of its 2,834 lines"):
        read_documents(str(tmp_path), TOK)  # in a folder too, once no process holds it


def test_a_finished_regenerate_output_is_read_and_its_record_is_not_data(tmp_path) -> None:
    out = _regenerate_output(tmp_path, 12, 12)
    assert len(read_documents(str(out), TOK)) == 12
    assert len(read_documents(str(tmp_path), TOK)) == 12  # regen.jsonl.run.json is no text
    mine = tmp_path / "records" / "x.jsonl"  # a record that is no regenerate's: not read
    mine.parent.mkdir()
    mine.write_text(_jsonl([{"text": "a"}]))
    record_path(mine).write_text(json.dumps({"command": "eval", "sha256": "0"}))
    assert len(read_documents(str(mine), TOK)) == 1


@pytest.mark.usefixtures("tiny_target")
def test_train_on_an_unfinished_regenerate_output_is_one_line(tmp_path) -> None:
    out = _regenerate_output(tmp_path, 3, 40)
    line = refused(invoke([*train_args(tmp_path, tmp_path / "run"), "--data", out]))
    assert "is an unfinished regenerate output: 3 of its 40 lines" in line
    assert not (tmp_path / "run").exists()
