"""Regenerate training data with the target's own replies.

Conversations: every assistant turn is replaced, in order, by what the target
writes given the conversation so far (earlier turns already regenerated). Plain
text: held-in documents are cut into windows of prefix_tokens + max_new_tokens;
each window's prefix is kept and its continuation regenerated. The output has the
input's JSONL shape, one line per conversation or window, in input order.

Output is written in chunks of whole lines beside a `<output>.run.json` record of
the run; an interrupted run continues after the last complete chunk, and an
existing output from another run (or without the record) is refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypedDict

import torch

from dflash.config.settings import DataConfig
from dflash.data.chat import chat_prompt_ids
from dflash.data.corpus import (
    EMBEDDED,
    EMBEDDED_CORPUS,
    Corpus,
    embedded_corpus,
    embedded_key,
    embedded_tokens,
    is_heldout,
)
from dflash.data.packing import content_key, frame
from dflash.data.sources import CUT_KEY, DataReport, read_jsonl, read_source
from dflash.data.tokenizer import Tokenizer, decode_text, encode_texts, special_ids
from dflash.files import cache_dir, free_space_note, write_json_atomic
from dflash.offline.config import RegenerateConfig, RegenerateError
from dflash.summary import JSON
from dflash.target.generation import generate_batch, generate_padded
from dflash.target.model import TargetModel, target_fingerprint
from dflash.target.served import CompletionClient, TokenizerTarget

RECORD_FORMAT = 2
"""Of `<output>.run.json`: 2 since held-out documents are chosen by their content (1: by
their file path, which the same data at another path did not match)."""


@dataclass
class RegenProgress:
    lines_done: int
    lines_total: int
    new_tokens: int  # generated in this invocation
    tokens_per_s: float


@dataclass
class RegenReport:
    output: Path
    lines: int
    resumed_from_line: int
    new_tokens: int
    wall_s: float
    skipped: DataReport = field(default_factory=DataReport)


# --------------------------------------------------------------------------- items


def window_starts(num_tokens: int, settings: RegenerateConfig) -> list[int]:
    """Starts of the prefix_tokens + max_new_tokens windows of a text of num_tokens."""
    window = settings.prefix_tokens + settings.max_new_tokens
    starts = list(range(0, max(num_tokens - settings.prefix_tokens + 1, 0), window))
    k = settings.windows_per_document
    if k is not None and len(starts) > k:
        starts = [starts[round(i * (len(starts) - 1) / max(k - 1, 1))] for i in range(k)]
    return starts


def _text_windows(tokenizer: Tokenizer, text: str, settings: RegenerateConfig) -> list[list[int]]:
    """Prefixes (token ids) of the windows of one document."""
    (ids,) = encode_texts(tokenizer, [text])
    return [ids[s : s + settings.prefix_tokens].tolist() for s in window_starts(len(ids), settings)]


def read_items(source: str, report: DataReport, heldout_fraction: float) -> list[JSON]:
    """Held-in records of `source`: {"text": ...} or {"messages": [...]} objects."""
    if source in (EMBEDDED, EMBEDDED_CORPUS):
        return [{"text": t} for t in embedded_corpus("train", heldout_fraction)]
    path = Path(source).expanduser()
    if not path.exists():
        raise RegenerateError(f"--data {source!r}: no such file or folder")
    items: list[JSON] = []
    for _, content in read_source(source, report):  # files as training reads them
        if not is_heldout(content_key(content), heldout_fraction):
            items.append({"text": content} if isinstance(content, str) else content)
    return items


def expand_items(tokenizer: Tokenizer, items: list[dict], settings: RegenerateConfig) -> list[dict]:
    """Conversations stay one item each; a text becomes one item per window."""
    out: list[dict] = []
    for obj in items:
        if "messages" in obj:
            out.append(obj)
            continue
        extra = {k: v for k, v in obj.items() if k != "text"}
        out += [{**extra, "_prefix": p} for p in _text_windows(tokenizer, obj["text"], settings)]
    return out


# --------------------------------------------------------------------------- decoding


@dataclass
class Reply:
    """One generated reply: its new token ids (decoded here) or a server's text."""

    tokens: list[int] | None
    text: str | None
    cut: bool  # ended at --max-new-tokens, not at a stop token

    def decoded(self, tokenizer: Tokenizer, prefix: list[int] | None = None) -> str:
        """The reply's text (`prefix`: the window's kept tokens, before it)."""
        if self.tokens is not None:
            return decode_text(tokenizer, (prefix or []) + self.tokens)
        head = decode_text(tokenizer, prefix) if prefix else ""
        return head + (self.text or "")


class _Sampling(TypedDict):
    """The sampling keywords generate_padded and generate_batch share."""

    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    temperature: float


class _SeededSampling(_Sampling):
    """generate_batch's keywords: the shared ones and its random generator."""

    generator: torch.Generator


class _Decoder:
    """Runs prompts in batches; counts generated tokens."""

    def __init__(
        self,
        target: TargetModel,
        settings: RegenerateConfig,
        chunk: int,
        on_batch: Callable[[int], None] | None = None,
    ) -> None:
        self.target, self.settings, self.chunk = target, settings, chunk
        self.stops = settings.stop_token_ids or target.stop_token_ids
        self.generator = torch.Generator().manual_seed(settings.seed * 1_000_003 + chunk)
        self.new_tokens = 0
        self.batches = 0
        self.on_batch = on_batch  # after each batch: this chunk's new tokens so far

    def replies(self, prompts: list[list[int]]) -> list[Reply]:
        cap = self.settings.max_new_tokens
        return [Reply(new, None, len(new) >= cap) for new in self.run(prompts)]

    def run(self, prompts: list[list[int]]) -> list[list[int]]:
        if self.target.is_hf:
            return self._run_padded(prompts)
        return self._run_by_length(prompts)

    def _sampling(self) -> _Sampling:
        """The generate functions' sampling arguments, from the settings."""
        return {
            "max_new_tokens": self.settings.max_new_tokens,
            "stop_token_ids": self.stops,
            "temperature": self.settings.temperature,
        }

    def _run_padded(self, prompts: list[list[int]]) -> list[list[int]]:
        """Prompts of any length share a batch (left padding, attention mask); sorted by
        length first, so a batch wastes little on padding."""
        results: list[list[int]] = [[] for _ in prompts]
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        size = self.settings.batch_size
        for s in range(0, len(order), size):
            part = order[s : s + size]
            self.batches += 1
            batch = [prompts[i] for i in part]
            seed = self.settings.seed * 1_000_003 + self.chunk * 1_009 + self.batches
            outs = generate_padded(self.target, batch, **self._sampling(), seed=seed)
            for i, new in zip(part, outs, strict=True):
                results[i] = new
                self.new_tokens += len(new)
            if self.on_batch is not None:
                self.on_batch(self.new_tokens)
        return results

    def _run_by_length(self, prompts: list[list[int]]) -> list[list[int]]:
        """The tiny target: prompts of one length share a batch (its cache is unpadded)."""
        results: list[list[int]] = [[] for _ in prompts]
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        groups: dict[int, list[int]] = {}
        for i in order:
            groups.setdefault(len(prompts[i]), []).append(i)
        size = self.settings.batch_size
        sampling: _SeededSampling = {**self._sampling(), "generator": self.generator}
        for members in groups.values():
            for s in range(0, len(members), size):
                part = members[s : s + size]
                outs = generate_batch(self.target, [prompts[i] for i in part], **sampling)
                for i, new in zip(part, outs, strict=True):
                    results[i] = new
                    self.new_tokens += len(new)
                if self.on_batch is not None:  # the progress line's tokens/s counts these
                    self.on_batch(self.new_tokens)
        return results


class _ServerDecoder:
    """Prompts answered by an OpenAI-compatible server, `--concurrency` at a time."""

    def __init__(
        self,
        target: TokenizerTarget,
        client: CompletionClient,
        settings: RegenerateConfig,
        chunk: int,
        on_batch: Callable[[int], None] | None = None,
        on_queued: Callable[[], None] | None = None,
    ) -> None:
        self.target, self.client, self.settings, self.chunk = target, client, settings, chunk
        self.stops = settings.stop_token_ids
        self.new_tokens = 0
        self.on_batch, self.on_queued = on_batch, on_queued
        self._wave = 0

    def replies(self, prompts: list[list[int]]) -> list[Reply]:
        self._wave += 1
        settings = self.settings
        sampling = {"max_tokens": settings.max_new_tokens, "temperature": settings.temperature}
        seed = settings.seed * 1_000_003 + self.chunk * 1_009 + self._wave * 65_537
        done = self.client.complete_all(
            prompts,
            **sampling,
            stop_token_ids=self.stops,
            seed=seed,
            priority=(self.chunk, self._wave),
            on_queued=self.on_queued if prompts else None,
        )
        self.new_tokens += sum(c.tokens for c in done)
        if self.on_batch is not None:
            self.on_batch(self.new_tokens)
        return [Reply(None, c.text, c.cut) for c in done]


def regenerate_chunk(decoder: _Decoder | _ServerDecoder, items: list[dict]) -> list[dict]:
    """The regenerated records of `items` (assistant turns in waves, texts at once). A
    conversation that ends with a user turn (a prompt set) gets the reply to it."""
    tok = decoder.target.tokenizer
    records = [
        {**o, "messages": [dict(m) for m in o["messages"]]} if "messages" in o else dict(o)
        for o in items
    ]
    for record in records:
        messages = record.get("messages")
        if messages and messages[-1]["role"] == "user":
            messages.append({"role": "assistant", "content": ""})
    prefixes = [r.pop("_prefix") if "_prefix" in r else None for r in records]
    texts = [(i, p) for i, p in enumerate(prefixes) if p is not None]
    for (i, prefix), reply in zip(texts, decoder.replies([p for _, p in texts]), strict=True):
        records[i]["text"] = reply.decoded(tok, prefix)
    turn = 0
    while True:  # wave `turn`: the turn-th assistant reply of every conversation that has one
        wave = []
        for i, r in enumerate(records):
            spots = [j for j, m in enumerate(r.get("messages", [])) if m["role"] == "assistant"]
            if turn < len(spots):
                wave.append((i, spots[turn]))
        if not wave:
            return records
        prompts = [chat_prompt_ids(tok, records[i]["messages"][:j]) for i, j in wave]
        for (i, j), reply in zip(wave, decoder.replies(prompts), strict=True):
            message = records[i]["messages"][j]
            message["content"] = reply.decoded(tok)
            message.pop(CUT_KEY, None)
            if reply.cut:  # no stop token came in time
                message[CUT_KEY] = True
        turn += 1


# --------------------------------------------------------------------------- resumable output


def run_record(
    target: TargetModel | TokenizerTarget,
    items: list[dict],
    settings: RegenerateConfig,
    server: CompletionClient | None = None,
) -> dict:
    """What identifies a regeneration run: target (or the model a server serves),
    inputs and settings."""
    data = hashlib.sha256(json.dumps(items, sort_keys=True, default=str).encode()).hexdigest()
    template = {"chat_template_kwargs": target.chat_template_kwargs}
    if server is not None:
        # (mypy ignore below) a served target is a ServedTarget here
        identity = server.identity(target)  # type: ignore[arg-type]
    else:
        # (mypy ignore below) an in-process target is a TargetModel here
        identity = target_fingerprint(target)  # type: ignore[arg-type]
    return {
        **(template if target.chat_template_kwargs else {}),  # older records stay resumable
        "format": RECORD_FORMAT,
        "target": target.spec,
        "target_hash": identity,
        "data": data[:20],
        "lines": len(items),
        "settings": json.loads(json.dumps(asdict(settings))),
    }


def _resume_point(output: Path, record: dict, chunk_lines: int) -> int:
    """Lines of `output` to keep (whole chunks); refuses an output of another run."""
    meta = output.with_name(output.name + ".run.json")
    if not output.exists():
        write_json_atomic(meta, record)
        return 0
    try:
        saved = json.loads(meta.read_text())
    except (OSError, ValueError):
        saved = None
    if isinstance(saved, dict) and saved.get("format") == 1:
        raise RegenerateError(
            f"--output {output} was begun by an earlier dflash-train, which held documents "
            "out by their file path (this one: by their content, so the records it "
            "regenerates differ): finish it with that version, or choose another --output"
        )
    if saved != record:
        why = "no run record" if saved is None else "its run record differs"
        raise RegenerateError(
            f"--output {output} exists and is not a resumable file of this run ({why} "
            f"in {meta.name}): choose another --output or delete it"
        )
    with open(output, "rb") as f:
        lines = f.read().split(b"\n")
    complete = len(lines) - 1  # the piece after the last newline is not a whole line
    if complete > record["lines"]:
        raise RegenerateError(
            f"--output {output} has {complete} lines, more than this run writes ({record['lines']})"
        )
    keep = complete if complete == record["lines"] else complete // chunk_lines * chunk_lines
    if keep != complete or lines[-1]:
        with open(output, "wb") as f:
            f.write(b"".join(line + b"\n" for line in lines[:keep]))
    return keep


def regenerate(
    target: TargetModel | TokenizerTarget,
    source: str,
    output: Path | str,
    *,
    settings: RegenerateConfig,
    progress: Callable[[RegenProgress], None] | None = None,
    server: CompletionClient | None = None,
) -> RegenReport:
    """Regenerate `source` (`embedded`, a text file/folder or JSONL) into `output`, by
    the target in this process or (`server`, with a TokenizerTarget) by a server."""
    start_s, out = time.perf_counter(), Path(output)
    report = DataReport()
    items = expand_items(
        target.tokenizer, read_items(source, report, settings.heldout_fraction), settings
    )
    if not items:
        first = f" (skipped {report.skipped_lines} lines; first: {report.first_bad_line})"
        raise RegenerateError(
            f"--data {source!r}: nothing to regenerate" + (first if report.skipped_lines else "")
        )
    chats = [item["messages"] for item in items if "messages" in item]
    if chats and not any(m["role"] == "user" for messages in chats for m in messages):
        raise RegenerateError(
            f"--data {source!r}: no conversation has a user turn, so there is nothing for the "
            "target to answer (a prompt set needs at least one user message per line)"
        )
    record = run_record(target, items, settings, server)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        done = first_line = _resume_point(out, record, settings.chunk_lines)
    except OSError as exc:
        raise write_failure(exc, out, 0) from None
    lock = threading.Lock()
    written, sent = done, 0  # lines in the file; new tokens of every chunk, written or not

    def decode(begin: int, queued: threading.Event | None = None) -> tuple[list[dict], int]:
        chunk, seen = begin // settings.chunk_lines, 0

        def batch_done(chunk_tokens: int) -> None:
            nonlocal seen, sent
            with lock:  # chunks decoded ahead report from their own thread
                sent, seen = sent + chunk_tokens - seen, chunk_tokens
                if progress is not None:  # tokens/s between chunks, lines at their ends
                    rate = sent / max(time.perf_counter() - start_s, 1e-9)
                    progress(RegenProgress(written, len(items), sent, rate))

        decoder: _Decoder | _ServerDecoder
        if server is not None:
            queued_fn = None if queued is None else queued.set
            # (mypy ignore below) a served target is a ServedTarget here
            decoder = _ServerDecoder(target, server, settings, chunk, batch_done, queued_fn)  # type: ignore[arg-type]
        else:
            # (mypy ignore below) an in-process target is a TargetModel here
            decoder = _Decoder(target, settings, chunk, batch_done)  # type: ignore[arg-type]
        try:
            records = regenerate_chunk(decoder, items[begin : begin + settings.chunk_lines])
        finally:
            if queued is not None:
                queued.set()
        return records, decoder.new_tokens

    new_tokens = 0
    begins = range(done, len(items), settings.chunk_lines)
    # Unbuffered: a chunk that cannot be written is cut off again at once (`append_lines`),
    # with nothing left in a buffer for closing the file to fail on once more.
    chunks = contextlib.closing(_in_order(begins, decode, server))  # closed on any error
    with open(out, "ab", buffering=0) as f, chunks as decoded:
        for begin, (records, tokens) in decoded:
            text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
            append_lines(f.fileno(), text.encode("utf-8"), out, begin)
            with lock:
                written, new_tokens = begin + len(records), new_tokens + tokens
                if progress is not None:
                    rate = sent / max(time.perf_counter() - start_s, 1e-9)
                    progress(RegenProgress(written, len(items), new_tokens, rate))
    wall_s = time.perf_counter() - start_s
    return RegenReport(out, len(items), first_line, new_tokens, wall_s, report)


def _in_order(
    begins: range,
    decode: Callable[[int, threading.Event | None], tuple[list[dict], int]],
    server: CompletionClient | None,
) -> Iterator[tuple[int, tuple[list[dict], int]]]:
    """Each chunk's records, in order. With a server the next chunk is decoded while the
    last replies of one come in, so `--concurrency` requests stay in flight across chunk
    boundaries (without, a chunk's slowest reply left the server half idle); its requests
    queue behind the earlier chunk's (CompletionClient's priorities)."""
    if server is None:
        for begin in begins:
            yield begin, decode(begin, None)
        return
    pending: deque[tuple[int, Future[tuple[list[dict], int]]]] = deque()
    with ThreadPoolExecutor(2, thread_name_prefix="regen-chunk") as pool:
        try:
            for begin in begins:
                queued = threading.Event()
                pending.append((begin, pool.submit(decode, begin, queued)))
                queued.wait()  # so that the chunk after it is queued behind its first prompts
                if len(pending) == 2:
                    first, future = pending.popleft()
                    yield first, future.result()
            while pending:
                first, future = pending.popleft()
                yield first, future.result()
        finally:
            if pending:  # the run stops: the chunk ahead sends nothing more
                server.stop()


def append_lines(fd: int, data: bytes, path: Path, lines_before: int) -> None:
    """Appends whole lines to `path` (open as `fd`) and syncs them; a write that fails
    (a full disk) leaves the file as it was, without a partial last line, and is one
    RegenerateError naming the path, the space left and the lines that are complete."""
    start = os.lseek(fd, 0, os.SEEK_END)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except OSError as exc:
        with contextlib.suppress(OSError):  # else the next run drops it (_resume_point)
            os.ftruncate(fd, start)
        raise write_failure(exc, path, lines_before) from None


def write_failure(exc: OSError, path: Path, lines: int) -> RegenerateError:
    """The one-line error of a write to `path` that failed with `lines` complete."""
    free = free_space_note(path)
    return RegenerateError(
        f"--output {path}: could not write ({exc.strerror or type(exc).__name__}; {free}): "
        f"its first {lines} lines are complete; the same command continues after them once "
        "there is room"
    )


# --------------------------------------------------------------------------- the embedded default

# The recipe of `--data embedded`: two windows per held-in document, 64 tokens of
# corpus text continued by 64 of the target's greedy tokens.
EMBEDDED_RECIPE = RegenerateConfig(
    max_new_tokens=64, prefix_tokens=64, windows_per_document=2, batch_size=64, chunk_lines=128
)


def embedded_regeneration(
    target: TargetModel,
    heldout_fraction: float = DataConfig.heldout_fraction,
    log: Callable[[str], None] = print,
) -> Path:
    """The target's continuations of the embedded corpus' held-in prefixes (JSONL),
    regenerated once per target and recipe and cached under cache_dir()/regen; an
    interrupted regeneration continues where it stopped, and a cached one that is cut
    short or changed (`cache_damage`) is generated again, never read as complete."""
    settings = dataclasses.replace(EMBEDDED_RECIPE, heldout_fraction=heldout_fraction)
    made_from = {
        "target": target_fingerprint(target),
        "recipe": asdict(settings),
        "corpus": embedded_key(target.tokenizer, heldout_fraction),
    }
    key = hashlib.sha256(json.dumps(made_from, sort_keys=True).encode()).hexdigest()[:20]
    path = cache_dir() / "regen" / f"embedded-{key}.jsonl"
    if path.exists() and cache_damage(path) is None:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f".{path.stem}.lock"), "w") as lock:
        # Runs started together: one regenerates, the others wait and read its file.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            why = cache_damage(path)
            if why is None:
                return path
            log(f"data: the cached regeneration {path} {why}: it is generated again")
            path.unlink()
            cache_check_path(path).unlink(missing_ok=True)
        _regenerate_embedded(target, settings, path, log)
    return path


def cache_check_path(path: Path) -> Path:
    """`embedded-KEY.check.json` beside a cached regeneration: its lines and SHA-256."""
    return path.with_name(f"{path.stem}.check.json")


def _lines_and_digest(path: Path) -> tuple[int, str]:
    digest, lines = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
            lines += chunk.count(b"\n")
    return lines, digest.hexdigest()


def cache_damage(path: Path) -> str | None:
    """Why a cached regeneration cannot be used as complete (cut short, changed, or
    without the record of its lines and SHA-256 that completing it wrote), or None."""
    try:
        check = json.loads(cache_check_path(path).read_text(encoding="utf-8"))
        lines, digest = int(check["lines"]), str(check["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        return "has no record of its length and checksum (an earlier version wrote it)"
    try:
        found, found_digest = _lines_and_digest(path)
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if found != lines:
        return f"holds {found:,} of its {lines:,} lines"
    if found_digest != digest:
        return "is not the file that was written (its SHA-256 differs)"
    return None


def _regenerate_embedded(
    target: TargetModel, settings: RegenerateConfig, path: Path, log: Callable[[str], None]
) -> None:
    partial = path.with_name(f".{path.stem}.partial.jsonl")
    what = "the target's own continuations of the embedded corpus"
    log(f"data: {what}, generated once ({target.spec}; cached as {path})")
    step = [1.0]  # from the first window written: batches report before any is

    def progress(p: RegenProgress) -> None:
        if p.lines_done >= step[0] or p.lines_done == p.lines_total:
            rate = f"{p.tokens_per_s:,.0f} tokens/s"
            log(f"data: regenerated {p.lines_done}/{p.lines_total} windows, {rate}")
            step[0] = p.lines_done + p.lines_total / 4

    report = regenerate(target, EMBEDDED, partial, settings=settings, progress=progress)
    lines, digest = _lines_and_digest(partial)
    write_json_atomic(cache_check_path(path), {"lines": lines, "sha256": digest})
    os.replace(partial, path)
    partial.with_name(partial.name + ".run.json").unlink(missing_ok=True)
    log(f"data: {report.new_tokens:,} tokens regenerated in {report.wall_s:.1f} s")


def regenerated_corpus(
    path: Path, tokenizer: Tokenizer, heldout_fraction: float = DataConfig.heldout_fraction
) -> Corpus:
    """Training documents of a regenerated JSONL file (all of it: it holds held-in text
    only), held-out documents of the embedded corpus (the prompts evaluation uses)."""
    report = DataReport()
    eos, bos = special_ids(tokenizer)
    train = [frame(d, bos, eos) for d in read_jsonl(path, tokenizer, report) if len(d.ids)]
    if not train:
        raise RegenerateError(f"regenerated data {path} holds no text: delete it to regenerate")
    return Corpus(train, embedded_tokens(tokenizer, heldout_fraction).heldout, report)
