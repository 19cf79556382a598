from __future__ import annotations

import json
import logging
import socket
import time

import pytest

import tracing
from tracing import TracingConfig, TracingConfigError


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"exporter": "jaeger"}, "'jaeger'"),
        ({"otlp_protocol": "udp"}, "'udp'"),
        ({"exporter": "otlp", "otlp_endpoint": "http://host:notaport"}, "notaport"),
        ({"exporter": "otlp", "otlp_endpoint": "ftp://host:4317"}, "ftp://host:4317"),
        ({"exporter": "otlp"}, "needs an endpoint"),
        ({"exporter": "file"}, "trace_file"),
        ({"cuda_timing": "cupti"}, "'cupti'"),
        ({"level": "verbose"}, "'verbose'"),
        ({"sample_ratio": 1.5}, "1.5"),
        ({"report_interval_s": -1}, "-1"),
        ({"export_timeout_s": 0}, "export_timeout_s"),
    ],
)
def test_bad_values_raise_one_line_errors(kwargs, needle):
    with pytest.raises(TracingConfigError) as info:
        TracingConfig(**kwargs)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_env_is_honored_and_explicit_values_win():
    env = {
        "OTEL_SERVICE_NAME": "svc",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_HEADERS": "api-key=abc",
        "OTEL_RESOURCE_ATTRIBUTES": "team=ml,site=a",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.25",
    }
    cfg = TracingConfig.from_env(env, resource_attributes={"site": "b"}, level=None)
    assert cfg.service_name == "svc" and cfg.exporter == ("otlp",)
    assert cfg.otlp_protocol == "http" and cfg.otlp_headers == {"api-key": "abc"}
    assert cfg.sample_ratio == 0.25 and cfg.level == "phase"
    assert cfg.resource_attributes == {"team": "ml", "site": "b"}
    explicit = TracingConfig.from_env(env, service_name="cli", exporter="none")
    assert explicit.service_name == "cli" and explicit.exporter == ("none",)
    assert TracingConfig.from_env({}).exporter == ("none",)  # no endpoint: no network
    disabled = TracingConfig.from_env({**env, "OTEL_SDK_DISABLED": "true"})
    assert disabled.level == "off" and disabled.exporter == ("none",)


def test_no_exporter_means_no_provider():
    telemetry = tracing.setup(TracingConfig())
    try:
        assert telemetry.provider is None
        with tracing.phase("x"):
            pass
        assert telemetry.stats.get("x").count == 1
    finally:
        telemetry.shutdown()


def test_file_exporter_writes_otlp_json_lines(tmp_path):
    path = tmp_path / "trace.jsonl"
    telemetry = tracing.setup(TracingConfig(exporter="file", trace_file=str(path), rank=2))
    root = tracing.start_span("batch")
    with tracing.phase("drafter.step", parent=root):
        pass
    root.end()
    report = telemetry.shutdown(timeout_s=2.0)
    assert report.spans_exported == 2 and report.clean
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


def test_bounded_shutdown_against_closed_port():
    cfg = TracingConfig(
        exporter="otlp",
        otlp_endpoint=f"http://127.0.0.1:{_closed_port()}",
        schedule_delay_s=0.05,
        max_queue_size=100,
    )
    telemetry = tracing.setup(cfg)
    started = time.monotonic()
    for _ in range(300):
        with tracing.phase("work"):
            pass
    assert time.monotonic() - started < 2.0  # span creation never waits on the collector
    time.sleep(0.3)
    report = telemetry.shutdown(timeout_s=3.0)
    assert report.duration_s < 3.0
    assert report.spans_exported == 0
    assert report.spans_dropped + report.spans_not_delivered == 300
    assert "not delivered" in report.summary()
    assert telemetry.stats.get("work").count == 300


def test_a_span_ended_after_shutdown_is_counted_and_warned_once(caplog):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    telemetry = tracing.setup(TracingConfig(), exporters=[exporter])
    with tracing.phase("before"):
        pass
    open_phases = [tracing.start_span(f"open.{i}") for i in range(3)]
    report = telemetry.shutdown(timeout_s=2.0)
    assert report.spans_exported == 1 and report.spans_late == 0 and report.clean
    with caplog.at_level(logging.WARNING, logger="tracing"):
        for span in open_phases:
            span.end()
    warnings = [r.getMessage() for r in caplog.records if "after" in r.getMessage()]
    assert len(warnings) == 1 and "'open.0'" in warnings[0]
    assert telemetry.delivery_counts().late == 3
    assert [s.name for s in exporter.get_finished_spans()] == ["before"]
