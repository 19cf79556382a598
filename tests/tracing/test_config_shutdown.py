"""The application's settings (one-line errors), the trace file, and the bounded shutdown
against a collector that is gone."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import tracing
from tracing import TracingConfig, TracingConfigError


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"exporter": "jaeger"}, "'jaeger'"),
        ({"otlp_protocol": "udp"}, "'udp'"),
        ({"otlp_endpoint": "http://host:notaport"}, "notaport"),
        ({"otlp_endpoint": "ftp://host:4317"}, "ftp://host:4317"),
        ({"otlp_endpoint": "localhost:4317"}, "'localhost:4317'"),
        ({"exporter": "file"}, "trace_file"),
        ({"cuda_timing": "cupti"}, "'cupti'"),
        ({"level": "verbose"}, "'verbose'"),
        ({"sample_ratio": 1.5}, "1.5"),
        ({"report_interval_s": -1}, "-1"),
        ({"shutdown_timeout_s": 0}, "shutdown_timeout_s"),
        ({"rank": -1}, "rank"),
    ],
)
def test_bad_values_raise_one_line_errors(kwargs, needle) -> None:
    with pytest.raises(TracingConfigError) as info:
        TracingConfig(**kwargs)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_protocols_and_exporters_are_normalized() -> None:
    cfg = TracingConfig(exporter="OTLP, console,none", otlp_protocol="http")
    assert cfg.exporter == ("otlp", "console") and cfg.otlp_protocol == "http/protobuf"
    assert TracingConfig().run_id != TracingConfig().run_id  # random unless the app shares one


def test_no_exporter_sends_nothing_and_costs_no_span(clean_env) -> None:
    telemetry = tracing.setup(TracingConfig())
    try:
        assert telemetry.sinks == [] and not telemetry.tracing_spans
        with tracing.phase("x"):
            pass
        assert telemetry.stats.get("x").count == 1
    finally:
        assert telemetry.shutdown().spans_exported == 0


def test_file_exporter_writes_otlp_json_lines(clean_env, tmp_path) -> None:
    path = tmp_path / "trace.jsonl"
    telemetry = tracing.setup(TracingConfig(trace_file=str(path), rank=2))
    root = tracing.start_span("batch")
    with tracing.phase("drafter.step", parent=root):
        pass
    root.end()
    report = telemetry.shutdown(timeout_s=2.0)
    assert report.spans_exported == 2 and report.clean
    assert telemetry.sinks == [f"file {path}.rank2"]
    assert not path.exists()  # rank 2 writes PATH.rank2: ranks never share one file
    lines = [json.loads(line) for line in (tmp_path / "trace.jsonl.rank2").read_text().splitlines()]
    resource_spans = lines[0]["resourceSpans"][0]
    spans = {s["name"]: s for s in resource_spans["scopeSpans"][0]["spans"]}
    assert len(spans["batch"]["traceId"]) == 32 and len(spans["batch"]["spanId"]) == 16
    assert spans["drafter.step"]["parentSpanId"] == spans["batch"]["spanId"]
    attrs = {a["key"]: a["value"] for a in resource_spans["resource"]["attributes"]}
    assert attrs["tracing.rank"] == {"intValue": "2"}
    assert attrs["telemetry.sdk.name"] == {"stringValue": "opentelemetry"}
    assert resource_spans["scopeSpans"][0]["scope"]["version"]


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_bounded_shutdown_against_closed_port(clean_env, protocol) -> None:
    clean_env.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    cfg = TracingConfig(otlp_endpoint=f"http://127.0.0.1:{_closed_port()}", otlp_protocol=protocol)
    telemetry = tracing.setup(cfg)
    started = time.monotonic()
    for _ in range(300):
        with tracing.phase("work"):
            pass
    assert time.monotonic() - started < 2.0  # span creation never waits on the collector
    time.sleep(0.3)
    report = telemetry.shutdown(timeout_s=3.0)
    assert report.duration_s < 3.0 and report.spans_exported == 0
    assert report.spans_not_delivered == 300 and "failed" in report.summary()
    assert telemetry.stats.get("work").count == 300


class _GateExporter(InMemorySpanExporter):
    """A collector that answers only once the test opens the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.called, self.gate = threading.Event(), threading.Event()

    def export(self, spans):  # type: ignore[no-untyped-def]
        self.called.set()
        self.gate.wait(10)
        return super().export(spans)


def test_a_full_queue_drops_and_counts(clean_env) -> None:
    clean_env.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "10")
    clean_env.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "10")
    exporter = _GateExporter()
    telemetry = tracing.setup(TracingConfig(), exporters=[exporter])
    for index in range(25):
        with tracing.phase("work"):
            pass
        if index == 9:  # a full batch: the export starts, and hangs
            assert exporter.called.wait(10)
    assert telemetry.delivery_counts().dropped == 25  # none exported yet
    exporter.gate.set()
    report = telemetry.shutdown(timeout_s=5.0)
    assert report.spans_exported == 20 and report.spans_dropped == 5
    assert len(exporter.get_finished_spans()) == 20 and not report.clean


def test_a_span_ended_after_shutdown_is_counted_and_warned_once(clean_env, caplog) -> None:
    memory = InMemorySpanExporter()
    telemetry = tracing.setup(TracingConfig(), exporters=[memory])
    with tracing.phase("before"):
        pass
    open_phases = [tracing.start_span(f"open.{i}") for i in range(3)]
    report = telemetry.shutdown(timeout_s=2.0)
    assert report.spans_exported == 1 and report.spans_late == 0 and report.clean
    with caplog.at_level(logging.WARNING, logger="tracing"):
        for span in open_phases:
            span.end()
    warnings = [r.getMessage() for r in caplog.records if "after shutdown" in r.getMessage()]
    assert len(warnings) == 1 and "'open.0'" in warnings[0]
    assert telemetry.delivery_counts().late == 3
    assert [s.name for s in memory.get_finished_spans()] == ["before"]
