"""The first milliseconds of `dflash-train`: stop-signal handlers before any heavy import.

Importing the command line (click, numpy, the config tree) takes most of a second, and a
command's own imports (torch) take more. A signal in that time would otherwise end the
process with a KeyboardInterrupt traceback (SIGINT) or silently (SIGTERM). Until a
command installs its own handlers (dflash.signals.StopSignals), a signal ends the
process at once with one line: nothing has been written yet, so nothing needs saving.
Only the standard library (and dflash.signals, which imports nothing else) is imported here.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from dflash.signals import STOP_SIGNALS

_phase = "start-up"


def _exit_now(signum: int, frame: FrameType | None) -> None:
    try:  # after SIGHUP the terminal may be gone
        os.write(2, f"Error: stopped by {signal.Signals(signum).name} during {_phase}\n".encode())
    except OSError:
        pass
    os._exit(128 + signum)  # no interpreter teardown: it could raise in half-imported modules


def install_startup_handlers() -> None:
    """SIGINT, SIGTERM and SIGHUP end the process with one line and exit code 130/143/129."""
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, _exit_now)


@contextmanager
def exiting_at_once() -> Iterator[None]:
    """Inside the block a signal ends the process at once with one line, whatever handler
    the command has: for a command's deferred imports (torch), which an exception raised
    in their middle can turn into an abort of the interpreter (exit 134). Nothing of the
    command has been written yet at that point."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    install_startup_handlers()
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def entering(phase: str) -> None:
    """Name the phase the one line reports from now on (e.g. shut-down)."""
    global _phase
    _phase = phase
