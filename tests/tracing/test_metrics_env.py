"""The metrics signal's OTEL_* variables, read by the SDK (one test each, named in
docs/observability.md), against real OTLP receivers where a request shows it."""

from __future__ import annotations

import time

import pytest
from env_checks import warns_once

import tracing
from tracing import TracingConfig, TracingConfigError
from tracing.metrics import MetricsConfig, start_metrics


def _export_one(cfg: MetricsConfig, tracing_cfg: TracingConfig | None = None) -> None:
    metrics = start_metrics(cfg, tracing_cfg or TracingConfig())
    metrics.observe("gauge", "depth", lambda: 3, unit="{item}")
    assert metrics.force_flush(timeout_s=5.0)
    report = metrics.shutdown(timeout_s=5.0)
    assert report.exports_ok >= 1 and report.exports_failed == 0, report.summary()


def test_metrics_endpoint_and_headers_variables(clean_env, http_receiver) -> None:
    clean_env.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", http_receiver.endpoint + "/m/metrics")
    clean_env.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-team=ml")
    _export_one(MetricsConfig(export_interval_s=3600))
    request = http_receiver.requests[0]  # the flush's; shutdown sends one more
    assert request.path == "/m/metrics" and request.metric_names == ["depth"]
    assert request.headers["x-team"] == "ml"


def test_metrics_go_where_the_traces_flag_sends(clean_env, http_receiver) -> None:
    traces = TracingConfig(otlp_endpoint=http_receiver.endpoint + "/", otlp_protocol="http")
    _export_one(MetricsConfig(export_interval_s=3600), traces)
    assert {r.path for r in http_receiver.requests} == {"/v1/metrics"}


def test_metrics_headers_reach_a_grpc_receiver(clean_env, grpc_receiver) -> None:
    clean_env.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", grpc_receiver.endpoint)
    clean_env.setenv("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "grpc")
    clean_env.setenv("OTEL_EXPORTER_OTLP_METRICS_HEADERS", "Api-Key=s%3Dcret")
    _export_one(MetricsConfig(export_interval_s=3600))
    request = grpc_receiver.requests[0]
    assert request.metric_names == ["depth"] and request.headers["api-key"] == "s=cret"


@pytest.mark.parametrize(
    ("variable", "value", "exporters"),
    [
        ("OTEL_METRICS_EXPORTER", "none", []),
        ("OTEL_METRICS_EXPORTER", "console", ["_StatsExporter"]),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318", ["_StatsExporter"]),
        ("OTEL_SERVICE_NAME", "nothing-to-export", []),
    ],
)
def test_metrics_exporter_variable(clean_env, variable, value, exporters) -> None:
    clean_env.setenv(variable, value)
    metrics = start_metrics(MetricsConfig(export_interval_s=3600), TracingConfig())
    assert metrics.enabled == bool(exporters)
    metrics.shutdown(timeout_s=1.0)


def test_the_export_interval_variable_is_the_sdks(clean_env, grpc_receiver) -> None:
    clean_env.setenv("OTEL_METRIC_EXPORT_INTERVAL", "100")
    clean_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    metrics = start_metrics(MetricsConfig(), TracingConfig(otlp_endpoint=grpc_receiver.endpoint))
    metrics.observe("gauge", "depth", lambda: 3, unit="{item}")
    deadline = time.monotonic() + 10
    while len(grpc_receiver.requests) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # no flush: the SDK's reader exports on its own every 100 ms
    metrics.shutdown(timeout_s=2.0)
    assert len(grpc_receiver.requests) >= 2


def test_temporality_variable_and_its_bad_values(clean_env, caplog) -> None:
    clean_env.setenv("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", "sometimes")
    for _ in range(2):
        warns_once(caplog, "TEMPORALITY", lambda: start_metrics(MetricsConfig(), TracingConfig()))
    with pytest.raises(TracingConfigError, match="'sometimes'"):
        MetricsConfig(temporality="sometimes")


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"exporter": "prometheus"}, "'prometheus'"),
        ({"temporality": "sometimes"}, "'sometimes'"),
        ({"export_interval_s": 0}, "export_interval_s"),
        ({"shutdown_timeout_s": "soon"}, "'soon'"),
        ({"namespace": 3}, "namespace"),
    ],
)
def test_bad_explicit_metrics_arguments_raise_one_line(kwargs, needle) -> None:
    with pytest.raises(TracingConfigError) as info:
        MetricsConfig(**kwargs)
    message = str(info.value)
    assert needle in message and "\n" not in message


def test_metrics_share_the_traces_resource(clean_env, grpc_receiver) -> None:
    tracing_cfg = TracingConfig(
        otlp_endpoint=grpc_receiver.endpoint,
        otlp_protocol="grpc",
        run_id="run-3",
        rank=2,
        attribute_namespace="app",
    )
    telemetry = tracing.setup(tracing_cfg)
    with tracing.phase("work", level="step"):
        pass
    assert telemetry.shutdown(timeout_s=5.0).clean
    _export_one(MetricsConfig(export_interval_s=3600), tracing_cfg)
    traces, metrics = grpc_receiver.requests[:2]
    assert traces.span_names == ["work"] and metrics.metric_names == ["depth"]
    assert traces.resource == metrics.resource
    assert 'string_value: "run-3"' in metrics.resource["app.run.id"]
