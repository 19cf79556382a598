"""Files every part writes or checks: the cache folder, atomic replacement, hashes.

A file another process may read (a config, a summary, a cache shard, a drafter's
weights) is written to a hidden temporary sibling and renamed over its final name, so
a reader sees the old file or the new one, never half of one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

FILE_MODE = 0o644


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


def write_json_atomic(path: Path | str, payload: Any) -> None:
    """`path` holds `payload` as indented JSON, replaced atomically."""
    write_text_atomic(path, json.dumps(payload, indent=2) + "\n")


def sha256_file(path: Path | str) -> str:
    """Hex SHA-256 of a file's bytes, read in 4 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()
