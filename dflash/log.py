"""The one logger of dflash-train: what a command says goes through the stdlib `logging`
module, as records of the `dflash` logger (or of one below it, `dflash.run`, ...).

Functions that say something take `log: Log = say`: `say(line)` is a record whose message
is the line (INFO; a line that starts with `warning:` is a WARNING, one that starts with
`Error:` an ERROR), and a test passes `lines.append` to collect them instead. Modules
with more to tell use `logging.getLogger("dflash.<name>")` directly. The handlers decide
where the lines go:

- `LineHandler`: the message alone, one line, as the command line has always printed it
  (no level, no time, no logger name). The `dflash` logger has one from import on that
  writes to standard output, as `print` did; the command line has it write to standard
  error instead while a command runs (`line_writer`).
- the OpenTelemetry bridge (tracing.logs), while a run's telemetry exports logs: WARNING
  and above become OTLP log records tied to the current span (dflash.observe attaches it).

A record logged with `extra=NOT_PRINTED` is for telemetry alone: its line is printed
elsewhere (above the progress bar) or stands for what the summary counts (a skipped
non-finite step, a skipped cache sample).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

LOGGER_NAME = "dflash"
NOT_PRINTED = {"printed": False}
"""`extra` of a record the LineHandler does not print (the bridge still takes it)."""

Log = Callable[[str], None]
"""What a function says its lines through: `say`, or e.g. `lines.append` in a test."""

logger = logging.getLogger(LOGGER_NAME)


def get_logger(name: str) -> logging.Logger:
    """`dflash.<name>`: a module's logger, under the one the handlers sit on."""
    return logging.getLogger(f"{LOGGER_NAME}.{name}")


def level_of(line: str) -> int:
    """The level a line says it has: `warning: ...` WARNING, `Error: ...` ERROR, else INFO."""
    if line.startswith("warning:"):
        return logging.WARNING
    if line.startswith("Error:"):
        return logging.ERROR
    return logging.INFO


class Say:
    """A `Log` that writes through a logger (`say`: the `dflash` logger)."""

    def __init__(self, target: logging.Logger = logger) -> None:
        self.logger = target

    def __call__(self, line: str) -> None:
        self.logger.log(level_of(line), "%s", line)

    def warning(self, line: str) -> None:
        self.logger.warning("%s", line)

    def error(self, line: str, exc: BaseException | None = None) -> None:
        """An ERROR record; `exc` (with its traceback) goes to telemetry, not the line."""
        exc_info = None if exc is None else (type(exc), exc, exc.__traceback__)
        self.logger.error("%s", line, exc_info=exc_info)


say = Say()


class LineHandler(logging.Handler):
    """Each record's message, alone on one line, through `write` (default: print to
    standard output); a record with `printed=False` in its extras is skipped. A write
    that fails (a closed pipe) is the logging module's to report, never the program's."""

    def __init__(self, write: Log | None = None, level: int = logging.NOTSET) -> None:
        super().__init__(level)
        self.write: Log = write or _print

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "printed", True) is False:
            return
        try:
            self.write(record.getMessage())
        except Exception:
            self.handleError(record)


def _print(line: str) -> None:
    print(line)


LINES = LineHandler()
logger.addHandler(LINES)
logger.setLevel(logging.INFO)
# The lines are the command's output: a root handler (an application's basicConfig,
# pytest's capture) would print each one a second time.
logger.propagate = False


@contextlib.contextmanager
def line_writer(write: Log) -> Iterator[None]:
    """While the block runs the `dflash` logger's lines go through `write` (the command
    line's standard error); then as before."""
    before = LINES.write
    LINES.write = write
    try:
        yield
    finally:
        LINES.write = before
