"""The signals that stop a command, and what each one leaves behind.

SIGINT (Ctrl-C), SIGTERM (a scheduler, `kill`) and SIGHUP (a closed terminal, a dropped
ssh session) all stop a command the same way: training finishes or abandons its step,
saves a checkpoint and the summary, and the command ends with one line and exit code
128 + the signal's number (130, 143, 129). A hung-up terminal can no longer be written
to, so on SIGHUP the standard streams that lead to it are pointed at /dev/null first:
the checkpoint must not fail on a progress line nobody can read (the run's files say
what happened: summary.json's `interrupted`).
"""

from __future__ import annotations

import os
import select
import signal
import threading
from collections.abc import Callable
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# What signal.signal hands back: the earlier handler, a default's number, or None (not
# set from Python).
Handler = Callable[[int, FrameType | None], object] | int | signal.Handlers | None


def leave_dead_terminal() -> list[int]:
    """Points standard output and error at /dev/null where their terminal or pipe is
    gone (poll says hung up or error, as a closed pty or a reader-less pipe does); the
    descriptors moved. Python's streams keep their objects, so every later write lands."""
    moved = []
    for fd in (1, 2):
        try:
            poller = select.poll()
            poller.register(fd, select.POLLOUT)
            events = poller.poll(0)
        except (OSError, ValueError):
            continue
        if any(mask & (select.POLLHUP | select.POLLERR) for _, mask in events):
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, fd)
            os.close(null)
            moved.append(fd)
    return moved


def _on_stop_signal(signum: int) -> None:
    if signum == signal.SIGHUP:
        leave_dead_terminal()


class TrainingInterrupted(SystemExit):
    """A stop signal ended training; exit code 128 + signal number (130, 143, 129).

    A SystemExit, so a command that lets it propagate exits with that code.
    """

    def __init__(self, signum: int, summary: dict[str, object] | None):
        super().__init__(128 + signum)
        self.signum, self.summary = signum, summary


class Interrupted(SystemExit):
    """A stop signal outside the training loop (setup, target preparation, regeneration,
    caching, evaluation): raised in the main thread where it arrived, so `finally`
    blocks run and whatever is known gets written; exit code 128 + signal number."""

    def __init__(self, signum: int, during: str | None):
        super().__init__(128 + signum)
        self.signum, self.during = signum, during

    def describe(self) -> str:
        name = signal.Signals(self.signum).name
        return f"stopped by {name}" + (f" during {self.during}" if self.during else "")


class _Handlers:
    """The stop signals' handlers while installed (main thread only); `restore` puts the
    earlier ones back."""

    def __init__(self) -> None:
        self._saved: dict[int, Handler] = {}

    def _install(self, handler: Callable[[int, FrameType | None], None]) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._saved[sig] = signal.signal(sig, handler)

    def restore(self) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        self._saved.clear()


class StopSignals(_Handlers):
    """Installed by the command line for a command's life: the first stop signal raises
    Interrupted naming the phase the main thread was in (`where()`); a second one exits
    at once. The training loop puts its own SignalStop in their place while it runs."""

    def __init__(self, where: Callable[[], str | None] = lambda: None) -> None:
        super().__init__()
        self._where = where
        self._raised = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._raised:
            os._exit(128 + signum)
        self._raised = True
        _on_stop_signal(signum)
        raise Interrupted(signum, self._where())

    def install(self) -> StopSignals:
        self._install(self._handle)
        return self


class SignalStop(_Handlers):
    """While active: the first stop signal sets `stop`, so the stages end (a drafter
    finishes or abandons its step); a second one exits at once."""

    def __init__(self, stop: threading.Event):
        super().__init__()
        self.stop = stop
        self.signum: int | None = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            os._exit(128 + signum)
        self.signum = signum
        _on_stop_signal(signum)
        self.stop.set()

    def __enter__(self) -> SignalStop:
        self._install(self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()
