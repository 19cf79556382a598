"""The SDK-free recording path: spans built on the export thread must equal what the SDK
would have made (sampling, ids, parents, resource, scope, status, events)."""

from __future__ import annotations

import random
import threading

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanContext, SpanKind, StatusCode, TraceFlags

import tracing
from tracing.record import Recorder


@pytest.mark.parametrize("ratio", [0.0, 0.1, 0.5, 1.0])
def test_root_sampling_matches_the_sdk_sampler(ratio):
    recorder = Recorder(ratio, Resource({}))
    sdk = ParentBased(TraceIdRatioBased(ratio))
    rng = random.Random(7)
    for _ in range(2000):
        trace_id = rng.getrandbits(128) or 1
        expected = sdk.should_sample(None, trace_id, "x").decision.is_sampled()
        assert recorder.root_sampled(trace_id) is expected


def _batch_exported(**cfg: object) -> tuple[tracing.Telemetry, InMemorySpanExporter]:
    """Tracing whose spans take the production path: bounded batch processor, export thread."""
    exporter = InMemorySpanExporter()
    telemetry = tracing.setup(tracing.TracingConfig(**cfg), exporters=[exporter])  # type: ignore[arg-type]
    return telemetry, exporter


def test_batch_path_builds_the_sdk_spans():
    telemetry, exporter = _batch_exported(service_name="svc", rank=3)
    try:
        root = tracing.start_span("batch", {"batch.id": 1})
        with tracing.phase("drafter.step", parent=root, attributes={"step": 2}) as step:
            step.set_attribute("tokens", 64)
            with pytest.raises(KeyError):
                with tracing.phase("drafter.loss", start_time_ns=step.start_time_ns + 1):
                    raise KeyError("k")
        ender = threading.Thread(target=root.end)
        ender.start()
        ender.join()
        assert telemetry.force_flush(5.0)
        spans = {s.name: s for s in exporter.get_finished_spans()}
    finally:
        report = telemetry.shutdown(timeout_s=2.0)
    assert report.spans_exported == 3 and report.clean
    batch, step_span, loss = spans["batch"], spans["drafter.step"], spans["drafter.loss"]
    assert batch.parent is None and batch.kind is SpanKind.INTERNAL
    assert step_span.parent.span_id == batch.context.span_id
    assert loss.parent.span_id == step_span.context.span_id
    assert {s.context.trace_id for s in spans.values()} == {batch.context.trace_id}
    assert all(s.context.trace_flags.sampled for s in spans.values())
    assert dict(step_span.attributes) == {"step": 2, "tokens": 64}
    assert dict(batch.attributes) == {"batch.id": 1}
    assert loss.start_time == step_span.start_time + 1 and loss.end_time >= loss.start_time
    assert loss.status.status_code is StatusCode.ERROR and "KeyError" in loss.status.description
    assert loss.events[0].name == "exception"
    assert loss.events[0].attributes["exception.type"] == "KeyError"
    assert "Traceback" in loss.events[0].attributes["exception.stacktrace"]
    assert batch.resource.attributes["service.name"] == "svc"
    assert batch.resource.attributes["tracing.rank"] == 3
    assert batch.instrumentation_scope.name == "tracing"


def test_parent_from_another_tracer_and_from_a_remote_context(memory):
    telemetry = tracing.setup(
        tracing.TracingConfig(), span_processors=[SimpleSpanProcessor(memory)]
    )
    other = TracerProvider().get_tracer("other")
    with other.start_as_current_span("outside") as outside:
        with tracing.phase("implicit"):  # no parent, no current phase: the OTel current span
            pass
    with tracing.phase("explicit", parent=trace.set_span_in_context(outside)):
        pass
    remote = SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=TraceFlags(1))
    with tracing.phase("remote", parent=trace.set_span_in_context(trace.NonRecordingSpan(remote))):
        pass
    unsampled = SpanContext(0xABD, 0xDEF, is_remote=True, trace_flags=TraceFlags(0))
    ctx = trace.set_span_in_context(trace.NonRecordingSpan(unsampled))
    with tracing.phase("unsampled", parent=ctx) as p:
        assert not p.recording and p.span_context.trace_id == 0xABD
    spans = {s.name: s for s in memory.get_finished_spans()}
    outside_ctx = outside.get_span_context()
    for name in ("implicit", "explicit"):
        assert spans[name].context.trace_id == outside_ctx.trace_id
        assert spans[name].parent.span_id == outside_ctx.span_id
    assert spans["remote"].context.trace_id == 0xABC
    assert spans["remote"].parent.span_id == 0xDEF and spans["remote"].parent.is_remote
    assert "unsampled" not in spans  # parent-based: the remote decision holds
    assert telemetry.stats.get("unsampled").count == 1  # ...but the tables see it


def test_handle_context_is_a_valid_otel_parent(memory):
    tracing.setup(tracing.TracingConfig(), span_processors=[SimpleSpanProcessor(memory)])
    root = tracing.start_span("batch")
    span_context = trace.get_current_span(root.context).get_span_context()
    assert span_context.is_valid and span_context.trace_id == root.trace_id
    token = otel_context.attach(root.context)
    try:
        with tracing.phase("attached"):  # parented through the attached OTel context
            pass
        child = TracerProvider().get_tracer("other").start_span("sdk.child")
        child.end()
    finally:
        otel_context.detach(token)
    root.end()
    spans = {s.name: s for s in memory.get_finished_spans()}
    assert spans["attached"].parent.span_id == root.span_id
    assert child.parent.span_id == root.span_id and child.context.trace_id == root.trace_id


def test_sampling_ratio_zero_records_nothing_but_counts_everything():
    telemetry, exporter = _batch_exported(sample_ratio=0.0)
    try:
        for _ in range(50):
            root = tracing.start_span("batch")
            with tracing.phase("drafter.step", parent=root) as p:
                p.set_attribute("ignored", 1)
            root.end()
        telemetry.force_flush(2.0)
        assert exporter.get_finished_spans() == ()
        assert telemetry.stats.get("drafter.step").count == 50
    finally:
        assert telemetry.shutdown(timeout_s=2.0).spans_exported == 0


def test_full_queue_drops_and_counts():
    telemetry, exporter = _batch_exported(max_queue_size=10, schedule_delay_s=60.0)
    try:
        for _ in range(25):
            with tracing.phase("work"):
                pass
        counts = telemetry.delivery_counts()
        assert counts.dropped == 15 and counts.pending == 10
    finally:
        report = telemetry.shutdown(timeout_s=2.0)
    assert report.spans_exported == 10 and report.spans_dropped == 15
    assert len(exporter.get_finished_spans()) == 10
