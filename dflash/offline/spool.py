"""A bounded spool of per-sample hidden-state files between an engine that writes them and
the run that trains from them (`train --target-engine vllm`).

The protocol, which tools/vllm/extract_hidden_states.py --spool-size implements on the
writer's side (it runs in vLLM's own venv and cannot import this module: the two sides
are tested against each other in tests/dflash/offline/test_spool.py):

  SPOOL/.lock                         held (flock, exclusive) by the training run for its
                                      whole life: a second run on the same SPOOL is refused
  SPOOL/hidden_states/hs_{n}.safetensors
                                      the n-th sample the run reads (n counts from 0 in the
                                      order training uses them: a sample trained twice is
                                      written twice), speculators' layout (token_ids,
                                      hidden_states [t, K+1, D], loss_mask); written as
                                      hs_{n}.safetensors.tmp, then renamed: a file under its
                                      final name is whole
  SPOOL/.vllm-states/                 the engine's own files before they are converted

  Under torchrun each rank is a run of its own over its own rows, in SPOOL/rank-{r:05d}/
  (the layout above, its .lock held by rank r), and every rank holds SPOOL/.lock shared:
  the ranks of one run share SPOOL, while a second run is refused by the rank folder it
  would take, or by SPOOL/.lock when one of the two runs is a single process.

  The spool's bytes are the sizes of every file under SPOOL/hidden_states and
  SPOOL/.vllm-states. The writer starts an engine call only when the bytes already there
  plus what the call writes (its raw files, and one converted file at a time) stay within
  the bound, so the bytes never pass it. The reader takes hs_0, hs_1, ... in turn, each
  once, and deletes it once read: that frees the room the writer waits for.

`sample_bytes` is the size of one sample's file of t tokens, which both sides compute the
same way (the writer's copy: extract_hidden_states.spool_sample_bytes).
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable
from pathlib import Path

from dflash.config.checks import parse_size
from dflash.data.sources import DataError

__all__ = ["EngineDied", "Spool", "SpoolError", "parse_size", "sample_bytes", "spool_bytes"]

SAMPLES_DIR = "hidden_states"
RAW_DIR = ".vllm-states"
LOCK = ".lock"
RANK_DIR = "rank-{:05d}"
# safetensors' JSON header of three tensors, with room to spare: the bound counts it.
HEADER_BYTES = 512


class SpoolError(DataError):
    """A spool this run cannot use; one line naming the value."""


class EngineDied(RuntimeError):
    """The engine that fills the spool ended before writing a sample the run needs."""


def sample_bytes(length: int, layers: int, width: int, itemsize: int) -> int:
    """Bytes of one sample's file: hidden states [t, layers, width], token ids (int64),
    loss mask (bool) and the header."""
    return length * layers * width * itemsize + length * 8 + length + HEADER_BYTES


def spool_bytes(directory: Path) -> int:
    """What the spool holds now, as the writer counts it."""
    total = 0
    for sub in (SAMPLES_DIR, RAW_DIR):
        try:
            entries = list(os.scandir(directory / sub))
        except FileNotFoundError:
            continue
        for entry in entries:
            try:
                total += entry.stat().st_size
            except FileNotFoundError:  # read and deleted, or renamed, meanwhile
                pass
    return total


def sample_path(directory: Path, n: int) -> Path:
    return directory / SAMPLES_DIR / f"hs_{n}.safetensors"


class Spool:
    """The reader's side: the spool directory, locked for this run, emptied of what an
    earlier run left; `wait` for the n-th sample's file, `remove` it once read."""

    def __init__(self, directory: Path, flag: str = "--spool-dir", rank: int | None = None) -> None:
        """`rank`: this torchrun rank's folder of `directory` (None: one process, the
        whole of it)."""
        self._lock_fds: list[int] = []
        try:
            if rank is not None:
                self._lock(directory, fcntl.LOCK_SH, flag)
                directory = directory / RANK_DIR.format(rank)
            self._lock(directory, fcntl.LOCK_EX, flag)
        except SpoolError:
            self.close()
            raise
        self.directory = directory
        # Files of an earlier run that ended: they are not this run's samples.
        for sub in (SAMPLES_DIR, RAW_DIR):
            for path in (directory / sub).glob("*"):
                path.unlink(missing_ok=True)
        (directory / SAMPLES_DIR).mkdir(exist_ok=True)
        self.peak_bytes = 0  # the most the reader saw there, at each sample it took

    def _lock(self, directory: Path, kind: int, flag: str) -> None:
        """`directory`'s lock, held until `close`; refused (SpoolError) while another
        run holds it in a kind that excludes `kind`."""
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise SpoolError(f"{flag} {directory} is not writable ({err.strerror})") from None
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SpoolError(
                f"{flag} {directory} is in use by another run (it holds {directory / LOCK})"
            ) from None
        self._lock_fds.append(fd)
        if not os.access(directory, os.W_OK):
            raise SpoolError(f"{flag} {directory} is not writable")

    def wait(self, n: int, engine_error: Callable[[], str | None], poll_s: float = 0.01) -> Path:
        """The n-th sample's file, once whole; EngineDied when `engine_error` says why
        the engine will never write it."""
        path = sample_path(self.directory, n)
        while not path.exists():
            why = engine_error()
            if why is not None and not path.exists():
                raise EngineDied(why)
            time.sleep(poll_s)
        self.peak_bytes = max(self.peak_bytes, spool_bytes(self.directory))
        return path

    def depth(self) -> tuple[int, int]:
        """(bytes, whole samples) the spool holds now: the samples are the files the
        engine has renamed into place and the reader has not yet taken."""
        try:
            entries = list(os.scandir(self.directory / SAMPLES_DIR))
        except FileNotFoundError:
            entries = []
        whole = sum(entry.name.endswith(".safetensors") for entry in entries)
        return spool_bytes(self.directory), whole

    def remove(self, path: Path) -> None:
        path.unlink(missing_ok=True)

    def close(self) -> None:
        while self._lock_fds:
            os.close(self._lock_fds.pop())  # releases the flock
