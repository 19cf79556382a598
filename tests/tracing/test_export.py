"""Export on the SDK's public exporter interface: phases reach real OTLP receivers over
gRPC and HTTP through the SDK's own exporters, in this process."""

from __future__ import annotations

import pytest

import tracing
from tracing.export.exporters import build_exporters


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_phases_reach_a_real_receiver_through_the_sdk_exporter(request, protocol) -> None:
    receiver = request.getfixturevalue(f"{protocol}_receiver")
    cfg = tracing.TracingConfig(
        exporter="otlp",
        otlp_endpoint=receiver.endpoint,
        otlp_protocol=protocol,
        service_name="in-process",
    )
    telemetry = tracing.setup(cfg)
    exporter = telemetry.processors[0].exporter
    assert type(exporter).__module__.startswith("opentelemetry.exporter.otlp.proto")
    for i in range(50):
        with tracing.phase("work", level="step", attributes={"i": i}):
            pass
    report = telemetry.shutdown(timeout_s=10.0)
    assert report.spans_exported == 50 and report.clean
    names = [name for received in receiver.requests for name in received.span_names]
    assert names == ["work"] * 50
    assert receiver.requests[0].resource["service.name"] == 'string_value: "in-process"'


def test_every_named_exporter_is_built_in_this_process(tmp_path) -> None:
    cfg = tracing.TracingConfig(exporter=("file", "console"), trace_file=str(tmp_path / "t"))
    exporters = build_exporters(cfg)
    assert [type(e).__name__ for e in exporters] == [
        "OtlpJsonFileExporter",
        "ConsoleSpanExporter",
    ]
    for exporter in exporters:
        exporter.shutdown()
