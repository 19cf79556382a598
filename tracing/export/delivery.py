"""What became of the spans: the SDK's BatchSpanProcessor around an exporter that counts,
and bounds on every wait the SDK leaves open.

The SDK's processor reads OTEL_BSP_* itself, restarts after os.fork, and drops the
oldest span when its queue is full. It counts nothing, its force_flush has no bound and
its shutdown waits up to 30 s on an export to a dead collector. So each exporter tracing
builds sits behind a `CountingExporter` (exported and failed spans; `close` aborts a hung
export's retries), a `SpanCounter` counts the sampled spans handed over, and
`call_bounded` puts a bound on the SDK calls that have none.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from tracing.config import warn_once

logger = logging.getLogger("tracing")
EXPORT_THREAD_NICENESS = 10


@dataclass
class DeliveryCounts:
    """What became of the sampled spans handed to tracing's exporters."""

    handed: int = 0
    exported: int = 0
    failed: int = 0
    """Handed to an exporter that reported an error (or was closed at the bound)."""
    late: int = 0
    """Ended after shutdown began (a phase still open then): not exported."""

    @property
    def dropped(self) -> int:
        """Not exported nor failed: the queue was full, or they were still queued when
        the bound ran out (while running: still queued, or in flight)."""
        return max(0, self.handed - self.exported - self.failed)


def lower_thread_priority() -> None:
    """Lets an export thread yield the CPU to the program it observes: encoding spans is
    real work, which on busy cores should fill the training threads' idle moments. On
    Linux a thread is a task, so setpriority on its native id affects it alone."""
    try:
        tid = threading.get_native_id()
        niceness = os.getpriority(os.PRIO_PROCESS, tid) + EXPORT_THREAD_NICENESS
        os.setpriority(os.PRIO_PROCESS, tid, niceness)
    except (AttributeError, OSError):
        pass  # not permitted here, or not POSIX: export at normal priority


class CountingExporter(SpanExporter):
    """An exporter that counts what it exported and what failed.

    Thread contract: `export` on the processor's worker (whose priority it lowers once);
    `close` from any thread: it shuts the inner exporter down, which aborts an export
    waiting to retry, and every later export fails at once without sending."""

    def __init__(self, inner: SpanExporter) -> None:
        self.inner = inner
        self.exported = self.failed = 0
        self._closed = False
        self._niced: set[int] = set()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if threading.get_ident() not in self._niced:
            self._niced.add(threading.get_ident())
            lower_thread_priority()
        result = SpanExportResult.FAILURE
        if not self._closed:
            try:
                result = self.inner.export(spans)
            except Exception:  # telemetry never crashes the host program
                logger.exception("tracing: exporter %s raised", type(self.inner).__name__)
        if result == SpanExportResult.SUCCESS:
            self.exported += len(spans)
        else:
            self.failed += len(spans)
        return result

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.inner.shutdown()

    def shutdown(self) -> None:
        self.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class Tally:
    """A count many threads add to without a lock (next() of itertools.count is atomic
    under the GIL); reading it, rarely, draws once more."""

    def __init__(self) -> None:
        self._count = itertools.count()
        self._reads = 0

    def add(self) -> None:
        next(self._count)

    def value(self) -> int:
        self._reads += 1
        return next(self._count) - (self._reads - 1)


class SpanCounter(SpanProcessor):
    """Counts the sampled spans handed to the processors after it; once `closed`, counts
    them as late (warned once). Thread contract: `on_end` on any thread, never blocking."""

    def __init__(self) -> None:
        self.handed, self.late = Tally(), Tally()
        self.closed = self._warned = False

    def on_end(self, span: ReadableSpan) -> None:
        if span.context is None or not span.context.trace_flags.sampled:
            return
        if not self.closed:
            self.handed.add()
            return
        self.late.add()
        warn_once(
            "late",
            f"span {span.name!r} ended after tracing began shutting down; it and "
            "any later ones are not exported (counted as late)",
        )

    def counts(self, exporters: Sequence[CountingExporter]) -> DeliveryCounts:
        return DeliveryCounts(
            handed=self.handed.value() * len(exporters),
            exported=sum(e.exported for e in exporters),
            failed=sum(e.failed for e in exporters),
            late=self.late.value(),
        )


def batch_processor(exporter: SpanExporter) -> BatchSpanProcessor:
    """The SDK's batch processor, with its settings from OTEL_BSP_*. Values it refuses
    (a delay of 0, a batch larger than the queue) are warned once; the specification's
    defaults apply and the run goes on."""
    try:
        return BatchSpanProcessor(exporter)
    except ValueError as exc:
        warn_once("bsp", f"the SDK's batch processor refused OTEL_BSP_* ({exc}); using defaults")
        return BatchSpanProcessor(exporter, 2048, 5000, 512)


def call_bounded(fn: Any, timeout_s: float, *args: Any) -> Any:
    """`fn(*args)` on a daemon thread, waited for at most `timeout_s`: its result, or
    None when it raised (logged) or is still running."""
    result: list[Any] = [None]

    def target() -> None:
        try:
            result[0] = fn(*args)
        except Exception:
            logger.exception("tracing: %s raised", type(fn).__qualname__)

    thread = threading.Thread(target=target, name="tracing-bounded-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return result[0]
