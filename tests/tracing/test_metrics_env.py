"""The metrics OTEL_* variables, ranked as the specification says (one test each, named
in docs/observability.md), against real OTLP receivers where a request shows it."""

from __future__ import annotations

import pytest
from env_checks import read_warns_once

import tracing
from tracing import TracingConfig, TracingConfigError
from tracing.metrics import MetricsConfig, start_metrics
from tracing.metrics_config import otlp_metrics_url


def _export_one(cfg: MetricsConfig, tracing_cfg: TracingConfig) -> None:
    metrics = start_metrics(cfg, tracing_cfg)
    metrics.observe("gauge", "depth", lambda: 3, unit="{item}")
    assert metrics.force_flush(timeout_s=5.0)
    report = metrics.shutdown(timeout_s=5.0)
    assert report.exports_failed == 0, report.summary()


def test_metrics_endpoint_is_used_as_is(clean_env, http_receiver) -> None:
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://elsewhere:4318")
    clean_env.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", http_receiver.endpoint + "/m/metrics")
    clean_env.setenv("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "http/protobuf")
    clean_env.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-team=ml,x-both=generic")
    clean_env.setenv("OTEL_EXPORTER_OTLP_METRICS_HEADERS", "X-Both=metrics%20only")
    cfg = MetricsConfig.from_env(TracingConfig.from_env(), export_interval_s=3600)
    assert cfg.exporter == ("otlp",) and cfg.otlp_protocol == "http"
    _export_one(cfg, TracingConfig())
    request = http_receiver.requests[0]  # the flush's; shutdown sends one more
    assert request.path == "/m/metrics" and request.metric_names == ["depth"]
    assert request.headers["x-team"] == "ml"
    assert request.headers["x-both"] == "metrics only"  # per-signal wins, names lower-cased


def test_generic_endpoint_gets_the_metrics_path(clean_env, http_receiver) -> None:
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", http_receiver.endpoint + "/")
    clean_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    tracing_cfg = TracingConfig.from_env()
    cfg = MetricsConfig.from_env(tracing_cfg, export_interval_s=3600)
    assert otlp_metrics_url(cfg) == http_receiver.endpoint + "/v1/metrics"
    _export_one(cfg, tracing_cfg)
    request = http_receiver.requests[0]  # the flush's; shutdown sends one more
    assert request.path == "/v1/metrics" and request.metric_names == ["depth"]


def test_metrics_headers_reach_a_grpc_receiver(clean_env, grpc_receiver) -> None:
    clean_env.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", grpc_receiver.endpoint)
    clean_env.setenv("OTEL_EXPORTER_OTLP_METRICS_HEADERS", "Api-Key=s%3Dcret")
    clean_env.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "x-traces=only")
    cfg = MetricsConfig.from_env(TracingConfig.from_env(), export_interval_s=3600)
    assert cfg.otlp_protocol == "grpc"
    _export_one(cfg, TracingConfig())
    request = grpc_receiver.requests[0]  # the flush's; shutdown sends one more
    assert request.metric_names == ["depth"]
    assert request.headers["api-key"] == "s=cret" and "x-traces" not in request.headers


def test_traces_only_variables_stay_with_the_traces(clean_env) -> None:
    clean_env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:4318/v1/traces")
    clean_env.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    clean_env.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "100")
    base = TracingConfig.from_env()
    assert (base.otlp_protocol, base.export_timeout_s) == ("http", 0.1)
    cfg = MetricsConfig.from_env(base)
    assert (cfg.exporter, cfg.otlp_endpoint, cfg.otlp_protocol) == (("none",), None, "grpc")
    assert cfg.export_timeout_s == MetricsConfig.export_timeout_s
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    cfg = MetricsConfig.from_env(TracingConfig.from_env())
    assert (cfg.exporter, cfg.otlp_endpoint) == (("otlp",), "http://collector:4317")


def test_the_traces_explicit_settings_are_shared(clean_env) -> None:
    clean_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://from-env:4317")
    base = TracingConfig.from_env(otlp_endpoint="http://flag:4318", otlp_protocol="http",
                                  otlp_headers={"X-Flag": "1"})  # fmt: skip
    cfg = MetricsConfig.from_env(base)
    assert (cfg.otlp_endpoint, cfg.otlp_protocol) == ("http://flag:4318", "http")
    assert cfg.otlp_headers == {"x-flag": "1"}
    assert otlp_metrics_url(cfg) == "http://flag:4318/v1/metrics"


def test_metrics_exporter_variable(clean_env) -> None:
    base = TracingConfig(exporter="otlp", otlp_endpoint="http://collector:4317")
    assert MetricsConfig.from_env(base).exporter == ("otlp",)
    assert MetricsConfig.from_env(None).exporter == ("none",)  # no endpoint: nothing sent
    clean_env.setenv("OTEL_METRICS_EXPORTER", "none")
    assert MetricsConfig.from_env(base).exporter == ("none",)
    assert MetricsConfig.from_env(base, exporter="console").exporter == ("console",)
    clean_env.setenv("OTEL_METRICS_EXPORTER", "Console, otlp")
    cfg = MetricsConfig.from_env(None)
    assert cfg.exporter == ("console", "otlp") and cfg.otlp_endpoint == "http://localhost:4317"
    clean_env.setenv("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "http/protobuf")
    assert MetricsConfig.from_env(None).otlp_endpoint == "http://localhost:4318"


def test_metric_interval_and_timeouts_in_milliseconds(clean_env) -> None:
    clean_env.setenv("OTEL_METRIC_EXPORT_INTERVAL", "500")
    clean_env.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "300")
    cfg = MetricsConfig.from_env(None)
    assert (cfg.export_interval_s, cfg.export_timeout_s) == (0.5, 0.3)
    clean_env.setenv("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "900")
    assert MetricsConfig.from_env(None).export_timeout_s == 0.9  # per-signal wins
    clean_env.setenv("OTEL_METRIC_EXPORT_TIMEOUT", "250")
    assert MetricsConfig.from_env(None).export_timeout_s == 0.25  # within both bounds
    cfg = MetricsConfig.from_env(None, export_interval_s=2.0, export_timeout_s=1.0)
    assert (cfg.export_interval_s, cfg.export_timeout_s) == (2.0, 1.0)


def test_sdk_disabled_wins_over_explicit_metrics_exporters(clean_env) -> None:
    clean_env.setenv("OTEL_SDK_DISABLED", "TRUE")
    cfg = MetricsConfig.from_env(None, exporter="otlp", otlp_endpoint="http://collector:4317")
    assert cfg.exporter == ("none",)


MALFORMED = [
    ("OTEL_METRICS_EXPORTER", "prometheus", "exporter", ("none",)),
    ("OTEL_METRIC_EXPORT_INTERVAL", "soon", "export_interval_s", 60.0),
    ("OTEL_METRIC_EXPORT_TIMEOUT", "-5", "export_timeout_s", 2.0),
    ("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "1.5s", "export_timeout_s", 2.0),
    ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "localhost:4317", "otlp_endpoint", None),
    ("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "thrift", "otlp_protocol", "grpc"),
    ("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "http/json", "otlp_protocol", "http"),
    ("OTEL_EXPORTER_OTLP_METRICS_HEADERS", "novalue", "otlp_headers", {}),
    ("OTEL_SDK_DISABLED", "1", "exporter", ("otlp",)),
]


@pytest.mark.parametrize(("variable", "value", "field", "default"), MALFORMED)
def test_malformed_metrics_variables_warn_once_and_fall_back(
    clean_env, caplog, variable, value, field, default
) -> None:
    clean_env.setenv(variable, value)
    base = None
    if variable == "OTEL_SDK_DISABLED":
        base = TracingConfig(otlp_endpoint="http://collector:4317")
    cfg = read_warns_once(caplog, variable, value, lambda: MetricsConfig.from_env(base))
    assert getattr(cfg, field) == default


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"exporter": "prometheus"}, "'prometheus'"),
        ({"exporter": "otlp"}, "needs an endpoint"),
        ({"otlp_endpoint": "localhost:4317"}, "'localhost:4317'"),
        ({"otlp_protocol": "http/json"}, "'http/json'"),
        ({"otlp_headers": "novalue"}, "'novalue'"),
        ({"export_interval_s": 0}, "export_interval_s"),
        ({"export_timeout_s": "soon"}, "'soon'"),
        ({"namespace": 3}, "namespace"),
        ({"interval": 1.0}, "interval"),
    ],
)
def test_bad_explicit_metrics_arguments_raise_one_line(clean_env, kwargs, needle) -> None:
    with pytest.raises(TracingConfigError) as info:
        MetricsConfig.from_env(None, **kwargs)
    message = str(info.value)
    assert needle in message and "\n" not in message


def test_metrics_share_the_traces_resource(clean_env, grpc_receiver) -> None:
    tracing_cfg = TracingConfig(
        exporter="otlp",
        otlp_endpoint=grpc_receiver.endpoint,
        run_id="run-3",
        rank=2,
        attribute_namespace="app",
    )
    telemetry = tracing.setup(tracing_cfg)
    with tracing.phase("work", level="step"):
        pass
    assert telemetry.shutdown(timeout_s=5.0).clean
    _export_one(MetricsConfig.from_env(tracing_cfg, export_interval_s=3600), tracing_cfg)
    traces, metrics = grpc_receiver.requests[:2]
    assert traces.span_names == ["work"] and metrics.metric_names == ["depth"]
    assert traces.resource == metrics.resource
    assert 'string_value: "run-3"' in metrics.resource["app.run.id"]
    assert tracing_cfg.service_instance_id in metrics.resource["service.instance.id"]
