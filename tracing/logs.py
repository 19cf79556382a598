"""OTel logs beside the traces and the metrics: the SDK's LoggerProvider with the traces'
resource, its logging bridge on the program's loggers, events, and exceptions.

    logs = start_logs(tracing_cfg)                        # None's exporters: logs.enabled False
    logs.attach("myapp")      # WARNING and above of `myapp` become OTLP log records
    logs.event("myapp.step", {"loss": 2.1}, context=span.context)    # an event: a record
    report = logs.shutdown()                     # bounded; LogsReport (or shutdown_all)

The bridge is the SDK's `LoggingHandler` (`BridgeHandler`): a record of an attached
logger becomes an OTLP log record tied to the current span, which is the current OTel
span or else the innermost phase of the thread (phases attach no OTel context unless
`propagate_context`); an exception's type, message and stack trace are its attributes.
With `exceptions=True`, an exception that ends a phase with a span is one more such record
(ERROR), tied to that phase's span: the specification moves exceptions from span events
to logs (the span keeps its event, which trace views show). Nothing of this runs on the
hot path: one check when a phase ends with an exception.

Where the records go follows the traces' flags, else OTEL_LOGS_EXPORTER and the OTLP
variables (the SDK reads them; OTEL_LOGS_EXPORTER=none exports none, and OTEL_SDK_DISABLED
turns every signal off). Each exporter sits behind the SDK's BatchLogRecordProcessor
(OTEL_BLRP_* checked first, as OTEL_BSP_*) and a counting wrapper: the records exported,
failed, and dropped (queue full, or left at the bound) are the report's. A collector that
is down costs the processor's thread its retries, never the program's, and its first
failure is one line naming the likely cause (tracing.diagnose: one line per endpoint, so
the traces' line, when it came first, is the line). `tracing.metrics.shutdown_all` ends
the three signals side by side, within one bound.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import time
import traceback
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry._logs import SeverityNumber
from opentelemetry.context import Context
from opentelemetry.sdk._logs import (
    LoggerProvider,
    LoggingHandler,
    LogRecordProcessor,
    ReadableLogRecord,
    ReadWriteLogRecord,
)
from opentelemetry.sdk._logs.export import (
    BatchLogRecordProcessor,
    ConsoleLogRecordExporter,
    LogRecordExporter,
    LogRecordExportResult,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.util.types import AnyValue

from tracing import spans
from tracing.config import TracingConfig, call_logged
from tracing.diagnose import Report, watch_of
from tracing.export import (
    batch_settings,
    call_bounded,
    join_closing,
    lower_thread_priority,
    otlp_exporter,
    otlp_protocol,
    sdk_disabled,
    wanted_exporters,
)
from tracing.telemetry import SCOPE, build_resource

logger = logging.getLogger("tracing")
_exporting = threading.local()  # set on a thread while it exports log records


@dataclass(frozen=True)
class LogsReport:
    """What became of the log records of one run."""

    records_exported: int
    records_failed: int  # the exporter reported an error, or was closed at the bound
    records_dropped: int  # neither: the queue was full, or they were queued at the bound
    duration_s: float = 0.0
    records_late: int = 0  # emitted after shutdown began (not exported)

    @property
    def records_not_delivered(self) -> int:
        return self.records_failed + self.records_dropped

    def summary(self) -> str:
        """One line for the log."""
        text = (
            f"logs: records exported {self.records_exported}, failed {self.records_failed}, "
            f"dropped {self.records_dropped}"
        )
        return text + (f", late {self.records_late}" if self.records_late else "")


class CountingLogExporter(LogRecordExporter):
    """An exporter's records, counted; `close` (any thread) shuts the inner exporter down,
    which aborts an export waiting to retry, and later exports fail at once, unsent.
    Export runs on the processor's worker, whose priority it lowers once."""

    def __init__(self, inner: LogRecordExporter) -> None:
        self.inner = inner
        self.exported = self.failed = 0
        self.watch = watch_of(inner)  # an OTLP exporter's failures, told (tracing.diagnose)
        self._closed = False

    def export(self, batch: Sequence[ReadableLogRecord]) -> LogRecordExportResult:
        lower_thread_priority()
        _exporting.active = True  # what this thread logs now is about this export
        try:
            result = None if self._closed else self._export(batch)
        finally:
            _exporting.active = False
        if result != LogRecordExportResult.SUCCESS:
            self.failed += len(batch)
            return LogRecordExportResult.FAILURE
        self.exported += len(batch)
        return LogRecordExportResult.SUCCESS

    def _export(self, batch: Sequence[ReadableLogRecord]) -> LogRecordExportResult | None:
        export_watch = self.watch
        if export_watch is None:
            return call_logged(self.inner.export, batch)
        with export_watch.exporting():
            result = call_logged(self.inner.export, batch)
        if result == LogRecordExportResult.SUCCESS:
            export_watch.succeeded()
        else:
            export_watch.failed()
        return result

    @property
    def unreachable(self) -> bool:
        """Its endpoint is known unreachable (or speaks another protocol)."""
        return self.watch is not None and self.watch.unreachable

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self.watch is not None:
                self.watch.closed = True
            self.inner.shutdown()

    shutdown = close

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        flush = getattr(self.inner, "force_flush", None)
        return True if flush is None else bool(flush(timeout_millis))


class _RecordCounter(LogRecordProcessor):
    """Counts the records handed to the processors after it (late once `closed`)."""

    def __init__(self) -> None:
        self.handed = self.late = 0
        self.closed = False
        self._lock = threading.Lock()

    def on_emit(self, log_record: ReadWriteLogRecord) -> None:
        with self._lock:  # records come from any thread; a count is cheap to lock
            if self.closed:
                self.late += 1
            else:
                self.handed += 1

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class BridgeHandler(LoggingHandler):
    """The SDK's logging bridge, tied to tracing's phases: a record gets the current OTel
    span's context, else the innermost phase's of its thread (phases set no OTel context
    unless they propagate it). A record logged while its thread exports log records is
    left out (it would be about that export, and sent the same way), as is one with
    `telemetry=False` in its extras; extras whose names start with `_` are not sent."""

    def __init__(self, provider: LoggerProvider, level: int = logging.WARNING) -> None:
        with warnings.catch_warnings():  # the SDK points at a contrib package; it is this one
            warnings.simplefilter("ignore", DeprecationWarning)
            super().__init__(level=level, logger_provider=provider)

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(_exporting, "active", False) or getattr(record, "telemetry", True) is False:
            return
        private = [key for key in vars(record) if key.startswith("_")]
        if private:
            record = copy.copy(record)
            for key in private:
                delattr(record, key)
        token = None
        if not trace.get_current_span().get_span_context().is_valid:
            phase = spans.current_phase()
            context = None if phase is None else phase.context
            if context is not None:
                token = otel_context.attach(context)
        try:
            super().emit(record)
        except Exception:  # telemetry never raises into the program
            self.handleError(record)
        finally:
            if token is not None:
                otel_context.detach(token)


def _attribute(value: Any) -> Any:
    """A log attribute value (the logs data model takes maps and lists): None dropped.
    Any: the caller's values go to the SDK as they are, unchecked (its AnyValue)."""
    if isinstance(value, Mapping):
        pairs = ((str(k), _attribute(v)) for k, v in value.items())
        return {k: v for k, v in pairs if v is not None}
    if isinstance(value, (list, tuple)):
        return [_attribute(v) for v in value]
    return value


class Logs:
    """The logs of one process: a LoggerProvider, a batch processor per exporter, the
    bridge handler. Thread contract: `event` and the bridge from any thread; `attach`,
    `detach` and `shutdown` from one."""

    def __init__(
        self,
        resource: Resource,
        exporters: Sequence[LogRecordExporter] = (),
        *,
        level: int = logging.WARNING,
        shutdown_timeout_s: float = 4.0,
        exceptions: bool = True,
    ) -> None:
        self.resource, self.shutdown_timeout_s = resource, shutdown_timeout_s
        self.provider = LoggerProvider(resource=resource, shutdown_on_exit=False)
        self.counter = _RecordCounter()
        self.exporters = [CountingLogExporter(e) for e in exporters]
        if self.exporters:
            self.provider.add_log_record_processor(self.counter)
            settings = batch_settings("OTEL_BLRP")
            for exporter in self.exporters:
                processor = BatchLogRecordProcessor(
                    exporter,
                    schedule_delay_millis=settings["OTEL_BLRP_SCHEDULE_DELAY"],
                    max_export_batch_size=settings["OTEL_BLRP_MAX_EXPORT_BATCH_SIZE"],
                    export_timeout_millis=settings["OTEL_BLRP_EXPORT_TIMEOUT"],
                    max_queue_size=settings["OTEL_BLRP_MAX_QUEUE_SIZE"],
                )
                self.provider.add_log_record_processor(processor)
        self.handler = BridgeHandler(self.provider, level)
        self._events = self.provider.get_logger(SCOPE.name, SCOPE.version)
        self._attached: list[logging.Logger] = []
        self._report: LogsReport | None = None
        self._lock = threading.Lock()
        self._logged: set[int] = set()  # ids of exceptions already logged (innermost phase)
        if exceptions and self.enabled:
            spans.EXCEPTION_SINKS.append(self._phase_exception)

    @property
    def enabled(self) -> bool:
        return bool(self.exporters)

    def attach(self, *names: str) -> None:
        """The bridge on the loggers `names` (WARNING and above; a level of their own
        stays theirs). Nothing when no exporter takes records."""
        if not self.enabled or self._report is not None:
            return
        for name in names:
            target = logging.getLogger(name)
            if self.handler not in target.handlers:
                target.addHandler(self.handler)
                self._attached.append(target)

    def detach(self) -> None:
        for target in self._attached:
            target.removeHandler(self.handler)
        self._attached.clear()

    def event(
        self,
        name: str,
        attributes: Mapping[str, object],
        *,
        context: Context | None = None,
        body: AnyValue = None,
        severity: SeverityNumber = SeverityNumber.INFO,
    ) -> None:
        """One event: a log record named `name` with `attributes` (maps and lists as
        they are; None values left out), tied to `context` (a span's, e.g.
        SpanHandle.context), else to the current span or phase. Never raises."""
        if not self.enabled or self._report is not None:
            return
        if context is None and not trace.get_current_span().get_span_context().is_valid:
            phase = spans.current_phase()
            context = None if phase is None else phase.context
        values = {str(k): v for k, v in ((k, _attribute(v)) for k, v in attributes.items())}
        call_logged(
            self._events.emit,
            event_name=name,
            attributes={k: v for k, v in values.items() if v is not None},
            body=body,
            severity_number=severity,
            severity_text=severity.name,
            context=context,
            timestamp=time.time_ns(),
        )

    def _phase_exception(self, exc: BaseException, context: Context | None) -> None:
        """A phase ended by `exc`: one ERROR record tied to its span, at the innermost
        phase it passed through (the outer ones it leaves are the same exception)."""
        if self._report is not None or id(exc) in self._logged:
            return
        if len(self._logged) > 1000:
            self._logged.clear()
        self._logged.add(id(exc))
        call_logged(
            self._events.emit,
            body=f"{type(exc).__name__}: {exc}",
            severity_number=SeverityNumber.ERROR,
            severity_text="ERROR",
            context=context,
            timestamp=time.time_ns(),
            attributes=exception_attributes(exc),
        )

    def force_flush(self, timeout_s: float = 2.0) -> bool:
        return bool(call_bounded(self.provider.force_flush, timeout_s, int(timeout_s * 1e3)))

    def report(self, duration_s: float = 0.0) -> LogsReport:
        if self._report is not None:
            return self._report
        exported = sum(e.exported for e in self.exporters)
        failed = sum(e.failed for e in self.exporters)
        handed = self.counter.handed * len(self.exporters)
        dropped = max(0, handed - exported - failed)
        return LogsReport(exported, failed, dropped, duration_s, self.counter.late)

    def shutdown(self, timeout_s: float | None = None) -> LogsReport:
        """Detaches the bridge, then the final export and close, within `timeout_s`
        (default shutdown_timeout_s); idempotent. An exporter whose endpoint is known
        unreachable is closed at once; the others get most of the bound, then are
        closed (a retrying export aborts)."""
        with self._lock:
            if self._report is not None:
                return self._report
            started = time.monotonic()
            budget_s = self.shutdown_timeout_s if timeout_s is None else timeout_s
            deadline = started + budget_s * 0.95
            self.detach()
            with contextlib.suppress(ValueError):
                spans.EXCEPTION_SINKS.remove(self._phase_exception)
            self.counter.closed = True
            if self.exporters:
                closing = threading.Thread(
                    target=call_logged, args=(self.provider.shutdown,), name="tracing-logs-close"
                )
                closing.daemon = True
                closing.start()
                join_closing(closing, started + budget_s * 0.95 * 0.8, self.exporters)
                for exporter in self.exporters:
                    call_bounded(exporter.close, max(0.0, deadline - time.monotonic()))
                closing.join(max(0.0, deadline - time.monotonic()))
            self._report = self.report(time.monotonic() - started)
            return self._report


def exception_attributes(exc: BaseException) -> dict[str, str]:
    """The semantic conventions' exception.type, .message and .stacktrace of `exc`."""
    return {
        "exception.type": type(exc).__qualname__,
        "exception.message": str(exc),
        "exception.stacktrace": "".join(
            traceback.format_exception(type(exc), exc, exc.__traceback__)
        ),
    }


def build_log_exporters(
    traces: TracingConfig, report: Report | None = None, exporter: Iterable[str] | None = None
) -> list[LogRecordExporter]:
    """The exporters OTEL_LOGS_EXPORTER names (`exporter`: names that replace it), else
    OTLP where the traces' endpoint or an OTLP endpoint variable is set; none under
    OTEL_SDK_DISABLED=true. `report`: see tracing.export.otlp_exporter."""
    if sdk_disabled():
        return []
    explicit = None if exporter is None else tuple(exporter)
    protocol = otlp_protocol(traces.otlp_protocol, "logs")
    exporters: list[LogRecordExporter] = []
    for name in wanted_exporters(explicit, "logs", traces.otlp_endpoint is not None):
        if name == "console":
            exporters.append(ConsoleLogRecordExporter())
        elif name == "otlp":
            endpoint, setting = traces.otlp_endpoint, traces.protocol_setting
            built = otlp_exporter("logs", protocol, endpoint, report, setting)
            exporters += [built] if built is not None else []
    return exporters


def start_logs(
    tracing_cfg: TracingConfig,
    *,
    exporters: Sequence[LogRecordExporter] = (),
    resource: Resource | None = None,
    on_export_problem: Report | None = None,
    exceptions: bool = True,
) -> Logs:
    """Logs with the exporters the traces' flags or the OTEL_* variables name, plus
    `exporters` (an in-memory one in tests), the traces' resource (`resource`, else
    `build_resource(tracing_cfg)`) and their shutdown bound. `on_export_problem` gets
    the line that tells a failing OTLP export and its likely cause (default: a warning
    on the `tracing` logger). `exceptions`: an exception that ends a phase is a record."""
    resource = resource if resource is not None else build_resource(tracing_cfg)
    built = build_log_exporters(tracing_cfg, on_export_problem)
    return Logs(
        resource,
        [*built, *exporters],
        shutdown_timeout_s=tracing_cfg.shutdown_timeout_s,
        exceptions=exceptions,
    )
