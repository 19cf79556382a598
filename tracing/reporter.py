"""Reporter: prints the last interval's phase table, throughput figures and a verdict."""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import IO

from tracing.config import call_logged, check_positive
from tracing.format import format_table
from tracing.snapshot import StatsSnapshot
from tracing.stats import ProfileStats

logger = logging.getLogger("tracing")

Verdict = Callable[[StatsSnapshot], "str | None"]
# Returns (merged snapshot, one snapshot per process) for the interval, or None.
IntervalSource = Callable[[], "tuple[StatsSnapshot, list[StatsSnapshot]] | None"]


class _Rate:
    """A monotonically increasing counter as a per-second rate over each window, timed
    from its registration (what ran before, e.g. a start-up, does not dilute it)."""

    def __init__(self, counter: Callable[[], float], unit: str) -> None:
        self.counter, self.unit = counter, unit
        self.first = self.last = float(counter())  # the baseline: its value at registration
        self.first_s = self.last_s = time.monotonic()

    def sample(self, cumulative: bool) -> str:
        value, now_s = float(self.counter()), time.monotonic()
        base, since_s = (self.first, self.first_s) if cumulative else (self.last, self.last_s)
        if not cumulative:
            self.last, self.last_s = value, now_s
        span_s = now_s - since_s
        rate = (value - base) / span_s if span_s > 0 else 0.0
        return f"{rate:,.1f} {self.unit}".rstrip()


class Reporter:
    """Every `interval_s` prints the last interval's table to `stream` (or `log`). Thread
    contract: callbacks (`add_rate`, `add_gauge`, `verdict`) run on the reporter thread
    and at `stop`; an exception in one shows as "n/a" and never stops the report."""

    def __init__(
        self,
        stats: ProfileStats,
        interval_s: float = 30.0,
        *,
        stream: IO[str] | None = None,
        log: logging.Logger | None = None,
        verdict: Verdict | None = None,
        title: str = "tracing",
    ) -> None:
        check_positive("report interval_s", interval_s)
        self.stats, self.interval_s = stats, float(interval_s)
        self._stream, self._log, self._verdict, self._title = stream, log, verdict, title
        self._rates: dict[str, _Rate] = {}
        self._gauges: dict[str, tuple[Callable[[], object], str]] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()  # a report now (report_soon) or the stop
        self._print_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._final_printed = False
        self._previous_excepthook: Callable[..., object] | None = None
        self._interval_source: IntervalSource | None = None

    def add_rate(self, name: str, counter: Callable[[], float], unit: str = "/s") -> None:
        """Shows the growth of `counter()` per second over each interval (e.g. tokens)."""
        self._rates[name] = _Rate(counter, unit)

    def add_gauge(self, name: str, value: Callable[[], object], unit: str = "") -> None:
        """Shows `value()` as sampled at print time (e.g. a queue depth)."""
        self._gauges[name] = (value, unit)

    def set_verdict(self, verdict: Verdict | None) -> None:
        """`verdict(snapshot)` returns one line naming the bottleneck, or None."""
        self._verdict = verdict

    def set_interval_source(self, source: IntervalSource | None) -> None:
        """Interval tables from `source()` instead of this process's stats: a merged
        snapshot plus one per process (e.g. per rank), shown as min/max columns.
        When it returns None (or raises), the interval uses this process's stats."""
        self._interval_source = source

    def start(self) -> Reporter:
        """Starts the reports. The first interval holds what was timed before too (a
        program's start-up): call `report_soon` when its first unit of work ends."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tracing-reporter", daemon=True)
            self._thread.start()
        return self

    def report_soon(self) -> None:
        """Asks the reporter thread for a table now (it then keeps its interval)."""
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait(self.interval_s)
            if self._stop.is_set():
                return
            self._wake.clear()
            call_logged(self.report_interval)  # a broken stream must not end the reports

    def report_interval(self) -> str:
        """Prints (and returns) the table of the last interval; nothing if no phase ran."""
        source = self._interval_source
        gathered = None if source is None else call_logged(source)
        if gathered is None:
            snapshot, parts = self.stats.take_interval(), None
            title = f"{self._title}: last {snapshot.wall_s:.1f}s"
        else:
            snapshot, parts = gathered
            title = f"{self._title}: last {snapshot.wall_s:.1f}s, {len(parts)} ranks"
        if not snapshot.phases:
            return ""
        return self._emit(self.render(snapshot, title, rank_snapshots=parts))

    def report_final(self, note: str = "") -> str:
        """Prints (and returns) the cumulative table; later calls print nothing."""
        with self._print_lock:
            if self._final_printed:
                return ""
            self._final_printed = True
        snapshot = self.stats.snapshot()
        title = f"{self._title}: total {snapshot.wall_s:.1f}s{note}"
        return self._emit(self.render(snapshot, title, cumulative=True))

    def render(
        self,
        snapshot: StatsSnapshot,
        title: str,
        cumulative: bool = False,
        rank_snapshots: list[StatsSnapshot] | None = None,
    ) -> str:
        """The table (min/max per process with `rank_snapshots`), figures, verdict, as printed."""
        lines = [format_table(snapshot, title=title, rank_snapshots=rank_snapshots)]
        figures = [
            f"{name} {_call_text(rate.sample, cumulative)}" for name, rate in self._rates.items()
        ]
        for name, (fn, unit) in self._gauges.items():
            figures.append(f"{name} {_call_text(_gauge_number, fn)}{unit}")
        if figures:
            lines.append("throughput: " + " | ".join(figures))
        if self._verdict is not None:
            verdict = _call_text(self._verdict, snapshot)
            if verdict and verdict != "None":
                lines.append(f"verdict: {verdict}")
        return "\n".join(lines)

    def _emit(self, text: str) -> str:
        with self._print_lock:
            if self._log is not None:
                self._log.info("%s", text)
            else:
                stream = self._stream if self._stream is not None else sys.stderr
                print(text, file=stream, flush=True)
        return text

    def stop(self, final: bool = True, timeout_s: float = 2.0) -> None:
        """Stops the thread; with `final`, prints the cumulative table (once)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        if final:
            self.report_final()

    def install_exit_hooks(self) -> None:
        """Prints the final table at interpreter exit and before an uncaught exception's
        traceback (chaining the previous sys.excepthook). Signals stay the app's job."""
        atexit.register(self._at_exit)
        self._previous_excepthook = sys.excepthook
        sys.excepthook = self._excepthook

    def uninstall_exit_hooks(self) -> None:
        atexit.unregister(self._at_exit)
        if self._previous_excepthook is not None and sys.excepthook == self._excepthook:
            sys.excepthook = self._previous_excepthook
        self._previous_excepthook = None

    def _at_exit(self) -> None:
        self.stop(final=True, timeout_s=0.5)

    def _excepthook(
        self, exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
    ) -> None:
        try:
            self.stop(final=False, timeout_s=0.5)
            self.report_final(note=f" (stopped by {exc_type.__name__})")
        finally:
            previous = self._previous_excepthook or sys.__excepthook__
            previous(exc_type, exc, tb)


def _number(value: object) -> str:
    return f"{value:,.1f}" if isinstance(value, float) else str(value)


def _gauge_number(gauge: Callable[[], object]) -> str:
    return _number(gauge())


def _call_text(fn: Callable[..., object], *args: object) -> str:
    """`fn(*args)` as text; a callback that raises is "n/a", logged, never the report's end."""
    try:
        return str(fn(*args))
    except Exception:
        logger.exception("tracing: reporter callback raised")
        return "n/a"
