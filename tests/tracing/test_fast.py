"""The fast path against its reference, the SDK's Tracer: the same phases recorded both
ways give the same `ReadableSpan.to_json()` (ids relabelled, times masked) for every kind
of span the application records, the same flags, dropped counts and scope, the same SDK
span metrics, sampled alike. CI runs tests/tracing at the newest SDK and at the 1.40
floor (`scripts/otel_versions.sh`, .ci/run)."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import (
    ReadableSpan,
    SpanProcessor,
    TracerProvider,
    _disable_tracer_configurator,
)
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Link, SpanContext, Status, StatusCode, TraceFlags

import tracing
from tracing.fast import RANDOM_FLAG, FastTracer, fits
from tracing.telemetry import SCOPE

PATHS = ["fast", "sdk"]

# Tight SDK limits (read when setup builds the provider): attributes, events and links
# are dropped and values cut, on both paths alike.
LIMITS = {
    "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT": "4",
    "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT": "5",
    "OTEL_SPAN_EVENT_COUNT_LIMIT": "2",
    "OTEL_EVENT_ATTRIBUTE_COUNT_LIMIT": "2",
    "OTEL_SPAN_LINK_COUNT_LIMIT": "2",
    "OTEL_LINK_ATTRIBUTE_COUNT_LIMIT": "1",
}

# One attribute of every type OTLP carries.
EVERY_TYPE = {
    "s": "text",
    "b": True,
    "i": 7,
    "f": 0.5,
    "ls": ["a", "bcdefgh"],
    "lb": [True, False],
    "li": [1, 2, 3],
    "lf": [1.5, 2.5],
}


def _setup(path: str, memory: InMemorySpanExporter, **cfg: object) -> tracing.Telemetry:
    config = tracing.TracingConfig(**cfg)  # type: ignore[arg-type]
    if path == "fast":
        telemetry = tracing.setup(config, exporters=[memory])
        assert isinstance(tracing.spans.runtime().tracer, FastTracer)
        return telemetry
    return tracing.setup(config, span_processors=[SimpleSpanProcessor(memory)])


def _program() -> None:
    """Every kind of span the application records: a batch root with links (ended on
    another thread), a wait begun before its parent, a step with late attributes of
    every type, events (one with the time given, as `dflash.run.streamed` gives it),
    a link added late, a phase with links of each form, an exception, an OK status
    that stays, a renamed span, changes after the end (ignored)."""
    prefetch = tracing.start_span("prefetch", EVERY_TYPE)
    prefetch.end()
    wait_start_ns = tracing.now_ns()
    root = tracing.start_span("batch", {"batch.id": 1}, links=[prefetch])
    with tracing.phase("queue.wait", parent=root, start_time_ns=wait_start_ns):
        pass
    with tracing.phase("drafter.step", parent=root, attributes={"step": 2}) as step:
        for key, value in EVERY_TYPE.items():
            step.set_attribute("late." + key, value)
        span = step.span
        assert span is not None
        span.add_event("extracted", {"rows": 3, "kind": "hidden"}, timestamp=tracing.now_ns())
        span.add_event("plain")
        span.add_event("third", EVERY_TYPE)  # past a tight event limit
        remote = SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=TraceFlags(1))
        span.add_link(remote, {"late": True, "n": 2})
        links = [root, Link(remote, {"why": "data", "n": 1}), remote, root.context]
        with tracing.phase("drafter.loss", links=links, attributes=EVERY_TYPE):
            pass
        with pytest.raises(KeyError):
            with tracing.phase("drafter.backward", start_time_ns=step.start_time_ns + 1):
                raise KeyError("k")
        with tracing.phase("optimizer", attributes={"lr": 0.002}) as opt:
            opt_span = opt.span
            assert opt_span is not None
            opt_span.set_status(Status(StatusCode.OK))
            opt_span.set_status(StatusCode.ERROR, "after OK: ignored")
            opt_span.set_status(Status(StatusCode.UNSET))
            opt_span.update_name("optimizer.step")
    span.set_attribute("after.end", 1)
    span.add_event("after.end")
    span.update_name("renamed.after.end")
    ender = threading.Thread(target=root.end)
    ender.start()
    ender.join()


def _record(spans: list[ReadableSpan]) -> list[dict[str, Any]]:
    """Each span's `to_json()`, ids relabelled in order of appearance (the same
    relations give the same labels), times masked, with what to_json leaves out: the
    trace flags (sampled, random trace id), the dropped counts and the scope."""
    labels: dict[str, str] = {}

    def label(hex_id: str | None) -> str | None:
        return None if hex_id is None else labels.setdefault(hex_id, f"id{len(labels)}")

    records = []
    for span in sorted(spans, key=lambda s: s.name):
        record = json.loads(span.to_json())
        for ids in (record["context"], *(link["context"] for link in record["links"])):
            ids["trace_id"], ids["span_id"] = label(ids["trace_id"]), label(ids["span_id"])
        record["parent_id"] = label(record["parent_id"])
        assert record.pop("start_time") and record.pop("end_time")
        for event in record["events"]:
            assert event.pop("timestamp")
        scope = span.instrumentation_scope
        assert span.context is not None
        record["more"] = {
            "flags": int(span.context.trace_flags),
            "parent_remote": span.parent.is_remote if span.parent else None,
            "dropped": (span.dropped_attributes, span.dropped_events, span.dropped_links),
            "scope": (scope.name, scope.version, scope.schema_url) if scope else None,
            "ordered": span.start_time <= span.end_time,  # type: ignore[operator]
        }
        records.append(record)
    return records


@pytest.mark.parametrize("limits", [{}, LIMITS], ids=["default-limits", "tight-limits"])
def test_the_fast_path_exports_the_sdks_to_json(clean_env, limits) -> None:
    for name, value in limits.items():
        clean_env.setenv(name, value)
    records = {}
    for path in PATHS:
        memory = InMemorySpanExporter()
        _setup(path, memory, service_name="svc", rank=3, run_id="r")
        _program()
        tracing.shutdown(timeout_s=2.0)
        records[path] = _record(list(memory.get_finished_spans()))
    assert records["fast"] == records["sdk"]
    # ...and the record holds what it should: a difference would show.
    by_name = {r["name"]: r for r in records["fast"]}
    assert set(by_name) == {
        *("prefetch", "batch", "queue.wait", "drafter.step", "drafter.loss"),
        *("drafter.backward", "optimizer.step"),
    }
    backward = by_name["drafter.backward"]
    assert backward["status"] == {"status_code": "ERROR", "description": "KeyError: 'k'"}
    assert [e["name"] for e in backward["events"]] == ["exception"]
    assert by_name["optimizer.step"]["status"] == {"status_code": "OK"}
    assert by_name["drafter.step"]["parent_id"] == by_name["batch"]["context"]["span_id"]
    assert by_name["batch"]["links"][0]["context"] == by_name["prefetch"]["context"]
    step_events = [e["name"] for e in by_name["drafter.step"]["events"]]
    sampled_random = TraceFlags.SAMPLED | RANDOM_FLAG
    assert {r["more"]["flags"] for r in records["fast"]} == {sampled_random}
    if limits:
        assert step_events == ["plain", "third"]  # the oldest dropped, as the SDK drops
        assert by_name["drafter.step"]["more"]["dropped"] == (5, 1, 0)  # 9 attributes, 2 events
        assert by_name["drafter.loss"]["more"]["dropped"][2] == 2
        assert set(by_name["prefetch"]["attributes"]) == {"ls", "lb", "li", "lf"}  # last 4
        assert by_name["prefetch"]["attributes"]["ls"] == ["a", "bcdef"]
    else:
        assert step_events == ["extracted", "plain", "third"]
        assert by_name["prefetch"]["attributes"] == EVERY_TYPE
        assert len(by_name["drafter.loss"]["links"]) == 4


def test_unsampled_spans_carry_the_sdks_flags(memory) -> None:
    """Sampled out, a phase is a non-recording span: its flags (random trace id from
    SDK 1.42 on) are those the SDK's Tracer gives."""
    flags = {}
    for path in PATHS:
        _setup(path, InMemorySpanExporter(), sample_ratio=0.0)
        root = tracing.start_span("batch")
        with tracing.phase("child", parent=root) as child:
            assert child.span is not None and not child.recording
            flags[path] = [
                int(s.get_span_context().trace_flags)  # type: ignore[union-attr]
                for s in (root.span, child.span)
            ]
        root.end()
        tracing.shutdown(timeout_s=1.0)
    assert flags["fast"] == flags["sdk"] == [RANDOM_FLAG, RANDOM_FLAG]


def _span_metrics(reader: InMemoryMetricReader) -> dict[str, list[tuple[object, int]]]:
    data = reader.get_metrics_data()
    found: dict[str, list[tuple[object, int]]] = {}
    for resource_metrics in data.resource_metrics if data else ():
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                points = [
                    (sorted(p.attributes.items()), p.value)  # type: ignore[union-attr]
                    for p in metric.data.data_points
                ]
                found[metric.name] = sorted(points, key=repr)
    return found


class _HalfSampledIds(IdGenerator):
    """Trace ids that a ratio of 0.5 samples every other time, the same on each path."""

    def __init__(self) -> None:
        self.count = 0

    def generate_span_id(self) -> int:
        self.count += 1
        return self.count

    def generate_trace_id(self) -> int:
        self.count += 1
        return (self.count % 2) << 63 | self.count  # low 64 bits >= 2**63: not sampled


def test_the_sdks_span_metrics_are_recorded_alike(clean_env) -> None:
    """The SDK's own span metrics (otel.sdk.span.started / .live; on from 1.4x with
    OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED, always at 1.40): the fast path records
    them through the SDK Tracer's recorder, as that Tracer would."""
    clean_env.setenv("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED", "true")
    metrics = {}
    for path in PATHS:
        reader = InMemoryMetricReader()
        provider = TracerProvider(
            sampler=ParentBased(TraceIdRatioBased(0.5)),
            id_generator=_HalfSampledIds(),
            meter_provider=MeterProvider(metric_readers=[reader]),
        )
        processor = SimpleSpanProcessor(InMemorySpanExporter())
        sdk_tracer = provider.get_tracer(SCOPE.name, SCOPE.version)
        tracer: Any = sdk_tracer
        if path == "fast":
            assert fits(sdk_tracer, [processor])
            tracer = FastTracer(provider, [processor], SCOPE, sdk_tracer)
        else:
            provider.add_span_processor(processor)
        for number in range(40):
            root = tracer.start_span("batch", otel_context.Context())
            tracer.start_span("child", trace.set_span_in_context(root)).end()
            if number % 4:
                root.end()  # a quarter stay live
        metrics[path] = _span_metrics(reader)
    assert metrics["fast"] == metrics["sdk"]
    started = dict((str(a), n) for a, n in metrics["fast"]["otel.sdk.span.started"])
    assert sum(started.values()) == 80 and len(started) == 4  # none/local x sampled/dropped


class _EndingProcessor(SpanProcessor):
    def __init__(self) -> None:
        self.seen: list[str] = []

    def _on_ending(self, span: Any) -> None:
        self.seen.append(span.name)


def test_fits_only_where_nothing_is_skipped(memory) -> None:
    """A processor whose ending hook does something, or a tracer the SDK's
    configuration disables, keeps the SDK's Tracer."""
    telemetry = _setup("fast", memory)
    sdk_tracer = telemetry.provider.get_tracer(SCOPE.name, SCOPE.version)
    assert fits(sdk_tracer, [SimpleSpanProcessor(memory)])
    ending = _EndingProcessor()
    assert not fits(sdk_tracer, [ending])
    # The SDK's (private) tracer configuration: phases turn to the SDK's Tracer, which
    # honours it (no spans).
    telemetry.provider._set_tracer_configurator(tracer_configurator=_disable_tracer_configurator)
    assert not isinstance(tracing.spans.runtime().tracer, FastTracer)
    with tracing.phase("disabled") as phase:
        assert not phase.recording
    assert telemetry.force_flush(2.0)
    assert not memory.get_finished_spans()


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
