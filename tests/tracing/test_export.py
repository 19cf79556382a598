"""Export through the SDK's public interfaces: phases reach real OTLP receivers over gRPC
and HTTP through the SDK's own exporters and batch processor, in this process."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export import ConsoleSpanExporter

import tracing
from tracing.export import OtlpJsonFileExporter, build_exporters


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_phases_reach_a_real_receiver_through_the_sdk_exporter(request, clean_env, protocol):
    receiver = request.getfixturevalue(f"{protocol.partition('/')[0]}_receiver")
    cfg = tracing.TracingConfig(
        otlp_endpoint=receiver.endpoint, otlp_protocol=protocol, service_name="in-process"
    )
    telemetry = tracing.setup(cfg)
    exporter = telemetry.exporters[0].inner
    assert type(exporter).__module__.startswith("opentelemetry.exporter.otlp.proto")
    path = "" if protocol == "grpc" else "/v1/traces"
    assert telemetry.sinks == [f"OTLP/{protocol} {receiver.endpoint}{path}"]
    for i in range(50):
        with tracing.phase("work", level="step", attributes={"i": i}):
            pass
    report = telemetry.shutdown(timeout_s=10.0)
    assert report.spans_exported == 50 and report.clean
    names = [name for received in receiver.requests for name in received.span_names]
    assert names == ["work"] * 50
    assert receiver.requests[0].resource["service.name"] == 'string_value: "in-process"'
    if protocol != "grpc":
        assert {r.path for r in receiver.requests} == {"/v1/traces"}


def test_every_named_exporter_is_built_in_this_process(clean_env, tmp_path) -> None:
    cfg = tracing.TracingConfig(exporter="console", trace_file=str(tmp_path / "t"))
    exporters, sinks = build_exporters(cfg)
    assert [type(e) for e in exporters] == [ConsoleSpanExporter, OtlpJsonFileExporter]
    assert sinks == ["console", f"file {tmp_path / 't'}"]
    for exporter in exporters:
        exporter.shutdown()
