"""The fast path against its reference, the SDK's Tracer: the same phases recorded both
ways export the same spans (names, parents, ids' relations, attributes, status, events,
resource, scope, times), sampled alike."""

from __future__ import annotations

import threading

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanContext, TraceFlags

import tracing
from tracing.fast import FastTracer

PATHS = ["fast", "sdk"]


def _setup(path: str, memory: InMemorySpanExporter, **cfg: object) -> tracing.Telemetry:
    config = tracing.TracingConfig(**cfg)  # type: ignore[arg-type]
    if path == "fast":
        telemetry = tracing.setup(config, exporters=[memory])
        assert isinstance(tracing.spans.runtime().tracer, FastTracer)
        return telemetry
    return tracing.setup(config, span_processors=[SimpleSpanProcessor(memory)])


def _program() -> None:
    """A batch as the pipeline makes one, with an error, a late attribute, a wait that
    began before its parent and a root ended on another thread."""
    wait_start_ns = tracing.now_ns()
    root = tracing.start_span("batch", {"batch.id": 1})
    with tracing.phase("queue.wait", parent=root, start_time_ns=wait_start_ns):
        pass
    with tracing.phase("drafter.step", parent=root, attributes={"step": 2}) as step:
        step.set_attribute("tokens", 64)
        with pytest.raises(KeyError):
            with tracing.phase("drafter.loss", start_time_ns=step.start_time_ns + 1):
                raise KeyError("k")
    ender = threading.Thread(target=root.end)
    ender.start()
    ender.join()


def _shape(memory: InMemorySpanExporter) -> list[dict[str, object]]:
    spans = memory.get_finished_spans()
    by_id = {s.context.span_id: s for s in spans}
    root = next(s for s in spans if s.parent is None)

    def shape(s):  # type: ignore[no-untyped-def]
        parent = by_id[s.parent.span_id] if s.parent else None
        return {
            "name": s.name,
            "parent": parent.name if parent else None,
            "same_trace": s.context.trace_id == root.context.trace_id,
            "sampled": s.context.trace_flags.sampled,
            "kind": s.kind,
            "attributes": dict(s.attributes),
            "status": (s.status.status_code, s.status.description),
            "events": [(e.name, sorted(e.attributes)) for e in s.events],
            "scope": s.instrumentation_scope.name,
            "resource": {k: v for k, v in s.resource.attributes.items() if "instance" not in k},
            "inside_parent": parent is None or s.start_time >= parent.start_time,
            "ordered": s.end_time >= s.start_time,
        }

    return sorted((shape(s) for s in spans), key=lambda item: str(item["name"]))


def test_the_fast_path_exports_what_the_sdks_tracer_exports() -> None:
    shapes = {}
    for path in PATHS:
        memory = InMemorySpanExporter()
        _setup(path, memory, service_name="svc", rank=3, run_id="r")
        _program()
        tracing.shutdown(timeout_s=2.0)
        shapes[path] = _shape(memory)
    assert shapes["fast"] == shapes["sdk"]
    loss = next(s for s in shapes["fast"] if s["name"] == "drafter.loss")
    assert loss["status"][1] == "KeyError: 'k'" and loss["events"][0][0] == "exception"
    names = {"batch", "queue.wait", "drafter.step", "drafter.loss"}
    assert {s["name"] for s in shapes["fast"]} == names


@pytest.mark.parametrize("ratio", [0.0, 0.3, 1.0])
def test_roots_are_sampled_as_the_sdks_sampler_decides(memory, ratio) -> None:
    _setup("fast", memory, sample_ratio=ratio)
    sdk = ParentBased(TraceIdRatioBased(ratio))
    for _ in range(300):
        root = tracing.start_span("batch")
        context = root.span.get_span_context()
        expected = sdk.should_sample(None, context.trace_id, "batch").decision.is_sampled()
        assert context.trace_flags.sampled is expected
        with tracing.phase("child", parent=root):
            child = tracing.current_phase()
            assert child is not None and child.recording is expected
        root.end()


@pytest.mark.parametrize("path", PATHS)
def test_parent_from_another_tracer_and_from_a_remote_context(path, memory) -> None:
    telemetry = _setup(path, memory)
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
        assert not p.recording and p.span.get_span_context().trace_id == 0xABD
    assert telemetry.force_flush(2.0)
    spans = {s.name: s for s in memory.get_finished_spans()}
    outside_ctx = outside.get_span_context()
    for name in ("implicit", "explicit"):
        assert spans[name].context.trace_id == outside_ctx.trace_id
        assert spans[name].parent.span_id == outside_ctx.span_id
    assert spans["remote"].context.trace_id == 0xABC
    assert spans["remote"].parent.span_id == 0xDEF and spans["remote"].parent.is_remote
    assert "unsampled" not in spans  # parent-based: the remote decision holds
    assert telemetry.stats.get("unsampled").count == 1  # ...but the tables see it


@pytest.mark.parametrize("path", PATHS)
def test_handle_context_is_a_valid_otel_parent(path, memory) -> None:
    telemetry = _setup(path, memory)
    root = tracing.start_span("batch")
    root_context = root.span.get_span_context()
    assert trace.get_current_span(root.context).get_span_context() == root_context
    token = otel_context.attach(root.context)
    try:
        with tracing.phase("attached"):  # parented through the attached OTel context
            pass
        child = TracerProvider().get_tracer("other").start_span("sdk.child")
        child.end()
    finally:
        otel_context.detach(token)
    root.end()
    assert telemetry.force_flush(2.0)
    spans = {s.name: s for s in memory.get_finished_spans()}
    assert spans["attached"].parent.span_id == root_context.span_id
    assert child.parent.span_id == root_context.span_id
    assert child.context.trace_id == root_context.trace_id
