"""The exporters `setup` builds from a TracingConfig: OTLP (gRPC or HTTP), console, and
an OTLP/JSON lines file, one per rank."""

from __future__ import annotations

import base64
import importlib
import json
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from tracing.config import TracingConfig


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

        request = encode_spans(spans)
        message = MessageToDict(request, use_integers_for_enums=True)
        _ids_to_hex(message)
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


def _ids_to_hex(message: dict) -> None:
    # Protobuf's JSON mapping writes bytes in base64; OTLP/JSON wants hex ids.
    for resource_spans in message.get("resourceSpans", []):
        for scope_spans in resource_spans.get("scopeSpans", []):
            for span in scope_spans.get("spans", []):
                for item in [span, *span.get("links", [])]:
                    for key in ("traceId", "spanId", "parentSpanId"):
                        if item.get(key):
                            item[key] = base64.b64decode(item[key]).hex()


class _RateLimitFilter(logging.Filter):
    """Lets one record per message template through every `period_s`: a dead collector
    would otherwise log an error for every batch, all through training."""

    def __init__(self, period_s: float = 60.0) -> None:
        super().__init__()
        self.period_s = period_s
        self._last_s: dict[tuple[str, object], float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.msg)
        now_s = time.monotonic()
        if now_s - self._last_s.get(key, -self.period_s) < self.period_s:
            return False
        self._last_s[key] = now_s
        return True


_OTLP_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http._common",
    "opentelemetry.exporter.http_transport",
)
_rate_limit = _RateLimitFilter()


def quiet_otlp_loggers(*extra_loggers: str) -> None:
    """Rate-limits the SDK's OTLP exporter loggers (and `extra_loggers`, e.g. another
    signal's exporter) to one record per message every minute."""
    for name in (*_OTLP_LOGGERS, *extra_loggers):
        otel_logger = logging.getLogger(name)
        if _rate_limit not in otel_logger.filters:
            otel_logger.addFilter(_rate_limit)


def trace_file_path(path: str, rank: int) -> str:
    """The trace file of one rank: PATH for rank 0, PATH.rankN for the others (every
    rank appending to one file interleaves their lines)."""
    return path if rank == 0 else f"{path}.rank{rank}"


ExporterSpec = tuple[Any, ...]
"""What builds one exporter, in plain values (a forked child builds its own from it):
("otlp", protocol, url, headers, timeout_s), ("file", path) or ("console",)."""


def exporter_specs(cfg: TracingConfig, *, pid_suffix: bool = False) -> list[ExporterSpec]:
    """The exporters named in `cfg.exporter`, as specs (`make_exporter` builds one).

    `pid_suffix`: a forked child's trace file gets `.pidN` after the rank's name."""
    specs: list[ExporterSpec] = []
    for name in cfg.exporter:
        if name == "otlp":
            url = otlp_traces_url(cfg)
            specs.append(("otlp", cfg.otlp_protocol, url, dict(cfg.otlp_headers),
                          cfg.export_timeout_s))  # fmt: skip
        elif name == "console":
            specs.append(("console",))
        elif name == "file":
            assert cfg.trace_file is not None  # checked by TracingConfig
            path = trace_file_path(cfg.trace_file, cfg.rank)
            if pid_suffix:
                path = f"{path}.pid{os.getpid()}"
            specs.append(("file", path))
    return specs


def make_exporter(spec: ExporterSpec) -> SpanExporter:
    """The exporter of one spec; imports each SDK exporter only when used."""
    kind = spec[0]
    if kind == "otlp":
        _, protocol, url, headers, timeout_s = spec
        quiet_otlp_loggers()
        return otlp_exporter("trace", protocol, url, headers, timeout_s)
    if kind == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if kind == "file":
        return OtlpJsonFileExporter(spec[1])
    raise ValueError(f"unknown exporter spec {spec!r}")


def otlp_traces_url(cfg: TracingConfig) -> str:
    """The URL the OTLP exporter sends to: for HTTP a base URL gets /v1/traces appended
    (the signal path is fixed); OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is used as is."""
    assert cfg.otlp_endpoint is not None  # checked by TracingConfig
    if cfg.otlp_protocol == "grpc" or cfg.otlp_endpoint_is_traces_url:
        return cfg.otlp_endpoint
    endpoint = cfg.otlp_endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"


def otlp_exporter(
    signal: Literal["trace", "metric"],
    protocol: str,
    url: str,
    headers: Mapping[str, str],
    timeout_s: float,
    **options: Any,
) -> Any:
    """The SDK's OTLP exporter of `signal` over gRPC (`protocol` "grpc") or HTTP; its
    module is imported only here, so a transport that is not used need not be installed.
    `options`: further keyword arguments of the exporter's constructor."""
    transport = "grpc" if protocol == "grpc" else "http"
    module = importlib.import_module(
        f"opentelemetry.exporter.otlp.proto.{transport}.{signal}_exporter"
    )
    exporter_cls = module.OTLPSpanExporter if signal == "trace" else module.OTLPMetricExporter
    # gRPC needs TLS switched off explicitly for a plain-text collector.
    tls = {"insecure": url.startswith("http://")} if transport == "grpc" else {}
    return exporter_cls(
        endpoint=url, headers=dict(headers) or None, timeout=timeout_s, **tls, **options
    )


def build_exporters(cfg: TracingConfig, *, pid_suffix: bool = False) -> list[SpanExporter]:
    """The exporters named in `cfg.exporter` (`pid_suffix`: a forked child's trace file)."""
    return [make_exporter(spec) for spec in exporter_specs(cfg, pid_suffix=pid_suffix)]
