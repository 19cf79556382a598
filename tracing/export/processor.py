"""Span processor with bounded waits and delivery counts (exporters: tracing.export.exporters).

The SDK's BatchSpanProcessor waits up to 30 s on shutdown, has a force_flush without a
bound and does not tell how many spans it lost. This one keeps the same shape (bounded
deque, one named daemon worker, stop event) and adds: every wait bounded, counts of
exported / dropped (queue full) / failed / still queued spans, and a second entry,
`on_end_record`, for the spans `phase` records without the SDK (`tracing.record`): their
SDK spans are built here, on the worker thread, not on the thread that ended them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tracing.handle import SpanHandle

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from tracing.export.ledger import ChildSlot
from tracing.handle import readable_spans

logger = logging.getLogger("tracing")


@dataclass
class DeliveryCounts:
    """What became of the sampled spans handed to one processor."""

    exported: int = 0
    dropped: int = 0
    """Refused because the queue was full (collector too slow or gone)."""
    failed: int = 0
    """Handed to the exporter, which reported an error."""
    pending: int = 0
    """Still queued or in flight when shutdown gave up."""
    late: int = 0
    """Ended after shutdown began (a phase still open then): never exported."""

    def __iadd__(self, other: DeliveryCounts) -> DeliveryCounts:
        self.exported += other.exported
        self.dropped += other.dropped
        self.failed += other.failed
        self.pending += other.pending
        self.late += other.late
        return self


EXPORT_THREAD_NICENESS = 10


def lower_thread_priority() -> None:
    """Lets the export thread yield the CPU to the program it observes.

    Encoding spans is real CPU work; on a machine whose cores are busy with the
    training threads it should run in their idle moments, not take turns with them.
    On Linux a thread is a task, so setpriority on its native id affects it alone.
    """
    if not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(
            os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + EXPORT_THREAD_NICENESS
        )
    except OSError:
        pass  # not permitted here: export at normal priority


class BoundedBatchSpanProcessor(SpanProcessor):
    """Batches ended spans to an exporter on one worker thread.

    Thread contract: `on_end` and `on_end_record` run on the thread that ends a span;
    they never block and never raise (a full queue drops the span and counts it).
    `force_flush` and `shutdown` wait at most their timeout.
    """

    def __init__(
        self,
        exporter: SpanExporter,
        *,
        max_queue_size: int = 8192,
        max_batch_size: int = 512,
        schedule_delay_s: float = 1.0,
        name: str = "tracing-export",
    ) -> None:
        self.exporter = exporter
        # Ended spans: SDK spans (from other tracers) or our handles, converted on export.
        self._queue: deque[ReadableSpan | SpanHandle] = deque()
        self._max_queue_size = max_queue_size
        self._max_batch_size = max_batch_size
        self._schedule_delay_s = schedule_delay_s
        self._counts = DeliveryCounts()
        self._counts_lock = threading.Lock()
        self._in_flight = 0
        self._last_export_ok = True
        self._shutdown_counts: DeliveryCounts | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._stopping = False  # mirrors _stop for the hot path: a bool reads faster
        self._flush_waiters: list[_FlushWaiter] = []
        self.ledger_slot: ChildSlot | None = None  # set in a forked child
        self._name = name
        self._worker = threading.Thread(target=self._run, name=name, daemon=True)
        self._worker.start()

    def reinit_after_fork(self, exporter: SpanExporter | None = None) -> None:
        """In a forked child: fresh locks, counts and worker; the parent's queued spans
        are the parent's to export. `exporter` replaces one that cannot cross a fork
        (a connection or an open file shared with the parent)."""
        if exporter is not None:
            self.exporter = exporter
        self._queue = deque()
        self._counts = DeliveryCounts()
        self._counts_lock = threading.Lock()
        self._in_flight = 0
        self._last_export_ok = True
        self._shutdown_counts = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._stopping = False
        self._flush_waiters = []
        self._worker = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._worker.start()

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if span.context.trace_flags.sampled:
            self.on_end_record(span)

    def on_end_record(self, span: ReadableSpan | SpanHandle) -> None:
        """Queues an ended, sampled span: an SDK span or a handle from `tracing.spans`."""
        if self._stopping:
            self._count_late(span)
            return
        if self.ledger_slot is not None:
            self.ledger_slot.queued()
        queue = self._queue
        if len(queue) >= self._max_queue_size:
            with self._counts_lock:
                self._counts.dropped += 1
            return
        queue.append(span)
        if (len(queue) >= self._max_batch_size or not self._schedule_delay_s) and (
            not self._wake.is_set()
        ):  # a batch is full, or a delay of 0: no span waits for the next round
            self._wake.set()

    def _count_late(self, span: ReadableSpan | SpanHandle) -> None:
        with self._counts_lock:
            self._counts.late += 1
            first = self._counts.late == 1
        if first:
            logger.warning(
                "tracing: span %r ended after %s began shutting down; it and any later "
                "ones are not exported (counted as late)",
                span.name,
                self._name,
            )

    def _run(self) -> None:
        lower_thread_priority()
        while not self._stop.is_set():
            self._wake.wait(self._schedule_delay_s or None)  # 0: until a span comes
            self._wake.clear()
            self._round()
        self._round()

    def _round(self) -> None:
        try:
            self._export_all()
            self._release_flush_waiters()
        except Exception:  # the worker must outlive any bug: spans would queue forever
            logger.exception("tracing: export worker error")

    def _export_all(self) -> None:
        while self._queue:
            if self._stop.is_set() and not self._last_export_ok:
                return  # shutting down and the collector is failing: do not burn the budget
            batch = []
            while self._queue and len(batch) < self._max_batch_size:
                batch.append(self._queue.popleft())
            self._export_batch(batch)

    def _export_batch(self, batch: list[ReadableSpan | SpanHandle]) -> None:
        self._in_flight = len(batch)
        try:
            ok = self.exporter.export(readable_spans(batch)) == SpanExportResult.SUCCESS
        except Exception:  # telemetry never crashes the host program
            logger.exception("tracing: exporter %s raised", type(self.exporter).__name__)
            ok = False
        self._last_export_ok = ok
        with self._counts_lock:
            if ok:
                self._counts.exported += len(batch)
                if self.ledger_slot is not None:
                    self.ledger_slot.exported(len(batch))
            else:
                self._counts.failed += len(batch)
            self._in_flight = 0

    def _release_flush_waiters(self) -> None:
        waiters, self._flush_waiters = self._flush_waiters, []
        with self._counts_lock:
            failed = self._counts.failed
        for waiter in waiters:
            if failed != waiter.failed_before or self._stop.is_set():
                waiter.release(failed == waiter.failed_before and not self._queue)
            elif self._queue:  # spans came in meanwhile: the next round exports them
                self._flush_waiters.append(waiter)
                self._wake.set()
            else:
                waiter.release(True)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Asks the worker to export everything queued; waits at most `timeout_millis`.

        True only when the queue emptied and every export since the call succeeded."""
        if self._stop.is_set() or not self._worker.is_alive():
            return not self._queue and not self._in_flight
        with self._counts_lock:
            waiter = _FlushWaiter(self._counts.failed)
        self._flush_waiters.append(waiter)
        self._wake.set()
        return waiter.wait(timeout_millis / 1e3)

    def shutdown(self, timeout_millis: int = 4000) -> None:
        self.shutdown_counted(timeout_millis / 1e3)

    def shutdown_counted(self, timeout_s: float) -> DeliveryCounts:
        """Exports what it can within `timeout_s`, closes the exporter, returns the counts.

        When the last export failed (collector down), it does not wait for the queue to
        drain: closing the exporter at once aborts its retries. Later calls return the
        first result without waiting.
        """
        if self._shutdown_counts is not None:
            return self._shutdown_counts
        deadline = time.monotonic() + timeout_s
        self._stopping = True
        self._stop.set()
        self._wake.set()
        if self._last_export_ok:
            # Leave a slice of the budget for closing the exporter (aborts a hung request).
            self._worker.join(max(0.0, deadline - time.monotonic()) * 0.8)
        _call_bounded(self.exporter.shutdown, max(0.0, deadline - time.monotonic()))
        self._worker.join(max(0.0, deadline - time.monotonic()))
        self._shutdown_counts = self.counts()
        return self._shutdown_counts

    def counts(self) -> DeliveryCounts:
        with self._counts_lock:
            counts = DeliveryCounts(**vars(self._counts))
            counts.pending = len(self._queue) + self._in_flight
        return counts


class _FlushWaiter:
    """One force_flush call: released by the worker with whether it succeeded."""

    __slots__ = ("failed_before", "_done", "_ok")

    def __init__(self, failed_before: int) -> None:
        self.failed_before = failed_before
        self._done = threading.Event()
        self._ok = False

    def release(self, ok: bool) -> None:
        self._ok = ok
        self._done.set()

    def wait(self, timeout_s: float) -> bool:
        return self._done.wait(timeout_s) and self._ok


def _call_bounded(fn: object, timeout_s: float) -> None:
    """Runs `fn()` on a daemon thread and waits at most `timeout_s` for it."""

    def target() -> None:
        try:
            fn()  # type: ignore[operator]
        except Exception:
            logger.exception("tracing: exporter shutdown raised")

    thread = threading.Thread(target=target, name="tracing-exporter-close", daemon=True)
    thread.start()
    thread.join(timeout_s)
