"""The OTEL_* variables, read by the SDK itself (one test each, named in
docs/observability.md), against real OTLP receivers where a request shows it; what
tracing reads (whether to export, which protocol) as the specification says."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from env_checks import warns_once
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import tracing
from tracing import TracingConfig, TracingConfigError
from tracing.export import batch_settings
from tracing.telemetry import build_resource

AUTH = "Authorization=Basic%20dXNlcjpwYXNz"
REPO = Path(__file__).resolve().parents[2]


def _export_one(cfg: TracingConfig | None = None) -> tracing.ShutdownReport:
    telemetry = tracing.setup(cfg or TracingConfig())
    with tracing.phase("work", level="step"):
        pass
    return telemetry.shutdown(timeout_s=5.0)


def test_an_endpoint_variable_alone_exports_http_protobuf_with_its_headers(
    clean_env, http_receiver
):
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", http_receiver.endpoint)
    clean_env.setenv("OTEL_EXPORTER_OTLP_HEADERS", f"{AUTH}, X-Team = ml")
    report = _export_one()  # no protocol named: http/protobuf, the specification's default
    assert report.spans_exported == 1 and report.clean
    (request,) = http_receiver.requests
    assert request.path == "/v1/traces" and request.span_names == ["work"]
    assert request.headers["authorization"] == "Basic dXNlcjpwYXNz"
    assert request.headers["x-team"] == "ml"


def test_the_traces_variables_win_over_the_generic_ones(clean_env, http_receiver) -> None:
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    clean_env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", http_receiver.endpoint + "/in/traces")
    clean_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    clean_env.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    clean_env.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "x-signal=traces")
    assert _export_one().spans_exported == 1
    (request,) = http_receiver.requests
    assert request.path == "/in/traces" and request.headers["x-signal"] == "traces"


def test_headers_reach_a_grpc_receiver_as_metadata(clean_env, grpc_receiver) -> None:
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", grpc_receiver.endpoint)
    clean_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    clean_env.setenv("OTEL_EXPORTER_OTLP_HEADERS", AUTH)
    assert _export_one().spans_exported == 1
    (request,) = grpc_receiver.requests
    assert request.headers["authorization"] == "Basic dXNlcjpwYXNz"


def test_the_flags_win_over_the_variables(clean_env, grpc_receiver) -> None:
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    clean_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    cfg = TracingConfig(otlp_endpoint=grpc_receiver.endpoint, otlp_protocol="grpc")
    assert _export_one(cfg).spans_exported == 1 and len(grpc_receiver.requests) == 1


@pytest.mark.parametrize(
    ("variables", "exporters"),
    [
        ({"OTEL_TRACES_EXPORTER": "otlp"}, ["OTLPSpanExporter"]),
        ({"OTEL_TRACES_EXPORTER": "console,none"}, ["ConsoleSpanExporter"]),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:4318"}, []),
        ({}, []),  # the specification's default is otlp: tracing sends nothing unasked
    ],
)
def test_traces_exporter_variable(clean_env, variables, exporters) -> None:
    for name, value in variables.items():
        clean_env.setenv(name, value)
    telemetry = tracing.setup(TracingConfig())
    try:
        assert [type(e.inner).__name__ for e in telemetry.exporters] == exporters
        if exporters == ["OTLPSpanExporter"]:  # no protocol named: the HTTP one
            assert "http" in type(telemetry.exporters[0].inner).__module__
    finally:
        telemetry.shutdown(timeout_s=1.0)


def test_http_json_is_sent_as_http_protobuf_warned_once(clean_env, caplog) -> None:
    clean_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    clean_env.setenv("OTEL_TRACES_EXPORTER", "otlp")
    for _ in range(2):
        telemetry = warns_once(caplog, "OTEL_EXPORTER_OTLP_PROTOCOL", lambda: tracing.setup())
        assert telemetry.sinks[0].startswith("OTLP/http/protobuf")
        telemetry.shutdown(timeout_s=1.0)


@pytest.mark.parametrize("value", ["soon", "-1", "0"])
@pytest.mark.parametrize(
    "variable", ["OTEL_EXPORTER_OTLP_TIMEOUT", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"]
)
def test_an_unusable_timeout_is_one_line_naming_it_and_spans_still_arrive(
    clean_env, caplog, grpc_receiver, http_receiver, variable, value
) -> None:
    # The SDK's gRPC exporter raised on `soon` (no span exported); a timeout of -1 failed
    # every export at once, and nothing named the variable.
    clean_env.setenv(variable, value)
    for protocol, receiver in (("grpc", grpc_receiver), ("http/protobuf", http_receiver)):
        cfg = TracingConfig(otlp_endpoint=receiver.endpoint, otlp_protocol=protocol)
        telemetry = tracing.setup(cfg)
        with tracing.phase("work"):
            pass
        report = telemetry.shutdown(timeout_s=5.0)
        assert report.spans_exported == 1 and report.spans_failed == 0, (protocol, report)
    named = [r.getMessage() for r in caplog.records if f"{variable}={value!r}" in r.getMessage()]
    assert len(named) == 1 and "the SDK's default 10 s" in named[0], named
    assert not any(r.exc_info for r in caplog.records)


@pytest.mark.parametrize(
    ("variable", "value", "used"),
    [
        ("OTEL_BSP_SCHEDULE_DELAY", "0", "5000"),  # the SDK's processor raises on it
        ("OTEL_BSP_SCHEDULE_DELAY", "abc", "5000"),  # the SDK logged a traceback
        ("OTEL_BSP_MAX_QUEUE_SIZE", "-3", "2048"),
        ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "1.5", "512"),
        ("OTEL_BSP_EXPORT_TIMEOUT", "soon", "30000"),
    ],
)
def test_batch_variables_the_sdk_refuses_are_one_line_and_its_default(
    clean_env, caplog, variable, value, used
) -> None:
    clean_env.setenv(variable, value)
    memory = InMemorySpanExporter()
    with caplog.at_level(logging.DEBUG):
        telemetry = tracing.setup(exporters=[memory])
    with tracing.phase("now"):
        pass
    assert telemetry.shutdown(timeout_s=2.0).spans_exported == 1
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert lines == [
        f"tracing: ignoring {variable}={value!r} (not a whole number above 0); using {used}"
    ]
    assert not any(r.exc_info for r in caplog.records)  # no traceback


def test_a_batch_larger_than_the_queue_is_the_queue(clean_env, caplog) -> None:
    clean_env.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "100")
    assert batch_settings()["OTEL_BSP_MAX_EXPORT_BATCH_SIZE"] == 100  # the default 512: quiet
    clean_env.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "300")
    settings = warns_once(caplog, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE=300", batch_settings)
    assert settings["OTEL_BSP_MAX_EXPORT_BATCH_SIZE"] == 100


@pytest.mark.parametrize(
    ("variables", "flags", "expected"),
    [
        ({}, {}, "unknown_service"),  # then ":<executable>" from SDK 1.4x on
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
def test_service_name_precedence(clean_env, variables, flags, expected) -> None:
    for name, value in variables.items():
        clean_env.setenv(name, value)
    attributes = build_resource(TracingConfig(**flags)).attributes
    assert attributes["service.name"].startswith(expected)
    assert attributes["telemetry.sdk.language"] == "python"
    assert attributes["telemetry.sdk.name"] == "opentelemetry"


def test_resource_attributes_and_the_applications_own(clean_env) -> None:
    clean_env.setenv("OTEL_RESOURCE_ATTRIBUTES", "team=ml%2Cinfra,service.version=9")
    cfg = TracingConfig(run_id="run-7", attribute_namespace="app", rank=1, service_version="1.0")
    attributes = build_resource(cfg).attributes
    assert attributes["team"] == "ml,infra" and attributes["service.version"] == "9"
    assert attributes["app.run.id"] == "run-7" and attributes["app.rank"] == 1
    clean_env.delenv("OTEL_RESOURCE_ATTRIBUTES")
    again = build_resource(cfg).attributes
    assert again["service.version"] == "1.0"
    # One instance id per process, for every signal (the two-rank test: one per rank).
    assert len(again["service.instance.id"]) == 36
    assert again["service.instance.id"] == attributes["service.instance.id"]
    clean_env.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.instance.id=pod-3")
    assert build_resource(cfg).attributes["service.instance.id"] == "pod-3"


def test_resource_detectors_are_the_sdks(clean_env) -> None:
    clean_env.setenv("OTEL_EXPERIMENTAL_RESOURCE_DETECTORS", "otel,process")
    assert build_resource(TracingConfig()).attributes["process.pid"] == os.getpid()


def test_the_resource_says_where_the_rank_ran(clean_env) -> None:
    cfg = TracingConfig(
        attribute_namespace="app",
        rank=3,
        world_size=4,
        local_rank=1,
        node_rank=1,
        device_model="NVIDIA H200",
        config_hash="0123abcd",
    )
    attributes = build_resource(cfg).attributes
    assert attributes["host.name"] == socket.gethostname()
    assert attributes["process.pid"] == os.getpid() and attributes["os.type"]
    assert attributes["process.runtime.name"] and attributes["telemetry.sdk.version"]
    placement = {key: attributes[f"app.{key}"] for key in ("world_size", "local_rank")}
    assert placement == {"world_size": 4, "local_rank": 1}
    assert attributes["app.node.rank"] == 1 and attributes["app.device.model"] == "NVIDIA H200"
    assert attributes["app.config.hash"] == "0123abcd"
    # Not given, not there (a single process says nothing of nodes); the variables win
    # over the detectors, the application's own keys over the variables.
    clean_env.setenv("OTEL_RESOURCE_ATTRIBUTES", "host.name=node-7,app.world_size=9")
    attributes = build_resource(TracingConfig(attribute_namespace="app", world_size=2)).attributes
    assert attributes["host.name"] == "node-7" and attributes["app.world_size"] == 2
    assert "app.node.rank" not in attributes and "app.device.model" not in attributes


@pytest.mark.parametrize("field", ["world_size", "local_rank", "node_rank"])
def test_placement_fields_are_checked(field) -> None:
    with pytest.raises(TracingConfigError, match=field):
        TracingConfig(**{field: -1})


def test_an_applications_provider_keeps_its_resource(clean_env) -> None:
    provider = TracerProvider(resource=Resource({"service.name": "theirs"}))
    telemetry = tracing.setup(TracingConfig(world_size=2), provider=provider)
    assert dict(telemetry.resource.attributes) == {"service.name": "theirs"}
    telemetry.shutdown(timeout_s=1.0)


def test_the_sampler_variables_are_the_sdks(clean_env, caplog) -> None:
    clean_env.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    clean_env.setenv("OTEL_TRACES_SAMPLER_ARG", "0")
    memory = InMemorySpanExporter()
    telemetry = tracing.setup(exporters=[memory])
    for _ in range(20):
        with tracing.phase("step"):
            pass
    telemetry.shutdown(timeout_s=2.0)
    assert memory.get_finished_spans() == () and telemetry.stats.get("step").count == 20
    clean_env.setenv("OTEL_TRACES_SAMPLER", "sometimes")  # the SDK warns, samples everything
    telemetry = tracing.setup(exporters=[InMemorySpanExporter()])
    with tracing.phase("step"):
        pass
    assert telemetry.shutdown(timeout_s=2.0).spans_exported == 1


DISABLED = """
import sys; sys.path.insert(0, {repo!r})
import tracing
telemetry = tracing.setup(tracing.TracingConfig(otlp_endpoint="http://127.0.0.1:9"))
with tracing.phase("work"):
    pass
print(telemetry.tracing_spans, telemetry.stats.get("work").count)
"""


def test_sdk_disabled_records_no_span_and_the_tables_still_count() -> None:
    env = {**os.environ, "OTEL_SDK_DISABLED": "true"}
    code = textwrap.dedent(DISABLED).format(repo=str(REPO))
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.split() == ["False", "1"]


def test_no_warning_without_variables(clean_env, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        tracing.setup().shutdown(timeout_s=1.0)
    assert not caplog.records
