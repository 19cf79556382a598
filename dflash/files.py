"""Files every part writes or checks: the cache folder, atomic replacement, hashes.

A file another process may read (a config, a summary, a cache shard, a drafter's
weights) is written to a hidden temporary sibling and renamed over its final name, so
a reader sees the old file or the new one, never half of one.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

FILE_MODE = 0o644
RECORD_SUFFIX = ".run.json"
"""`<output>.run.json`: the record of the command that wrote `output` (regenerate's run
record; `eval --json` and `inspect-data --json`: the command and the file's SHA-256), so
that a later command replaces only what it wrote itself."""


OUTPUT_LOCK_SUFFIX = ".dflash-lock"
"""`.NAME.dflash-lock` beside output NAME: the lock its writer holds (dflash.run.folder's
`FolderLock.for_output` takes it)."""


def cache_dir() -> Path:
    """${DFLASH_CACHE_DIR:-~/.cache/dflash-train} (an empty variable means the default)."""
    return Path(os.environ.get("DFLASH_CACHE_DIR") or Path.home() / ".cache" / "dflash-train")


def unwritable(path: Path | str, folder: bool = False) -> str | None:
    """Why `path` could not be written as a file (`folder`: as a folder to write into),
    found without writing anything; None when it can be. The parents a write would
    create need a writable existing ancestor."""
    target = Path(path).expanduser()
    if not folder and target.is_dir():
        return "it is a folder"
    if folder and target.exists() and not target.is_dir():
        return "it is a file, not a folder"
    if not folder and target.exists() and not os.access(target, os.W_OK):
        return "it is read-only"
    probe = target if folder else target.parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is a file, not a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable"
    return None


def free_space_note(path: Path | str) -> str:
    """'N GiB free there' for the disk `path` is on (or would be: its nearest existing
    folder), for the one-line error of a failed write."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return f"{shutil.disk_usage(probe).free / 2**30:.2f} GiB free there"
    except OSError:
        return "free space unknown"


def write_failure(exc: BaseException, path: Path | str) -> str:
    """'could not write PATH (why; N GiB free there)': the start of the one line of a
    write that failed (a full disk, a folder gone read-only)."""
    text = str(getattr(exc, "strerror", None) or exc).strip()
    reason = text.splitlines()[0] if text else type(exc).__name__
    reason = reason.rsplit("I/O error: ", 1)[-1]  # safetensors: "Error while serializing: ..."
    if special_file(path) is not None:  # a device: the disk's free space says nothing
        return f"could not write {path} ({reason})"
    return f"could not write {path} ({reason}; {free_space_note(path)})"


def special_file(path: Path | str) -> str | None:
    """What `path` is when it exists and is neither a regular file nor a folder ("a
    FIFO", "a character device", ...), found without opening it; None otherwise. Such a
    path is read or written in place, never replaced: opening a FIFO to read waits for a
    writer, so an input that is one is refused."""
    try:
        mode = os.stat(Path(path).expanduser()).st_mode
    except (OSError, ValueError):
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    kinds = {
        stat.S_ISFIFO: "a FIFO",
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
        stat.S_ISSOCK: "a socket",
    }
    return next((name for test, name in kinds.items() if test(mode)), "not a regular file")


def output_lock_path(output: Path | str) -> Path:
    """The lock file of an output (OUTPUT_LOCK_SUFFIX)."""
    out = Path(output).expanduser()
    return out.parent / f".{out.name}{OUTPUT_LOCK_SUFFIX}"


def describe_holder(fd: int) -> str:
    """'pid N on HOST, since TIME': who wrote the lock file open as `fd`."""
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder["since"])))
        return f"pid {int(holder['pid'])} on {holder['host']}, since {started}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that is starting"


def lock_holder(lock_path: Path | str) -> str | None:
    """Who holds the lock of `lock_path` now (`describe_holder`), or None when no process
    does; found without creating the file or keeping a lock (a shared one, for an
    instant)."""
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return describe_holder(fd)
        except OSError:
            return None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def record_path(output: Path | str) -> Path:
    """`<output>.run.json`, the record beside an output (RECORD_SUFFIX)."""
    out = Path(output)
    return out.with_name(out.name + RECORD_SUFFIX)


def written_by(output: Path | str, command: str) -> bool:
    """`output` is as `command` last wrote it: its record names the command and the
    file's SHA-256 (a file changed since is not the command's any more)."""
    try:
        record = json.loads(record_path(output).read_text(encoding="utf-8"))
        return (
            isinstance(record, dict)
            and record.get("command") == command
            and record.get("sha256") == sha256_file(output)
        )
    except (OSError, ValueError):
        return False


def write_output(path: Path | str, text: str, command: str) -> None:
    """`path` holds `text`, written by `command`: a regular file (or a new one) is
    replaced atomically and recorded beside it (`record_path`), so the next run of
    `command` may replace it; a device or FIFO (`/dev/stdout`, `/dev/null`) is written in
    place, never replaced, a FIFO only when a reader has it open. Raises OSError when the
    write fails (`/dev/full`, a full disk)."""
    target = Path(path).expanduser()
    if special_file(target) is not None:
        fd = os.open(target, os.O_WRONLY | os.O_NONBLOCK)  # a FIFO without reader: ENXIO
        try:
            os.set_blocking(fd, True)
            data = memoryview(text.encode("utf-8"))
            while data:
                data = data[os.write(fd, data) :]
        finally:
            os.close(fd)
        return
    write_text_atomic(target, text)
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    write_json_atomic(record_path(target), {"command": command, "sha256": digest})


@contextmanager
def replacing(path: Path | str) -> Iterator[Path]:
    """Yields a temporary sibling of `path` to write; renamed over `path` when the block
    ends normally, removed when it raises. The parent folder is created. The file is
    readable by all (0644), whatever its writer chose: safetensors writes 0600, which a
    serving engine running as another user could not read."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: Path | str, text: str) -> None:
    """`path` holds `text` (UTF-8), replaced atomically."""
    with replacing(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json_atomic(path: Path | str, payload: object) -> None:
    """`path` holds `payload` as indented JSON, replaced atomically."""
    write_text_atomic(path, json.dumps(payload, indent=2) + "\n")


def sha256_file(path: Path | str) -> str:
    """Hex SHA-256 of a file's bytes, read in 4 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()
