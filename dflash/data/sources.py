"""Reading corpora: text files, folders and JSONL (plain text or conversations).

An unusable JSONL line (not an object, no `text`/`messages`, an unknown role, bad
JSON) is skipped and counted; the caller decides whether anything usable is left.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dflash.data.chat import KNOWN_ROLES, ChatTemplateError, render_documents
from dflash.data.packing import Document, PackReport, content_key
from dflash.data.tokenizer import Tokenizer, encode_texts
from dflash.errors import DFlashError


class DataError(DFlashError):
    """The corpus cannot be used; the message is one line naming file (and line)."""


@dataclass
class DataReport:
    """Lines skipped while reading and what packing did; printed once at startup."""

    skipped_lines: int = 0
    first_bad_line: str | None = None  # "file:line: reason" of the first skipped line
    cut_replies: int = 0  # conversations left out: regenerate cut a reply at its budget
    pack: PackReport = field(default_factory=PackReport)

    def skip(self, where: str, reason: str) -> None:
        self.skipped_lines += 1
        if self.first_bad_line is None:
            self.first_bad_line = f"{where}: {reason}"

    def lines(self, seq_len: int) -> list[str]:
        out = []
        if self.skipped_lines:
            out.append(
                f"data: skipped {self.skipped_lines} unusable JSONL lines "
                f"(first: {self.first_bad_line})"
            )
        if self.cut_replies:
            out.append(
                f"data: {self.cut_replies} conversations left out: regenerate cut a reply at "
                "--max-new-tokens (--keep-cut-replies trains on them)"
            )
        return out + self.pack.lines(seq_len)


def _record_problem(obj: Any) -> str | None:
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


def iter_jsonl(path: Path, report: DataReport) -> Iterator[tuple[int, dict]]:
    """(line number, object) of every usable line; the others are counted in `report`."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read {path}: {exc}") from exc
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            report.skip(f"{path}:{lineno}", f"malformed JSON ({exc.msg})")
            continue
        problem = _record_problem(obj)
        if problem is not None:
            report.skip(f"{path}:{lineno}", problem)
            continue
        yield lineno, obj


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
        where, key = f"{path}:{lineno}", content_key(obj)
        if isinstance(obj.get("text"), str):
            (ids,) = encode_texts(tokenizer, [obj["text"]])
            docs.append(Document(key, ids, np.ones(len(ids), bool)))
            continue
        if not keep_cut and any(m.get(CUT_KEY) for m in obj["messages"]):
            report.cut_replies += 1
            continue
        try:
            chats = render_documents(tokenizer, obj["messages"], rendering)
        except ChatTemplateError as exc:
            raise DataError(f"{where}: {exc}") from None
        docs += [Document(key, c.ids, c.mask, templated, c.turn_ends) for c in chats]
    return docs


def _read_text_file(path: Path, tokenizer: Tokenizer) -> list[Document]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read {path} as UTF-8 text: {exc}") from exc
    (ids,) = encode_texts(tokenizer, [text])
    return [Document(content_key(text), ids, np.ones(len(ids), bool))]


def read_documents(
    source: str,
    tokenizer: Tokenizer,
    report: DataReport | None = None,
    keep_cut: bool = False,
    rendering: str = "whole",
) -> list[Document]:
    """Documents of a text file, a JSONL file or a folder of them (`read_jsonl`)."""
    report = report if report is not None else DataReport()
    path = Path(source).expanduser()
    if not path.exists():
        raise DataError(f"--data {source!r}: no such file or folder")
    if path.is_file():
        if path.suffix == ".jsonl":
            return read_jsonl(path, tokenizer, report, keep_cut, rendering)
        return _read_text_file(path, tokenizer)
    docs: list[Document] = []
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        rel = file.relative_to(path)
        if any(part.startswith(".") for part in rel.parts):
            continue
        if file.suffix == ".jsonl":
            docs += read_jsonl(file, tokenizer, report, keep_cut, rendering)
            continue
        try:
            docs += _read_text_file(file, tokenizer)
        except DataError:
            continue  # binary files in a folder are skipped, not fatal
    return docs
