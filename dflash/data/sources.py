"""Reading corpora: text files, folders, JSONL and JSON records (plain text or
conversations), each also compressed (.gz, .bz2, .xz).

An unusable record (a JSONL line or an item of a JSON array that is not an object, has
no `text`/`messages`, an unknown role, bad JSON, nesting too deep to read, a lone
surrogate escape) is skipped and counted; the caller decides whether anything usable is
left. A file of a folder that is not UTF-8 text is skipped, counted and named. A JSONL
file that `regenerate` is still writing, or left unfinished, is refused (its
`<file>.run.json` record says how many lines it will hold).
"""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from dflash.data.chat import KNOWN_ROLES, ChatTemplateError, render_documents
from dflash.data.packing import Document, PackReport, content_key
from dflash.data.tokenizer import Tokenizer, encode_texts
from dflash.errors import DFlashError
from dflash.files import RECORD_SUFFIX, lock_holder, output_lock_path, record_path, special_file

COMPRESSED: dict[str, Callable[..., IO[bytes]]] = {
    ".gz": gzip.open,
    ".bz2": bz2.open,
    ".xz": lzma.open,
}
"""Compressed files read as what they hold: `chats.jsonl.gz` is JSONL, `notes.txt.xz` text."""
ARCHIVES = (".tar", ".tgz", ".zip")
"""Archives of several files: never read as one text (a folder of them is read instead)."""


class DataError(DFlashError):
    """The corpus cannot be used; the message is one line naming file (and line)."""


class NotText(DataError):
    """A file that is not UTF-8 text (`reason`: where and why), skipped in a folder."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"cannot read {path} as UTF-8 text ({reason})")
        self.reason = f"not UTF-8 ({reason})"


@dataclass
class DataReport:
    """Lines skipped while reading and what packing did; printed once at startup."""

    skipped_lines: int = 0
    first_bad_line: str | None = None  # "file:line: reason" of the first skipped line
    cut_replies: int = 0  # conversations left out: regenerate cut a reply at its budget
    pack: PackReport = field(default_factory=PackReport)
    skipped_files: int = 0  # files of a folder that are not UTF-8 text (binaries, archives)
    first_skipped_file: str | None = None  # "path: reason" of the first

    def skip(self, where: str, reason: str) -> None:
        self.skipped_lines += 1
        if self.first_bad_line is None:
            self.first_bad_line = f"{where}: {reason}"

    def skip_file(self, path: Path, reason: str) -> None:
        self.skipped_files += 1
        if self.first_skipped_file is None:
            self.first_skipped_file = f"{path}: {reason}"

    def lines(self, seq_len: int) -> list[str]:
        out = []
        if self.skipped_lines:
            out.append(
                f"data: skipped {self.skipped_lines} unusable JSONL lines "
                f"(first: {self.first_bad_line})"
            )
        if self.skipped_files:
            out.append(
                f"data: skipped {self.skipped_files} files that are not UTF-8 text "
                f"(first: {self.first_skipped_file})"
            )
        if self.cut_replies:
            out.append(
                f"data: {self.cut_replies} conversations left out: regenerate cut a reply at "
                "--max-new-tokens (--keep-cut-replies trains on them)"
            )
        return out + self.pack.lines(seq_len)


def _record_problem(obj: object) -> str | None:
    """Why a parsed JSONL line is unusable, or None."""
    if not isinstance(obj, dict):
        return f"expected an object, got {type(obj).__name__}"
    if isinstance(obj.get("text"), str):
        return None
    messages = obj.get("messages")
    if messages is None:
        return "expected an object with a 'text' string or 'messages'"
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list"
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
            return "each message needs string 'role' and 'content'"
        if not isinstance(m.get("content"), str):
            return "each message needs string 'role' and 'content'"
        if m["role"] not in KNOWN_ROLES:
            return f"unknown role {m['role']!r} (expected one of {', '.join(sorted(KNOWN_ROLES))})"
    return None


# Any: a JSON value as json.loads gives it, of any JSON type until _record_problem checks it
def parse_line(line: str) -> tuple[Any, str | None]:
    """A JSONL line parsed, or (None, why it is malformed): not JSON, nested too deeply
    for the parser (a RecursionError), or a `\\u` escape of half a surrogate pair
    (JSON allows it; it is no Unicode text and no tokenizer takes it)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        return None, f"malformed JSON ({exc.msg})"
    except RecursionError:
        return None, "malformed JSON (nested too deeply to read)"
    if "\\u" in line:  # only an escape can make a lone surrogate
        try:
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            return None, "malformed JSON (a \\u escape of half a surrogate pair: no Unicode text)"
        except RecursionError:
            return None, "malformed JSON (nested too deeply to read)"
    return obj, None


def read_text(path: Path) -> str:
    """The UTF-8 text of a file, decompressed by its suffix (COMPRESSED); DataError when
    it cannot be read, is compressed but damaged, or is not UTF-8."""
    opener = COMPRESSED.get(path.suffix.lower())
    try:
        if opener is None:
            return path.read_text(encoding="utf-8")
        with opener(path, "rb") as f:
            return f.read().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise NotText(path, f"byte {exc.start}: {exc.reason}") from None
    except (OSError, EOFError, lzma.LZMAError, zlib.error) as exc:
        what = "decompress" if opener is not None else "read"
        why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        raise DataError(f"cannot {what} {path}: {why}") from None


def inner_suffix(path: Path) -> str:
    """The suffix of what a file holds: `.jsonl` for `chats.jsonl.gz`."""
    name = path.name.lower()
    for suffix in COMPRESSED:
        if name.endswith(suffix):
            return Path(name[: -len(suffix)]).suffix
    return path.suffix.lower()


def check_finished(path: Path) -> None:
    """A JSONL file that `regenerate` writes is trained on only once it is complete: its
    `<file>.run.json` record gives the lines it will hold. One still being written (its
    lock is held) or left unfinished (an interrupted run) is one DataError."""
    try:
        record = json.loads(record_path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # no record: a file of the user's
    if not (isinstance(record, dict) and isinstance(record.get("lines"), int)):
        return  # another command's record (eval --json, inspect-data --json)
    if not {"target", "settings"} <= record.keys():
        return
    try:
        with open(path, "rb") as f:
            lines = sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 22), b""))
    except OSError:
        return  # reading it says why
    total = record["lines"]
    if lines >= total:
        return
    holder = lock_holder(output_lock_path(path))
    if holder is not None:
        raise DataError(
            f"--data {str(path)!r} is still being written by dflash-train regenerate "
            f"({holder}): {lines:,} of its {total:,} lines so far; train on it once that "
            "command has finished"
        )
    raise DataError(
        f"--data {str(path)!r} is an unfinished regenerate output: {lines:,} of its "
        f"{total:,} lines ({record_path(path).name} says); run the same dflash-train "
        "regenerate command again to finish it (it continues where it stopped)"
    )


def iter_jsonl(path: Path, report: DataReport) -> Iterator[tuple[int, dict]]:
    """(line number, object) of every usable line; the others are counted in `report`.
    Compressed by its suffix or not; refused while `regenerate` has not finished it."""
    if path.suffix.lower() not in COMPRESSED:
        check_finished(path)
    lines = read_text(path).splitlines()
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        obj, malformed = parse_line(line)
        if malformed is not None:
            report.skip(f"{path}:{lineno}", malformed)
            continue
        problem = _record_problem(obj)
        if problem is not None:
            report.skip(f"{path}:{lineno}", problem)
            continue
        yield lineno, obj


def json_records(path: Path, text: str, report: DataReport) -> list[tuple[str, dict]] | None:
    """(where, object) of the usable records of a JSON file that holds records: an array
    of objects (each like a JSONL line; the others counted), or one object with `text` or
    `messages`. None when it holds something else (a config file, not JSON at all)."""
    obj, malformed = parse_line(text)
    if malformed is not None:
        return None
    if isinstance(obj, dict):
        if "text" not in obj and "messages" not in obj:
            return None
        items = [obj]
    elif isinstance(obj, list) and obj and any(isinstance(item, dict) for item in obj):
        items = obj
    else:
        return None
    records = []
    for index, item in enumerate(items):
        where = f"{path}[{index}]" if isinstance(obj, list) else str(path)
        problem = _record_problem(item)
        if problem is not None:
            report.skip(where, problem)
            continue
        records.append((where, item))
    return records


def source_files(folder: Path) -> list[Path]:
    """The files of a --data folder, sorted: hidden ones and the records dflash-train
    keeps beside a file it wrote (`<file>.run.json`) left out."""
    files = []
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        if any(part.startswith(".") for part in file.relative_to(folder).parts):
            continue
        if (
            file.name.endswith(RECORD_SUFFIX)
            and file.with_name(file.name.removesuffix(RECORD_SUFFIX)).is_file()
        ):
            continue
        files.append(file)
    return files


def read_source(source: str, report: DataReport) -> Iterator[tuple[str, dict | str]]:
    """(where, content) of everything `--data` (a file or a folder) holds: a record
    (dict) of a JSONL or JSON file, or the text of a text file. In a folder a file that
    is not UTF-8 text is skipped and counted in `report`; given alone it is refused."""
    path = Path(source).expanduser()
    if not path.exists():
        raise DataError(f"--data {source!r}: no such file or folder")
    kind = special_file(path)
    if kind is not None:
        raise DataError(f"--data {source!r}: {kind}, not a regular file or a folder")
    alone = path.is_file()
    for file in [path] if alone else source_files(path):
        suffix = inner_suffix(file)
        if suffix in ARCHIVES or file.name.lower().endswith(ARCHIVES):
            if alone:
                raise DataError(f"--data {source!r}: an archive; unpack it and give the folder")
            report.skip_file(file, "an archive (unpack it to read it)")
            continue
        if suffix == ".jsonl":
            for lineno, obj in iter_jsonl(file, report):
                yield f"{file}:{lineno}", obj
            continue
        try:
            text = read_text(file)
        except NotText as exc:
            if alone:
                raise
            report.skip_file(file, exc.reason)  # a binary file among the sources
            continue
        records = json_records(file, text, report) if suffix == ".json" else None
        if records is not None:
            yield from records
        elif alone and suffix == ".json":
            raise DataError(
                f"--data {source!r}: a JSON file that holds no records (an array of "
                '{"text": ...} or {"messages": [...]} objects); to train on it as text, '
                "give it another suffix (.txt)"
            )
        else:
            yield str(file), text


CUT_KEY = "cut_at_max_new_tokens"
"""Set by `regenerate` on a reply that ran out of tokens: it ends mid-sentence, and a
drafter trained on it learns endings the target does not write."""


def read_jsonl(
    path: Path,
    tokenizer: Tokenizer,
    report: DataReport | None = None,
    keep_cut: bool = False,
    rendering: str = "whole",
) -> list[Document]:
    """Documents of a JSONL file: one object per line with `text` or `messages`; a
    conversation with a reply `regenerate` cut is left out (counted) unless `keep_cut`.
    `rendering` (--chat-rendering) makes a conversation one document or one per reply;
    those of one conversation share its key (`content_key`), and so its side of the
    held-out split."""
    report = report if report is not None else DataReport()
    docs: list[Document] = []
    templated = bool(getattr(tokenizer, "chat_template", None))
    for lineno, obj in iter_jsonl(path, report):
        where = f"{path}:{lineno}"
        docs += _record_documents(where, obj, tokenizer, report, keep_cut, rendering, templated)
    return docs


def _record_documents(
    where: str,
    obj: dict,
    tokenizer: Tokenizer,
    report: DataReport,
    keep_cut: bool,
    rendering: str,
    templated: bool,
) -> list[Document]:
    """The documents of one usable record (`read_jsonl`)."""
    key = content_key(obj)
    if isinstance(obj.get("text"), str):
        (ids,) = encode_texts(tokenizer, [obj["text"]])
        return [Document(key, ids, np.ones(len(ids), bool))]
    if not keep_cut and any(m.get(CUT_KEY) for m in obj["messages"]):
        report.cut_replies += 1
        return []
    try:
        chats = render_documents(tokenizer, obj["messages"], rendering)
    except ChatTemplateError as exc:
        raise DataError(f"{where}: {exc}") from None
    return [Document(key, c.ids, c.mask, templated, c.turn_ends) for c in chats]


def read_documents(
    source: str,
    tokenizer: Tokenizer,
    report: DataReport | None = None,
    keep_cut: bool = False,
    rendering: str = "whole",
) -> list[Document]:
    """Documents of a text file, a JSONL or JSON file, or a folder of them (`read_source`;
    records as `read_jsonl` makes them)."""
    report = report if report is not None else DataReport()
    docs: list[Document] = []
    templated = bool(getattr(tokenizer, "chat_template", None))
    for where, content in read_source(source, report):
        if isinstance(content, str):
            (ids,) = encode_texts(tokenizer, [content])
            docs.append(Document(content_key(content), ids, np.ones(len(ids), bool)))
            continue
        docs += _record_documents(where, content, tokenizer, report, keep_cut, rendering, templated)
    return docs
