"""The real Jaeger accepts what the plain OpenTelemetry SDK exports, as dflash-train will.

These tests pin the receiving side independently of the trainer: OTLP over gRPC and
HTTP into docker/jaeger/config.yaml, the query API answering with the whole batch tree,
and an OTLP/JSON file (one ExportTraceServiceRequest per line) accepted by Jaeger's
OTLP-to-Jaeger transform endpoint.
"""

from __future__ import annotations

import base64
import copy
import json
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import pytest
import requests
from conftest import JaegerProcess
from google.protobuf.json_format import MessageToDict
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
    OTLPSpanExporter as GrpcSpanExporter,
)
from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
    OTLPSpanExporter as HttpSpanExporter,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from spantree import (
    PARENT_OF,
    PHASES,
    batch_tree_problems,
    merge_otlp_json_lines,
    parent_span,
    root_of,
    service_of,
    tags,
)

NUM_BATCHES = 3


def unique_service(prefix: str) -> str:
    # The session's Jaeger is shared: one service name per test keeps results apart.
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def provider_for(service: str, exporter: SpanExporter, batch: bool = True) -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
    provider.add_span_processor(processor)
    return provider


def emit_batch(tracer: trace.Tracer, step: int) -> None:
    """One batch trace shaped like dflash-train's (docs/design.md §5), wait spans included."""
    waited_since_ns = time.time_ns()
    with tracer.start_as_current_span(
        "batch", attributes={"step": step, "batch.id": 100 + step, "tokens": 512}
    ):
        with tracer.start_as_current_span("data.batch"):  # the prefetcher builds the batch
            pass
        # The wait span is created after the batch arrived, with the wait's start.
        tracer.start_span("batch_queue.wait", start_time=waited_since_ns).end()
        with tracer.start_as_current_span("target.forward", attributes={"device": "cpu"}):
            pass
        tracer.start_span("hs_queue.wait", start_time=time.time_ns()).end()
        with tracer.start_as_current_span("drafter.step", attributes={"device": "cpu"}):
            for name, parent in PARENT_OF.items():
                if parent == "drafter.step":
                    with tracer.start_as_current_span(name):
                        pass


def emit_batches(provider: TracerProvider, count: int = NUM_BATCHES) -> None:
    tracer = provider.get_tracer("tests.integration")
    for step in range(count):
        emit_batch(tracer, step)
    assert provider.force_flush(10_000), "exporter did not flush within 10 s"
    provider.shutdown()


def complete_traces(jaeger: JaegerProcess, service: str, count: int) -> list[dict]:
    return jaeger.wait_for(
        lambda: jaeger.traces(service),
        lambda found: len(found) == count and all(len(t["spans"]) == len(PHASES) for t in found),
    )


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_sdk_export_arrives_as_whole_batch_trees(jaeger: JaegerProcess, protocol: str) -> None:
    service = unique_service(f"sdk-{protocol}")
    if protocol == "grpc":
        exporter: SpanExporter = GrpcSpanExporter(endpoint=jaeger.otlp_grpc_endpoint, insecure=True)
    else:
        exporter = HttpSpanExporter(endpoint=f"{jaeger.otlp_http_endpoint}/v1/traces")
    emit_batches(provider_for(service, exporter))

    assert service in jaeger.wait_for(jaeger.services, lambda found: service in found)
    operations = jaeger.wait_for(
        lambda: jaeger.operations(service), lambda found: set(PHASES) <= set(found)
    )
    assert sorted(operations) == sorted(PHASES)
    traces = complete_traces(jaeger, service, NUM_BATCHES)
    for found in traces:
        assert batch_tree_problems(found) == []
        root = root_of(found)
        assert service_of(found, root) == service
    steps = sorted(tags(root_of(t))["step"] for t in traces)
    assert steps == list(range(NUM_BATCHES))


def test_tree_check_reports_a_wrong_parent(jaeger: JaegerProcess) -> None:
    """The tree check itself can fail: re-parent one span of a real trace."""
    service = unique_service("sdk-check")
    emit_batches(
        provider_for(service, GrpcSpanExporter(endpoint=jaeger.otlp_grpc_endpoint, insecure=True)),
        1,
    )
    (found,) = complete_traces(jaeger, service, 1)
    assert batch_tree_problems(found) == []

    broken = copy.deepcopy(found)
    by_name = {s["operationName"]: s for s in broken["spans"]}
    by_name["drafter.loss"]["references"][0]["spanID"] = by_name["batch"]["spanID"]
    assert batch_tree_problems(broken) == ["drafter.loss: parent batch, expected drafter.step"]
    broken["spans"].remove(by_name["hs_queue.wait"])
    assert "hs_queue.wait: 0 spans, expected 1" in batch_tree_problems(broken)
    assert parent_span(broken, by_name["batch"]) is None


def otlp_json_lines(spans: Sequence[ReadableSpan], ids_in_hex: bool = True) -> list[str]:
    """Reference writer of the trace-file format: one OTLP/JSON request per export call.

    Protobuf's JSON mapping renders bytes as base64; the OTLP/JSON spec wants trace and
    span ids in hex, which is what Jaeger (and every OTLP/JSON reader) expects.
    """
    lines = []
    for chunk in (spans[: len(spans) // 2], spans[len(spans) // 2 :]):
        message = MessageToDict(encode_spans(chunk))
        if ids_in_hex:
            for resource_spans in message["resourceSpans"]:
                for scope_spans in resource_spans["scopeSpans"]:
                    for span in scope_spans["spans"]:
                        for key in ("traceId", "spanId", "parentSpanId"):
                            if key in span:
                                span[key] = base64.b64decode(span[key]).hex()
        lines.append(json.dumps(message))
    return lines


def recorded_spans(service: str) -> tuple[ReadableSpan, ...]:
    memory = InMemorySpanExporter()
    emit_batches(provider_for(service, memory, batch=False), NUM_BATCHES)
    return memory.get_finished_spans()


def test_otlp_json_file_is_accepted_by_transform_endpoint(
    jaeger: JaegerProcess, tmp_path: Path
) -> None:
    service = unique_service("file")
    spans = recorded_spans(service)
    trace_file = tmp_path / "traces.otlp.jsonl"
    trace_file.write_text("\n".join(otlp_json_lines(spans)) + "\n")

    traces = jaeger.transform(merge_otlp_json_lines(trace_file))

    assert len(traces) == NUM_BATCHES
    for found in traces:
        assert batch_tree_problems(found) == []
        assert service_of(found, root_of(found)) == service
    expected_ids = {format(s.context.trace_id, "032x") for s in spans}
    assert {t["traceID"] for t in traces} == expected_ids


def test_transform_endpoint_needs_hex_ids(jaeger: JaegerProcess, tmp_path: Path) -> None:
    """Protobuf's default JSON (base64 ids) is not OTLP/JSON: Jaeger refuses the file."""
    spans = recorded_spans(unique_service("file-b64"))
    trace_file = tmp_path / "traces.b64.jsonl"
    trace_file.write_text("\n".join(otlp_json_lines(spans, ids_in_hex=False)) + "\n")

    with pytest.raises(requests.HTTPError) as raised:
        jaeger.transform(merge_otlp_json_lines(trace_file))
    assert raised.value.response.status_code == 400
    assert "cannot unmarshal OTLP" in raised.value.response.text


def test_restart_on_same_ports_receives_again(own_jaeger: JaegerProcess) -> None:
    """stop()/start() keep the endpoints, so an exporter configured once reconnects."""
    service = unique_service("restart")
    endpoint = own_jaeger.otlp_grpc_endpoint
    emit_batches(provider_for(service, GrpcSpanExporter(endpoint=endpoint, insecure=True)), 1)
    complete_traces(own_jaeger, service, 1)

    own_jaeger.stop()
    assert not own_jaeger.running
    own_jaeger.start()

    assert own_jaeger.otlp_grpc_endpoint == endpoint
    assert own_jaeger.traces(service) == []  # memory storage starts empty
    emit_batches(provider_for(service, GrpcSpanExporter(endpoint=endpoint, insecure=True)), 1)
    (found,) = complete_traces(own_jaeger, service, 1)
    assert batch_tree_problems(found) == []
