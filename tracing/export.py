"""Where ended spans go: the exporters `setup` builds, and what became of their spans.

Only what the SDK's exporters do not read themselves (tracing.config) is read here:
whether to export at all (OTEL_SDK_DISABLED, OTEL_<SIGNAL>_EXPORTER, an endpoint being
set) and which exporter class a protocol names (OTEL_EXPORTER_OTLP_[<SIGNAL>_]PROTOCOL).
The OTLP timeout and OTEL_BSP_* variables are checked here first: the SDK would take a
negative timeout (every export fails at once) or print a traceback for a malformed
number; such a value is one line naming it, and the SDK's default applies.

The SDK's BatchSpanProcessor restarts after os.fork and drops the oldest span when its
queue is full; it counts nothing, its force_flush has no bound and its shutdown waits up
to 30 s on an export to a dead collector. So each exporter sits behind a
`CountingExporter` (exported, failed; `close` aborts a hung export's retries), a
`SpanCounter` counts the sampled spans handed over, and `call_bounded` bounds the SDK
calls that have no bound of their own. A failing OTLP export is told at its first failed
attempt, with its likely cause (tracing.diagnose).
"""

from __future__ import annotations

import base64
import contextlib
import importlib
import itertools
import json
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

from opentelemetry.environment_variables import (
    OTEL_LOGS_EXPORTER,
    OTEL_METRICS_EXPORTER,
    OTEL_TRACES_EXPORTER,
)
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
    SpanExportResult,
)

from tracing.config import (
    PROTOCOLS,
    TracingConfig,
    TracingConfigError,
    call_logged,
    parse_exporters,
    warn_once,
)
from tracing.diagnose import PORTS, ExportWatch, LogFilter, Report, watch, watch_of

logger = logging.getLogger("tracing")
Signal = Literal["traces", "metrics", "logs"]
_R = TypeVar("_R")
_EXPORTER_VARIABLES = {
    "traces": OTEL_TRACES_EXPORTER,
    "metrics": OTEL_METRICS_EXPORTER,
    "logs": OTEL_LOGS_EXPORTER,
}
# The SDK's OTLP exporter of each signal: (module under ...proto.<transport>, class).
_OTLP_CLASSES = {
    "traces": ("trace_exporter", "OTLPSpanExporter"),
    "metrics": ("metric_exporter", "OTLPMetricExporter"),
    "logs": ("_log_exporter", "OTLPLogExporter"),
}
EXPORT_THREAD_NICENESS = 10


_FILE_ERRORS: dict[str, str] = {}  # trace file -> why its first write failed


def trace_file_errors() -> dict[str, str]:
    """The trace files of this process a write failed on ({path: the reason}), so that
    the program can end with one line and a non-zero exit: spans were lost."""
    return dict(_FILE_ERRORS)


class OtlpJsonFileExporter(SpanExporter):
    """Appends one OTLP/JSON `ExportTraceServiceRequest` per line (ids in hex): the
    format of the collector's file exporter, which Jaeger's UI can load. A write that
    fails (a full disk, /dev/full) fails its export without a traceback; the first is
    told through `report` (else the `tracing` logger) and kept (`trace_file_errors`)."""

    def __init__(self, path: str, report: Report | None = None) -> None:
        self.path = path
        self.report = report
        self.error: str | None = None  # why the first failed write failed
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in shutdown
        self._lock = threading.Lock()

    def _failed(self, exc: OSError) -> SpanExportResult:
        if self.error is None:
            self.error = _FILE_ERRORS[self.path] = exc.strerror or type(exc).__name__
            line = f"trace file {self.path}: could not write ({self.error}): spans are lost"
            if self.report is not None:
                self.report(line)
            else:
                logger.warning(line)
        return SpanExportResult.FAILURE

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        from google.protobuf.json_format import MessageToDict
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

        message = MessageToDict(encode_spans(spans), use_integers_for_enums=True)
        # Protobuf's JSON mapping writes bytes in base64; OTLP/JSON wants hex ids.
        for resource_spans in message.get("resourceSpans", []):
            for scope_spans in resource_spans.get("scopeSpans", []):
                for span in scope_spans.get("spans", []):
                    for ids in (span, *span.get("links", ())):  # a link names its span too
                        for key in ("traceId", "spanId", "parentSpanId"):
                            if ids.get(key):
                                ids[key] = base64.b64decode(ids[key]).hex()
        with self._lock:
            if self._file.closed:
                return SpanExportResult.FAILURE
            try:
                self._file.write(json.dumps(message, separators=(",", ":")) + "\n")
                self._file.flush()
            except OSError as exc:
                return self._failed(exc)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            try:
                self._file.close()  # flushes what a failed write left in its buffer
            except OSError as exc:
                self._failed(exc)


# The loggers of the SDK's public exporter modules that report failed exports.
_OTLP_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http.metric_exporter",
    "opentelemetry.exporter.otlp.proto.http._log_exporter",
)
_log_filter = LogFilter()
SDK_OTLP_TIMEOUT_S = 10.0  # the SDK's default bound on one export (its unit: seconds)
# The SDK's BatchSpanProcessor defaults, applied where an OTEL_BSP_* value is unusable.
BSP_DEFAULTS = {
    "MAX_QUEUE_SIZE": 2048,
    "SCHEDULE_DELAY": 5000,
    "MAX_EXPORT_BATCH_SIZE": 512,
    "EXPORT_TIMEOUT": 30000,
}
# The SDK's BatchLogRecordProcessor defaults (OTEL_BLRP_*): it raises on a value <= 0.
BLRP_DEFAULTS = {**BSP_DEFAULTS, "SCHEDULE_DELAY": 1000}


def sdk_disabled() -> bool:
    """OTEL_SDK_DISABLED is `true` (any case), as the SDK reads it: no signal at all."""
    return os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def wanted_exporters(
    explicit: tuple[str, ...] | None, signal: Signal, endpoint_given: bool
) -> tuple[str, ...]:
    """The exporters of `signal`: `explicit` if given, else OTEL_<SIGNAL>_EXPORTER, else
    OTLP when an endpoint is set (argument or variable), else none: unlike the
    specification's `otlp` default, nothing goes over the network unless asked."""
    if explicit is not None:
        return explicit
    variable = _EXPORTER_VARIABLES[signal]
    named = os.environ.get(variable, "").strip()
    if named:
        try:
            return parse_exporters(named, ("none", "otlp", "console"))
        except TracingConfigError as exc:
            warn_once(variable, f"ignoring {variable}={named!r} ({exc})")
    return ("otlp",) if endpoint_given or _otlp_variable("ENDPOINT", signal)[1] else ()


def _otlp_variable(setting: str, signal: Signal) -> tuple[str, str]:
    """(name, value) of OTEL_EXPORTER_OTLP_<SIGNAL>_<SETTING> if set, else of
    OTEL_EXPORTER_OTLP_<SETTING> if set, else ("", "")."""
    for name in (f"OTEL_EXPORTER_OTLP_{signal.upper()}_{setting}", f"OTEL_EXPORTER_OTLP_{setting}"):
        value = os.environ.get(name, "").strip()
        if value:
            return name, value
    return "", ""


def otlp_protocol(explicit: str | None, signal: Signal) -> str:
    """`explicit`, else OTEL_EXPORTER_OTLP_[<SIGNAL>_]PROTOCOL, else http/protobuf (the
    specification's default). The Python exporters encode protobuf only: http/json is
    sent as http/protobuf, to the same port."""
    if explicit is not None:
        return explicit
    variable, text = _otlp_variable("PROTOCOL", signal)
    if text.lower() in PROTOCOLS:
        return text.lower()
    if text:
        warn_once(variable, f"ignoring {variable}={text!r}: not grpc or http/protobuf")
    return "http/protobuf"


def otlp_url(signal: Signal, protocol: str, endpoint: str | None) -> tuple[str, bool]:
    """(the URL the exporter sends to, whether the SDK reads it from OTEL_*): `endpoint`,
    else OTEL_EXPORTER_OTLP_<SIGNAL>_ENDPOINT as is, else OTEL_EXPORTER_OTLP_ENDPOINT, else
    the protocol's default; a base URL gets the signal's path over HTTP."""
    from_variable = endpoint is None
    if endpoint is None:
        name, endpoint = _otlp_variable("ENDPOINT", signal)
        if name.startswith(f"OTEL_EXPORTER_OTLP_{signal.upper()}_"):
            return endpoint, True
        endpoint = endpoint or f"http://localhost:{PORTS[protocol]}"
    if protocol == "grpc":
        return endpoint, from_variable
    path = f"/v1/{signal}"
    base = endpoint.rstrip("/")
    return (base if base.endswith(path) else base + path), from_variable


def otlp_timeout_s(signal: Signal) -> tuple[float | None, list[str]]:
    """(the timeout to pass the SDK's exporter, the variables to hide from it): (None, [])
    when OTEL_EXPORTER_OTLP_[<SIGNAL>_]TIMEOUT is unset or usable (the SDK reads it, in
    seconds); for a value the SDK would misuse (a negative timeout fails every export at
    once; `abc` makes the gRPC exporter raise), one line naming it and the SDK's default."""
    name, text = _otlp_variable("TIMEOUT", signal)
    if not text:
        return None, []
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if math.isfinite(value) and value > 0:
        return None, []
    warn_once(
        f"{name}={text}",
        f"ignoring {name}={text!r} (not a positive number of seconds, the SDK's unit); "
        f"each {signal} export is bounded by the SDK's default {SDK_OTLP_TIMEOUT_S:g} s",
    )
    return SDK_OTLP_TIMEOUT_S, [name]


@contextlib.contextmanager
def _hidden(names: list[str]) -> Iterator[None]:
    """The variables `names` absent while the SDK's exporter reads its settings."""
    saved = {name: os.environ.pop(name) for name in names if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def otlp_exporter(
    signal: Signal,
    protocol: str,
    endpoint: str | None,
    report: Report | None = None,
    protocol_setting: str = "OTEL_EXPORTER_OTLP_PROTOCOL",
    **options: Any,  # the SDK exporter class's own keywords, forwarded
) -> Any:  # the SDK's exporter of `signal`, its class chosen at run time: no common type
    """The SDK's OTLP exporter of `signal` (None, warned once, if it refuses its settings),
    watched (tracing.diagnose): the first failed attempt of an outage is one line to
    `report` (default: a warning on the `tracing` logger) naming its likely cause, and
    `protocol_setting` how to choose the protocol. `endpoint` None lets the SDK read
    OTEL_*; a base URL gets the signal's path over HTTP. Its module is imported only
    here: an unused transport need not exist."""
    transport = "grpc" if protocol == "grpc" else "http"
    kind, class_name = _OTLP_CLASSES[signal]
    module = importlib.import_module(f"opentelemetry.exporter.otlp.proto.{transport}.{kind}")
    url, from_variable = otlp_url(signal, protocol, endpoint)
    for name in _OTLP_LOGGERS:
        logging.getLogger(name).addFilter(_log_filter)  # once: addFilter skips a known one
    exporter_cls = getattr(module, class_name)
    timeout_s, hidden = otlp_timeout_s(signal)
    if timeout_s is not None:
        options["timeout"] = timeout_s
    try:
        with _hidden(hidden):
            exporter = exporter_cls(endpoint=None if from_variable else url, **options)
    except Exception as exc:  # a setting the SDK refuses: the run goes on
        warn_once(
            f"otlp {signal}",
            f"the SDK's OTLP {signal} exporter refused its settings "
            f"({type(exc).__name__}: {exc}); {signal} are not exported",
        )
        return None
    watch(exporter, ExportWatch(signal, url, protocol, report, protocol_setting))
    return exporter


def build_exporters(
    cfg: TracingConfig, report: Report | None = None
) -> tuple[list[SpanExporter], list[str]]:
    """The span exporters `cfg` (and the OTEL_* variables it leaves open) name, and a
    few words on where each sends (for a start-up line). A trace file is always written,
    unless OTEL_SDK_DISABLED turns every signal off. `report`: see `otlp_exporter`."""
    if sdk_disabled():
        return [], []
    names = wanted_exporters(cfg.exporter, "traces", cfg.otlp_endpoint is not None)
    if cfg.trace_file and "file" not in names:
        names = (*names, "file")
    exporters: list[SpanExporter] = []
    sinks: list[str] = []
    for name in names:
        if name == "otlp":
            protocol = otlp_protocol(cfg.otlp_protocol, "traces")
            exporter = otlp_exporter(
                "traces", protocol, cfg.otlp_endpoint, report, cfg.protocol_setting
            )
            if exporter is not None:
                exporters.append(exporter)
                url = otlp_url("traces", protocol, cfg.otlp_endpoint)[0]
                sinks.append(f"OTLP/{protocol} {url}")
        elif name == "console":
            exporters.append(ConsoleSpanExporter())
            sinks.append("console")
        elif name == "file" and cfg.trace_file:  # TracingConfig refuses `file` without it
            # PATH for rank 0, PATH.rankN for the others: ranks appending to one file interleave
            path = cfg.trace_file if cfg.rank == 0 else f"{cfg.trace_file}.rank{cfg.rank}"
            exporters.append(OtlpJsonFileExporter(path, report))
            sinks.append(f"file {path}")
    return exporters, sinks


@dataclass
class DeliveryCounts:
    """What became of the sampled spans handed to tracing's exporters."""

    handed: int = 0
    exported: int = 0
    failed: int = 0  # the exporter reported an error, or was closed at the bound
    late: int = 0  # ended after shutdown began (a phase still open then)

    @property
    def dropped(self) -> int:
        """Neither exported nor failed: queue full, or still queued (at the bound)."""
        return max(0, self.handed - self.exported - self.failed)


_lowered = threading.local()


def lower_thread_priority() -> None:
    """Lets an export thread yield the CPU to the program it observes, once per thread:
    encoding spans is real work, which on busy cores should fill the training threads'
    idle moments (on Linux, setpriority on a native thread id affects that thread alone)."""
    if getattr(_lowered, "done", False):
        return
    _lowered.done = True
    try:
        tid = threading.get_native_id()
        niceness = os.getpriority(os.PRIO_PROCESS, tid) + EXPORT_THREAD_NICENESS
        os.setpriority(os.PRIO_PROCESS, tid, niceness)
    except (AttributeError, OSError):
        pass  # not permitted here, or not POSIX: export at normal priority


class CountingExporter(SpanExporter):
    """Thread contract: `export` on the processor's worker (whose priority it lowers once);
    `close` from any thread: it shuts the inner exporter down, which aborts an export
    waiting to retry, and every later export fails at once without sending."""

    def __init__(self, inner: SpanExporter) -> None:
        self.inner = inner
        self.exported = self.failed = 0
        self.watch = watch_of(inner)  # an OTLP exporter's failures, told (tracing.diagnose)
        self._closed = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lower_thread_priority()
        result = None if self._closed else self._export(spans)
        if result != SpanExportResult.SUCCESS:
            self.failed += len(spans)
            return SpanExportResult.FAILURE
        self.exported += len(spans)
        return SpanExportResult.SUCCESS

    def _export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult | None:
        export_watch = self.watch
        if export_watch is None:
            return call_logged(self.inner.export, spans)  # None: it raised
        with export_watch.exporting():
            result = call_logged(self.inner.export, spans)
        if result == SpanExportResult.SUCCESS:
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
        return self.inner.force_flush(timeout_millis)


RECENT_SPANS = 64
"""Sampled spans kept per name for the exemplars of the phase histograms (tracing.metrics)."""


class SpanCounter(SpanProcessor):
    """Counts the sampled spans handed to the processors after it; once `closed`, counts
    them as late (warned once). Keeps the last RECENT_SPANS sampled spans of each name
    (`recent`): the phase histograms' exemplars link a duration to its trace. Thread
    contract: `on_end` on any thread, never blocking: next() of itertools.count and a
    bounded deque's append are atomic under the GIL; a read draws once more."""

    def __init__(self) -> None:
        self.reset()
        self.closed = self._warned = False

    def reset(self) -> None:
        self._handed, self._late, self._reads = itertools.count(), itertools.count(), 0
        self.recent: dict[str, deque[ReadableSpan]] = {}

    def recent_spans(self, name: str) -> list[ReadableSpan]:
        """The last sampled spans named `name`, oldest first (a copy; any thread)."""
        spans = self.recent.get(name)
        return list(spans) if spans is not None else []

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # nothing queued here; SDKs before 1.4x return None, read as a failure

    def on_end(self, span: ReadableSpan) -> None:
        if span.context is None or not span.context.trace_flags.sampled:
            return
        if not self.closed:
            next(self._handed)
            recent = self.recent.get(span.name)
            if recent is None:  # setdefault: two threads' first spans share one deque
                recent = self.recent.setdefault(span.name, deque(maxlen=RECENT_SPANS))
            recent.append(span)
        elif next(self._late) is not None and not self._warned:
            self._warned = True
            message = "tracing: span %r ended after shutdown began; it and later ones are late"
            logger.warning(message, span.name)

    def counts(self, exporters: Sequence[CountingExporter]) -> DeliveryCounts:
        self._reads += 1  # the draws of earlier reads are not spans
        handed = next(self._handed) - (self._reads - 1)
        late = next(self._late) - (self._reads - 1)
        exported, failed = sum(e.exported for e in exporters), sum(e.failed for e in exporters)
        return DeliveryCounts(handed * len(exporters), exported, failed, late)


def batch_settings(prefix: str = "OTEL_BSP") -> dict[str, int]:
    """OTEL_BSP_* (`prefix` OTEL_BLRP: the logs' OTEL_BLRP_*) as the SDK reads them (whole
    numbers; ms for the delay and timeout), by variable name, each checked first: a value
    the SDK would refuse (with a traceback, or by raising) is one line naming it, and the
    SDK's default applies."""
    defaults = BLRP_DEFAULTS if prefix == "OTEL_BLRP" else BSP_DEFAULTS
    what = "records" if prefix == "OTEL_BLRP" else "spans"
    values: dict[str, int] = {}
    for key, default in defaults.items():
        name = f"{prefix}_{key}"
        text = os.environ.get(name, "").strip()
        values[name] = default
        if not text:
            continue
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value > 0:
            values[name] = value
        else:
            why = "not a whole number above 0"
            warn_once(f"{name}={text}", f"ignoring {name}={text!r} ({why}); using {default}")
    queue, batch = values[f"{prefix}_MAX_QUEUE_SIZE"], values[f"{prefix}_MAX_EXPORT_BATCH_SIZE"]
    if batch > queue:
        name = f"{prefix}_MAX_EXPORT_BATCH_SIZE"
        if os.environ.get(name, "").strip():
            why = f"above the queue's {queue} {what}"
            warn_once(name, f"ignoring {name}={batch} ({why}); using {queue}")
        values[name] = queue
    return values


def batch_processor(exporter: SpanExporter) -> BatchSpanProcessor:
    """The SDK's batch processor, with OTEL_BSP_* checked (`batch_settings`)."""
    settings = batch_settings()
    return BatchSpanProcessor(
        exporter,
        max_queue_size=settings["OTEL_BSP_MAX_QUEUE_SIZE"],
        schedule_delay_millis=settings["OTEL_BSP_SCHEDULE_DELAY"],
        max_export_batch_size=settings["OTEL_BSP_MAX_EXPORT_BATCH_SIZE"],
        export_timeout_millis=settings["OTEL_BSP_EXPORT_TIMEOUT"],
    )


class Closing(Protocol):
    """A watched exporter as `join_closing` closes it."""

    @property
    def unreachable(self) -> bool: ...
    @property
    def closed(self) -> bool: ...
    def close(self) -> None: ...


def join_closing(thread: threading.Thread, until: float, exporters: Sequence[Closing]) -> None:
    """Joins `thread` (a provider shutting down) until the monotonic time `until`, and
    closes each of `exporters` (`unreachable`, `closed`, `close`) as soon as its endpoint
    is known unreachable: its retries abort, and what it has left fails at once."""
    while thread.is_alive() and (left_s := until - time.monotonic()) > 0:
        for exporter in exporters:
            if exporter.unreachable and not exporter.closed:
                call_bounded(exporter.close, min(left_s, 1.0))
        thread.join(min(0.05, left_s))


def call_bounded(fn: Callable[..., _R], timeout_s: float, *args: object) -> _R | None:
    """`fn(*args)` on a daemon thread, waited for at most `timeout_s`: its result, or
    None when it raised (logged) or is still running."""
    result: list[_R | None] = [None]

    def target() -> None:
        result[0] = call_logged(fn, *args)

    thread = threading.Thread(target=target, name="tracing-bounded-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return result[0]
