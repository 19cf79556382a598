"""A run owns its output folder.

While a run lives it holds an exclusive lock on OUTPUT_DIR/.dflash-run.lock (flock: the
kernel drops it when the process dies, however it dies), so a second run into the folder
is refused at once, naming the first. A folder that holds an earlier run is refused
unless the new run continues it (--resume) or replaces it (--overwrite). Nothing of the
run is written into the folder until every check has passed (`write_run_start`); until
then a refused command leaves the folder as it found it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import time
from pathlib import Path

from dflash.config.schema import ConfigError
from dflash.config.settings import TrainConfig
from dflash.files import describe_holder, output_lock_path, write_json_atomic
from dflash.log import Log

LOCK_FILE = ".dflash-run.lock"
METRICS_FILE = "metrics.jsonl"
EVAL_PROMPTS_FILE = "eval_prompts.json"
# What a run writes into its folder (the hidden-state cache lives elsewhere and is
# keyed by its data: --overwrite leaves it).
RUN_FILES = (
    "config.json",
    "summary.json",
    "stats.json",
    "timeline.json",
    METRICS_FILE,
    "report.html",
    "pipeline-error.log",
    EVAL_PROMPTS_FILE,
    "vllm.log",  # --eval-engine vllm (dflash.run.engine), written at the end
)
# tensorboard/ and wandb/: --report-to (dflash.observe.trackers). Not spool/ (the default
# --spool-dir): the spool's own lock guards it, and its checks create it before a refusal.
RUN_DIRS = ("checkpoints", "drafter", "profile", "tensorboard", "wandb")
# What a run stopped by a signal in its start-up leaves in a folder that held no run: its
# start-up's tables. No earlier run: the next run replaces them.
STARTUP_FILES = ("stats.json", "timeline.json")


class FolderLock:
    """The exclusive lock of one output, held from `acquire` to `release`: a run's folder
    (OUTPUT_DIR/.dflash-run.lock, kept after the run: it marks the folder as a run's), or
    with `for_output` any file or folder a command writes (a hidden sibling lock file,
    removed again at release)."""

    def __init__(
        self,
        output_dir: Path,
        created: bool = False,
        *,
        lock_path: Path | None = None,
        flag: str = "--output-dir",
    ) -> None:
        self.output = output_dir
        self.path = lock_path or output_dir / LOCK_FILE
        self.flag = flag
        self.created = created  # this run made the folder: a refused run removes it again
        self.keep_file = lock_path is None
        self._made: list[Path] = []  # folders made for the lock file, removed when empty
        self._fd: int | None = None

    @classmethod
    def for_output(cls, output: Path | str, flag: str) -> FolderLock:
        """The lock of an output file or folder that one process at a time may write:
        `.NAME.dflash-lock` beside it."""
        path = Path(output).expanduser()
        return cls(path, lock_path=output_lock_path(path), flag=flag)

    def acquire(self) -> None:
        """Takes the lock or raises ConfigError naming the process that holds it."""
        self._make_parents()
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = describe_holder(fd)
                os.close(fd)
                self._remove_made()
                raise ConfigError(self._in_use(holder)) from None
            except BaseException:
                os.close(fd)
                raise
            if _still_there(fd, self.path):
                break
            os.close(fd)  # its holder removed it as we opened it: lock the new one
        record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Idempotent. A run folder's lock file stays (a refused run that made the folder
        removes both); an output's is removed while still locked, and a process that
        opened it meanwhile finds it gone and locks the new one (`acquire`)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            folder = self.path.parent
            if not self.keep_file:
                self.path.unlink()
            elif self.created and [p.name for p in folder.iterdir()] == [LOCK_FILE]:
                self.path.unlink()  # nothing of the run was written: leave no trace
                folder.rmdir()
        os.close(fd)  # closing the last descriptor drops the flock
        self._remove_made()

    def _in_use(self, holder: str) -> str:
        where = f"{self.flag} {str(self.output)!r}"
        if self.keep_file:
            return (
                f"{where} is in use by another run ({holder}): wait for it to end or choose "
                "another folder"
            )
        return (
            f"{where} is being written by another process ({holder}): wait for it to end or "
            f"choose another {self.flag}"
        )

    def _make_parents(self) -> None:
        missing = [p for p in (self.path.parent, *self.path.parent.parents) if not p.exists()]
        for folder in reversed(missing):
            folder.mkdir(exist_ok=True)
            self._made.insert(0, folder)

    def _remove_made(self) -> None:
        for folder in self._made:  # deepest first; one the command wrote into stays
            with contextlib.suppress(OSError):
                folder.rmdir()
        self._made = []

    def __enter__(self) -> FolderLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _still_there(fd: int, path: Path) -> bool:
    """The locked descriptor is still the file at `path`."""
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except OSError:
        return False


def earlier_run(output_dir: Path) -> list[str]:
    """What of an earlier run the folder holds (names, in a fixed order)."""
    if not output_dir.is_dir():
        return []
    found = [name for name in RUN_FILES if (output_dir / name).is_file()]
    found += [f"{name}/" for name in RUN_DIRS if (output_dir / name).is_dir()]
    return [] if set(found) <= set(STARTUP_FILES) else found


def claim_output_dir(cfg: TrainConfig) -> FolderLock:
    """Rank 0, before any work: the folder exists and is writable, this run holds its
    lock, and it holds no earlier run unless --resume or --overwrite says what to do with
    it. Raises ConfigError (one line) otherwise; writes nothing of the run."""
    output_dir = Path(cfg.run.output_dir)
    try:
        created = not output_dir.exists()
        output_dir.mkdir(parents=True, exist_ok=True)
        lock = FolderLock(output_dir, created)
        lock.acquire()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ConfigError(
            f"--output-dir {cfg.run.output_dir!r} is invalid: cannot create or write it ({reason})"
        ) from None
    try:
        found = earlier_run(output_dir)
        if found and cfg.run.resume is None and not cfg.run.overwrite:
            raise ConfigError(
                f"--output-dir {cfg.run.output_dir!r} holds an earlier run "
                f"({', '.join(found)}): --resume latest continues it, --overwrite replaces "
                "it, or choose another folder"
            )
    except BaseException:
        lock.release()
        raise
    return lock


def write_run_start(cfg: TrainConfig, log: Log) -> None:
    """Once every check has passed: --overwrite removes the earlier run, then the run's
    config.json is written (and a fresh run starts without metrics.jsonl)."""
    output_dir = Path(cfg.run.output_dir)
    if cfg.run.resume is None:
        found = earlier_run(output_dir)
        if found:  # claim_output_dir let it through: --overwrite
            remove_run(output_dir)
            log(f"--overwrite: removed the earlier run in {output_dir} ({', '.join(found)})")
        for name in STARTUP_FILES:  # of a start-up stopped here before, if any
            (output_dir / name).unlink(missing_ok=True)
    write_json_atomic(output_dir / "config.json", cfg.to_dict())


def remove_run(output_dir: Path) -> None:
    for name in RUN_FILES:
        (output_dir / name).unlink(missing_ok=True)
    for name in RUN_DIRS:
        shutil.rmtree(output_dir / name, ignore_errors=True)
