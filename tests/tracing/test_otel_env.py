"""The OTEL_* variables, parsed and ranked as the specification says (one test each,
named in docs/observability.md), against real OTLP receivers where a request shows it."""

from __future__ import annotations

import time

import pytest
from env_checks import read_warns_once
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import tracing
from tracing import TracingConfig, TracingConfigError

AUTH = "Authorization=Basic%20dXNlcjpwYXNz"


def _export_one(cfg: TracingConfig) -> tracing.ShutdownReport:
    telemetry = tracing.setup(cfg)
    with tracing.phase("work", level="step"):
        pass
    return telemetry.shutdown(timeout_s=5.0)


def test_headers_reach_an_http_receiver_decoded(clean_env, http_receiver) -> None:
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", http_receiver.endpoint)
    clean_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    clean_env.setenv("OTEL_EXPORTER_OTLP_HEADERS", f"{AUTH}, X-Team = ml ,x-both=generic")
    clean_env.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "x-both=traces")
    report = _export_one(TracingConfig.from_env())
    assert report.spans_exported == 1 and report.clean
    (request,) = http_receiver.requests
    assert request.path == "/v1/traces" and request.span_names == ["work"]
    assert request.headers["authorization"] == "Basic dXNlcjpwYXNz"
    assert request.headers["x-team"] == "ml"
    assert request.headers["x-both"] == "traces"  # the per-signal entry wins, others merge


def test_headers_reach_a_grpc_receiver_as_metadata(clean_env, grpc_receiver) -> None:
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", grpc_receiver.endpoint)
    clean_env.setenv("OTEL_EXPORTER_OTLP_HEADERS", AUTH)
    report = _export_one(TracingConfig.from_env())
    assert report.spans_exported == 1 and report.clean
    (request,) = grpc_receiver.requests
    assert request.headers["authorization"] == "Basic dXNlcjpwYXNz"


def test_explicit_headers_override_the_variable(clean_env) -> None:
    clean_env.setenv("OTEL_EXPORTER_OTLP_HEADERS", "a=env,b=env")
    cfg = TracingConfig.from_env(otlp_headers={"B": "flag"})
    assert cfg.otlp_headers == {"a": "env", "b": "flag"}


def test_traces_endpoint_alone_is_used_as_is(clean_env, http_receiver) -> None:
    clean_env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", http_receiver.endpoint + "/in/traces")
    clean_env.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    clean_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")  # the per-signal one wins
    cfg = TracingConfig.from_env()
    assert cfg.exporter == ("otlp",) and cfg.otlp_protocol == "http"
    assert _export_one(cfg).spans_exported == 1
    assert [r.path for r in http_receiver.requests] == ["/in/traces"]


def test_traces_endpoint_wins_over_the_generic_one(clean_env) -> None:
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://generic:4317")
    clean_env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:4317")
    assert TracingConfig.from_env().otlp_endpoint == "http://traces:4317"
    flag = TracingConfig.from_env(otlp_endpoint="http://flag:4317")
    assert flag.otlp_endpoint == "http://flag:4317" and not flag.otlp_endpoint_is_traces_url


def test_traces_exporter_otlp_alone_uses_the_default_endpoint(clean_env) -> None:
    clean_env.setenv("OTEL_TRACES_EXPORTER", "otlp")
    assert TracingConfig.from_env().otlp_endpoint == "http://localhost:4317"
    clean_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    assert TracingConfig.from_env().otlp_endpoint == "http://localhost:4318"


def test_timeouts_in_milliseconds(clean_env) -> None:
    clean_env.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1500")
    assert TracingConfig.from_env().export_timeout_s == 1.5
    clean_env.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "700")
    assert TracingConfig.from_env().export_timeout_s == 0.7
    clean_env.setenv("OTEL_BSP_EXPORT_TIMEOUT", "300")  # an export must end within both
    assert TracingConfig.from_env().export_timeout_s == 0.3
    assert TracingConfig.from_env(export_timeout_s=9.0).export_timeout_s == 9.0


def test_batch_processor_variables(clean_env) -> None:
    clean_env.setenv("OTEL_BSP_SCHEDULE_DELAY", "250")
    clean_env.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "100")
    clean_env.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "10")
    cfg = TracingConfig.from_env()
    assert (cfg.schedule_delay_s, cfg.max_queue_size, cfg.max_export_batch_size) == (
        0.25,
        100,
        10,
    )


def test_sdk_disabled_wins_over_explicit_exporters(clean_env) -> None:
    clean_env.setenv("OTEL_SDK_DISABLED", "TRUE")
    cfg = TracingConfig.from_env(exporter="otlp", otlp_endpoint="http://h:4317", level="phase")
    assert cfg.exporter == ("none",) and cfg.level == "off"
    clean_env.setenv("OTEL_SDK_DISABLED", "false")
    assert TracingConfig.from_env(exporter="console").exporter == ("console",)


def test_resource_attributes_are_percent_decoded(clean_env) -> None:
    clean_env.setenv("OTEL_RESOURCE_ATTRIBUTES", "team=ml%2Cinfra, note=a%20b%3Dc,k%20x=v")
    cfg = TracingConfig.from_env()
    assert cfg.resource_attributes == {"team": "ml,infra", "note": "a b=c", "k x": "v"}


@pytest.mark.parametrize(
    ("env", "kwargs", "expected"),
    [
        ({}, {}, "unknown_service:"),
        ({}, {"default_service_name": "app"}, "app"),
        ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=res"}, {"default_service_name": "app"}, "res"),
        (
            {"OTEL_RESOURCE_ATTRIBUTES": "service.name=res", "OTEL_SERVICE_NAME": "svc"},
            {"default_service_name": "app"},
            "svc",
        ),
        ({"OTEL_SERVICE_NAME": "svc"}, {"service_name": "flag"}, "flag"),
    ],
)
def test_service_name_precedence(clean_env, env, kwargs, expected) -> None:
    for name, value in env.items():
        clean_env.setenv(name, value)
    cfg = TracingConfig.from_env(**kwargs)
    assert cfg.service_name.startswith(expected)
    resource = tracing.telemetry.build_resource(cfg)
    assert resource.attributes["service.name"] == cfg.service_name
    assert resource.attributes["telemetry.sdk.language"] == "python"
    assert resource.attributes["telemetry.sdk.name"] == "opentelemetry"
    assert resource.attributes["telemetry.sdk.version"]


def test_instance_id_unique_and_run_id_from_the_application(clean_env) -> None:
    first = TracingConfig(run_id="run-7", attribute_namespace="app", rank=1)
    second = TracingConfig(run_id="run-7", attribute_namespace="app", rank=1)
    assert first.service_instance_id != second.service_instance_id
    attributes = tracing.telemetry.build_resource(first).attributes
    assert attributes["app.run.id"] == "run-7" and attributes["app.rank"] == 1
    assert attributes["service.instance.id"] == first.service_instance_id


MALFORMED = [
    ("OTEL_RESOURCE_ATTRIBUTES", "team=ml,broken", "resource_attributes", {}),
    ("OTEL_TRACES_SAMPLER", "sometimes", "sample_ratio", 1.0),
    ("OTEL_TRACES_SAMPLER_ARG", "half", "sample_ratio", 1.0),
    ("OTEL_EXPORTER_OTLP_TIMEOUT", "soon", "export_timeout_s", 2.0),
    ("OTEL_BSP_MAX_QUEUE_SIZE", "-3", "max_queue_size", 8192),
    ("OTEL_BSP_SCHEDULE_DELAY", "1.5s", "schedule_delay_s", 1.0),
    ("OTEL_EXPORTER_OTLP_PROTOCOL", "thrift", "otlp_protocol", "grpc"),
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "notaurl", "otlp_endpoint", None),
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "localhost:4317", "otlp_endpoint", None),
    ("OTEL_TRACES_EXPORTER", "zipkin", "exporter", ("none",)),
    ("OTEL_SDK_DISABLED", "yes", "level", "phase"),
    ("OTEL_EXPORTER_OTLP_HEADERS", "novalue", "otlp_headers", {}),
]


@pytest.mark.parametrize(
    "variable", ["OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"]
)
def test_http_json_is_sent_as_http_protobuf_not_grpc(clean_env, caplog, variable) -> None:
    """http/json means "the collector's HTTP port": protobuf goes there, never gRPC."""
    clean_env.setenv(variable, "http/json")
    clean_env.setenv("OTEL_TRACES_EXPORTER", "otlp")
    cfg = read_warns_once(caplog, variable, "http/json", TracingConfig.from_env)
    assert cfg.otlp_protocol == "http"
    assert cfg.otlp_endpoint == "http://localhost:4318"
    assert "http/protobuf" in caplog.text


@pytest.mark.parametrize(("variable", "value", "field", "default"), MALFORMED)
def test_malformed_variables_warn_once_and_fall_back(
    clean_env, caplog, variable, value, field, default
) -> None:
    clean_env.setenv(variable, value)
    if variable == "OTEL_TRACES_SAMPLER_ARG":
        clean_env.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    cfg = read_warns_once(caplog, variable, value, TracingConfig.from_env)
    assert getattr(cfg, field) == default


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"otlp_headers": "novalue"}, "'novalue'"),
        ({"resource_attributes": "a=1,b"}, "'b'"),
        ({"otlp_endpoint": "notaurl"}, "'notaurl'"),
        ({"otlp_endpoint": "localhost:4317"}, "'localhost:4317'"),
        ({"otlp_endpoint": "unix:///tmp/otlp.sock"}, "unix:///tmp/otlp.sock"),
        ({"otlp_endpoint": "http://"}, "'http://'"),
        ({"max_export_batch_size": 0}, "max_export_batch_size"),
    ],
)
def test_the_same_mistakes_in_arguments_raise_one_line(clean_env, kwargs, needle) -> None:
    with pytest.raises(TracingConfigError) as info:
        TracingConfig.from_env(**kwargs)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_a_schedule_delay_of_zero_exports_each_span_without_waiting(clean_env) -> None:
    """The specification's delay is non-negative: 0 means no span waits for a round."""
    clean_env.setenv("OTEL_BSP_SCHEDULE_DELAY", "0")
    cfg = TracingConfig.from_env()
    assert cfg.schedule_delay_s == 0.0
    exporter = InMemorySpanExporter()
    telemetry = tracing.setup(cfg, exporters=[exporter])
    try:
        with tracing.phase("now", level="step"):
            pass
        deadline = time.monotonic() + 5.0
        while not exporter.get_finished_spans() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [s.name for s in exporter.get_finished_spans()] == ["now"]
    finally:
        report = telemetry.shutdown(timeout_s=2.0)
    assert report.spans_exported == 1
    clean_env.setenv("OTEL_BSP_SCHEDULE_DELAY", "-5")
    assert TracingConfig.from_env().schedule_delay_s == 1.0  # bad: warned and ignored


def test_the_resource_holds_what_the_config_says_not_the_process_environment(clean_env) -> None:
    clean_env.setenv("OTEL_RESOURCE_ATTRIBUTES", "team=ml,broken")
    clean_env.setenv("OTEL_SERVICE_NAME", "from-env")
    for cfg in (TracingConfig(), TracingConfig.from_env(environ={})):
        attributes = tracing.telemetry.build_resource(cfg).attributes
        assert "team" not in attributes and attributes["service.name"] != "from-env"
        assert attributes["telemetry.sdk.name"] == "opentelemetry"
        assert attributes["telemetry.sdk.version"]
    # Read from the environment, the malformed variable is warned about and left out whole.
    attributes = tracing.telemetry.build_resource(TracingConfig.from_env()).attributes
    assert "team" not in attributes and attributes["service.name"] == "from-env"
