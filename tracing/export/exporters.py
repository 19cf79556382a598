"""The exporters `setup` builds by name: the SDK's OTLP exporters (gRPC or HTTP), the
console, and an OTLP/JSON lines file, one per rank.

The SDK's exporters read their OTEL_* variables themselves (endpoint, headers, timeout,
compression, TLS); only what the SDK does not decide is read here: whether to export
at all (OTEL_TRACES_EXPORTER, OTEL_METRICS_EXPORTER, or an endpoint being set) and
which exporter class a protocol names (OTEL_EXPORTER_OTLP_[SIGNAL_]PROTOCOL).
"""

from __future__ import annotations

import base64
import importlib
import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any, Literal

from opentelemetry.environment_variables import OTEL_METRICS_EXPORTER, OTEL_TRACES_EXPORTER
from opentelemetry.sdk.environment_variables import OTEL_EXPORTER_OTLP_ENDPOINT
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SpanExporter, SpanExportResult

from tracing.config import PROTOCOLS, TracingConfig, TracingConfigError, parse_exporters, warn_once

Signal = Literal["traces", "metrics"]


class OtlpJsonFileExporter(SpanExporter):
    """Appends one OTLP/JSON `ExportTraceServiceRequest` object per line (ids in hex).

    The format of the collector's file exporter; Jaeger's UI can load such a file.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in shutdown
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        from google.protobuf.json_format import MessageToDict
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

        message = MessageToDict(encode_spans(spans), use_integers_for_enums=True)
        # Protobuf's JSON mapping writes bytes in base64; OTLP/JSON wants hex ids.
        for resource_spans in message.get("resourceSpans", []):
            for scope_spans in resource_spans.get("scopeSpans", []):
                for span in scope_spans.get("spans", []):
                    for key in ("traceId", "spanId", "parentSpanId"):
                        if span.get(key):
                            span[key] = base64.b64decode(span[key]).hex()
        with self._lock:
            if self._file.closed:
                return SpanExportResult.FAILURE
            self._file.write(json.dumps(message, separators=(",", ":")) + "\n")
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class _RateLimitFilter(logging.Filter):
    """One record per message template every `period_s`: a dead collector would
    otherwise log an error for every batch, all through training."""

    def __init__(self, period_s: float = 60.0) -> None:
        super().__init__()
        self.period_s = period_s
        self._last_s: dict[tuple[str, object], float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key, now_s = (record.name, record.msg), time.monotonic()
        if now_s - self._last_s.get(key, -self.period_s) < self.period_s:
            return False
        self._last_s[key] = now_s
        return True


# The loggers of the SDK's public exporter modules that report failed exports.
_OTLP_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http.metric_exporter",
)
_rate_limit = _RateLimitFilter()


def wanted_exporters(
    explicit: tuple[str, ...] | None, signal: Signal, endpoint_given: bool
) -> tuple[str, ...]:
    """The exporters of `signal`: `explicit` if given, else OTEL_<SIGNAL>_EXPORTER, else
    OTLP when an endpoint is set (argument or variable), else none: unlike the
    specification's `otlp` default, nothing goes over the network unless asked."""
    if explicit is not None:
        return explicit
    variable = OTEL_TRACES_EXPORTER if signal == "traces" else OTEL_METRICS_EXPORTER
    named = os.environ.get(variable, "").strip()
    if named:
        try:
            return parse_exporters(named, ("none", "otlp", "console"))
        except TracingConfigError as exc:
            warn_once(variable, f"ignoring {variable}={named!r} ({exc})")
    endpoints = (OTEL_EXPORTER_OTLP_ENDPOINT, f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT")
    set_ = endpoint_given or any(os.environ.get(name, "").strip() for name in endpoints)
    return ("otlp",) if set_ else ()


def otlp_protocol(explicit: str | None, signal: Signal) -> str:
    """`explicit`, else OTEL_EXPORTER_OTLP_<SIGNAL>_PROTOCOL, else OTEL_EXPORTER_OTLP_PROTOCOL,
    else http/protobuf (the specification's default). The Python exporters encode
    protobuf only: http/json is sent as http/protobuf, to the same port."""
    if explicit is not None:
        return explicit
    for variable in (
        f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
    ):
        text = os.environ.get(variable, "").strip().lower()
        if text in PROTOCOLS:
            return text
        if text:
            warn_once(
                variable, f"{variable}={text!r} is not grpc or http/protobuf; sending http/protobuf"
            )
            return "http/protobuf"
    return "http/protobuf"


def otlp_exporter(signal: Signal, protocol: str, endpoint: str | None, **options: Any) -> Any:
    """The SDK's OTLP exporter of `signal` (None, warned once, if it refuses its settings).
    `endpoint` None lets it read OTEL_*; a base URL given here gets the signal's path
    over HTTP. Its module is imported only here: an unused transport need not exist."""
    transport = "grpc" if protocol == "grpc" else "http"
    kind = "trace" if signal == "traces" else "metric"
    module = importlib.import_module(
        f"opentelemetry.exporter.otlp.proto.{transport}.{kind}_exporter"
    )
    if endpoint is not None and transport == "http":
        path = f"/v1/{signal}"
        endpoint = endpoint if endpoint.rstrip("/").endswith(path) else endpoint.rstrip("/") + path
    for name in _OTLP_LOGGERS:
        if _rate_limit not in logging.getLogger(name).filters:
            logging.getLogger(name).addFilter(_rate_limit)
    exporter_cls = module.OTLPSpanExporter if signal == "traces" else module.OTLPMetricExporter
    try:
        return exporter_cls(endpoint=endpoint, **options)
    except Exception as exc:  # e.g. a malformed OTEL_EXPORTER_OTLP_TIMEOUT: the run goes on
        warn_once(
            f"otlp {signal}",
            f"the SDK's OTLP {signal} exporter refused its settings "
            f"({type(exc).__name__}: {exc}); {signal} are not exported",
        )
        return None


def trace_file_path(path: str, rank: int) -> str:
    """PATH for rank 0, PATH.rankN for the others (ranks appending to one file interleave)."""
    return path if rank == 0 else f"{path}.rank{rank}"


def build_exporters(cfg: TracingConfig) -> tuple[list[SpanExporter], list[str]]:
    """The span exporters `cfg` (and the OTEL_* variables it leaves open) name, and a
    few words on where each sends (for a start-up line). A trace file is always written."""
    names = wanted_exporters(cfg.exporter, "traces", cfg.otlp_endpoint is not None)
    if cfg.trace_file and "file" not in names:
        names = (*names, "file")
    exporters: list[SpanExporter] = []
    sinks: list[str] = []
    for name in names:
        if name == "otlp":
            protocol = otlp_protocol(cfg.otlp_protocol, "traces")
            exporter = otlp_exporter("traces", protocol, cfg.otlp_endpoint)
            if exporter is not None:
                exporters.append(exporter)
                sinks.append(f"OTLP/{protocol} {cfg.otlp_endpoint or _endpoint_variable()}")
        elif name == "console":
            exporters.append(ConsoleSpanExporter())
            sinks.append("console")
        elif name == "file":
            assert cfg.trace_file is not None  # checked by TracingConfig
            path = trace_file_path(cfg.trace_file, cfg.rank)
            exporters.append(OtlpJsonFileExporter(path))
            sinks.append(f"file {path}")
    return exporters, sinks


def _endpoint_variable() -> str:
    for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", OTEL_EXPORTER_OTLP_ENDPOINT):
        if os.environ.get(name, "").strip():
            return os.environ[name].strip()
    return "(the SDK's default endpoint)"
