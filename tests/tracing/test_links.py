"""Span links: `phase(..., links=)` and `start_span(..., links=)` record the same links on
the fast path as the SDK's Tracer does (attributes, limits, drops), the sampler of a new
trace is shown them, and a phase without links records none."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_ON,
    ParentBased,
    Sampler,
    SamplingResult,
)
from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags
from opentelemetry.util.types import Attributes

import tracing
from tracing.fast import FastTracer
from tracing.telemetry import SCOPE

PATHS = ["fast", "sdk"]


def _setup(path: str, memory: InMemorySpanExporter, **cfg: object) -> tracing.Telemetry:
    config = tracing.TracingConfig(**cfg)  # type: ignore[arg-type]
    if path == "fast":
        telemetry = tracing.setup(config, exporters=[memory])
        assert isinstance(tracing.spans.runtime().tracer, FastTracer)
        return telemetry
    telemetry = tracing.setup(config, span_processors=[SimpleSpanProcessor(memory)])
    assert not isinstance(tracing.spans.runtime().tracer, FastTracer)
    return telemetry


def _program() -> Link:
    """Two batches and an update that applies both: its span links to the other batch's
    step (a handle, a SpanContext, a Context and a Link with attributes); a checkpoint in
    a trace of its own links to the last step. -> the Link the program gave."""
    first = tracing.start_span("batch", {"dflash.batch.id": 0})
    with tracing.phase("drafter.step", parent=first, level="step") as step0:
        pass
    first.end()
    given = Link(step0.span.get_span_context(), {"dflash.step": np.int64(0), "why": "averaged"})
    second = tracing.start_span("batch", {"dflash.batch.id": 1}, links=[first])
    with tracing.phase("drafter.step", parent=second, level="step") as step1:
        links = [step0, given, step0.span.get_span_context(), step0.context]
        with tracing.phase("drafter.optimizer", links=links):
            pass
        with tracing.phase("drafter.loss"):  # no links: none recorded
            pass
    second.end()
    with tracing.phase(
        "checkpoint.save", level="step", links=[Link(step1.span.get_span_context())]
    ):
        pass
    return given


def _links(memory: InMemorySpanExporter) -> dict[str, list[tuple[Any, ...]]]:
    """Per span name: (linked span's name, its batch, the link's attributes, dropped)."""
    spans = memory.get_finished_spans()
    by_id = {s.context.span_id: s for s in spans}

    def name(link: Link) -> tuple[str, object]:
        target = by_id[link.context.span_id]
        root = target if target.parent is None else by_id[target.parent.span_id]
        assert link.context.trace_id == target.context.trace_id
        return target.name, root.attributes.get("dflash.batch.id")

    out: dict[str, list[tuple[Any, ...]]] = {}
    for s in sorted(spans, key=lambda s: (s.name, s.start_time)):
        out.setdefault(s.name, []).append(
            tuple(
                (*name(link), dict(link.attributes or {}), link.dropped_attributes)
                for link in s.links
            )
        )
        assert s.dropped_links == 0
    return out


def test_links_are_recorded_alike_on_the_fast_path_and_the_sdks() -> None:
    recorded, given_links = {}, {}
    for path in PATHS:
        memory = InMemorySpanExporter()
        _setup(path, memory)
        given_links[path] = _program()
        tracing.shutdown(timeout_s=2.0)
        recorded[path] = _links(memory)
    assert recorded["fast"] == recorded["sdk"]
    links = recorded["fast"]
    step0 = ("drafter.step", 0)
    attributes = {"dflash.step": 0, "why": "averaged"}  # numpy taken as a Python int
    assert links["drafter.optimizer"] == [
        ((*step0, {}, 0), (*step0, attributes, 0), (*step0, {}, 0), (*step0, {}, 0))
    ]
    assert links["batch"] == [(), (("batch", 0, {}, 0),)]  # start_span: the second batch
    assert links["checkpoint.save"] == [(("drafter.step", 1, {}, 0),)]
    assert links["drafter.loss"] == [()] and links["drafter.step"] == [(), ()]
    for given in given_links.values():  # the caller's Link is left as it was given
        assert dict(given.attributes) == {"dflash.step": np.int64(0), "why": "averaged"}


@pytest.mark.parametrize("path", PATHS)
def test_link_limits_apply_as_the_sdks(path: str, memory, clean_env) -> None:
    clean_env.setenv("OTEL_SPAN_LINK_COUNT_LIMIT", "2")
    clean_env.setenv("OTEL_LINK_ATTRIBUTE_COUNT_LIMIT", "1")
    telemetry = _setup(path, memory)
    others = [tracing.start_span("batch") for _ in range(3)]
    for other in others:
        other.end()
    links = [Link(o.span.get_span_context(), {"a": 1, "b": 2}) for o in others]
    with tracing.phase("drafter.optimizer", links=links):
        pass
    assert telemetry.force_flush(2.0)
    span = next(s for s in memory.get_finished_spans() if s.name == "drafter.optimizer")
    assert len(span.links) == 2 and span.dropped_links == 1
    # The SDK's bounded attributes keep the last ones set.
    assert [dict(link.attributes or {}) for link in span.links] == [{"b": 2}, {"b": 2}]
    assert all(link.dropped_attributes == 1 for link in span.links)


@pytest.mark.parametrize("path", PATHS)
def test_what_cannot_be_linked_is_left_out(path: str, memory) -> None:
    telemetry = _setup(path, memory, level="step")
    with tracing.phase("filtered", level="phase") as filtered:  # above the level: no span
        pass
    invalid = SpanContext(0, 0, is_remote=False)
    with tracing.phase("eval", level="step", links=[filtered, invalid, Context(), "x"]):
        pass
    assert telemetry.force_flush(2.0)
    (span,) = memory.get_finished_spans()
    assert span.name == "eval" and span.links == ()


class _Recorder(Sampler):
    """Samples every trace; keeps the links each decision was shown."""

    def __init__(self) -> None:
        self.seen: list[list[int]] = []

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Any = None,
        trace_state: Any = None,
    ) -> SamplingResult:
        self.seen.append([link.context.span_id for link in links or ()])
        return ALWAYS_ON.should_sample(parent_context, trace_id, name, kind, attributes, links)

    def get_description(self) -> str:
        return "recorder"


def test_the_sampler_of_a_new_trace_sees_its_links() -> None:
    linked = SpanContext(0xA, 0xB, is_remote=False, trace_flags=TraceFlags(1))
    seen = {}
    for path in PATHS:
        recorder = _Recorder()
        provider = TracerProvider(sampler=ParentBased(recorder))
        memory = InMemorySpanExporter()
        tracer: Any
        if path == "fast":
            sdk_tracer = provider.get_tracer(SCOPE.name, SCOPE.version)
            tracer = FastTracer(provider, [SimpleSpanProcessor(memory)], SCOPE, sdk_tracer)
        else:
            provider.add_span_processor(SimpleSpanProcessor(memory))
            tracer = provider.get_tracer(SCOPE.name, SCOPE.version)
        root = tracer.start_span("batch", Context(), links=[Link(linked)])
        child = tracer.start_span("child", trace.set_span_in_context(root), links=[Link(linked)])
        child.end()
        root.end()
        seen[path] = recorder.seen  # the child follows its parent: not asked
        spans: tuple[ReadableSpan, ...] = memory.get_finished_spans()
        assert [[link.context for link in s.links] for s in spans] == [[linked], [linked]]
    assert seen["fast"] == seen["sdk"] == [[0xB]]


def test_the_trace_file_names_linked_spans_by_hex_ids(tmp_path) -> None:
    """OTLP/JSON ids are hex, a link's as a span's: a reader finds the linked span."""
    path = tmp_path / "spans.jsonl"
    tracing.setup(tracing.TracingConfig(), exporters=[tracing.OtlpJsonFileExporter(path)])
    with tracing.phase("drafter.step", level="step") as step:
        pass
    with tracing.phase("checkpoint.save", level="step", links=[Link(step.span.get_span_context())]):
        pass
    tracing.shutdown(timeout_s=2.0)
    spans = [
        span
        for line in path.read_text().splitlines()
        for resource in json.loads(line)["resourceSpans"]
        for scope in resource["scopeSpans"]
        for span in scope["spans"]
    ]
    by_name = {s["name"]: s for s in spans}
    (link,) = by_name["checkpoint.save"]["links"]
    assert (
        link["spanId"]
        == by_name["drafter.step"]["spanId"]
        == f"{step.span.get_span_context().span_id:016x}"
    )
    assert link["traceId"] == by_name["drafter.step"]["traceId"]
