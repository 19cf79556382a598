"""Phases compose with the application's OpenTelemetry: its global provider (processors,
sampler, resource), a provider passed in, and processors or samplers put on tracing's
own provider, with `on_start` and `on_end` for every phase span."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import (
    Decision,
    Sampler,
    SamplingResult,
)

import tracing
from tracing.fast import FastTracer

REPO = Path(__file__).resolve().parents[2]


class Enriching(SpanProcessor):
    """What an application's processor does in `on_start` (a baggage processor, say)."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.ended: list[str] = []

    def on_start(self, span, parent_context=None) -> None:  # type: ignore[no-untyped-def]
        self.started.append(span.name)
        span.set_attribute("app.enriched", True)

    def on_end(self, span) -> None:  # type: ignore[no-untyped-def]
        self.ended.append(span.name)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # the SDK's default returns None before 1.4x, which reads as not flushed


def run_phases() -> None:
    """The phases of one batch, as dflash's pipeline makes them (cross-thread root)."""
    root = tracing.start_span("batch", {"batch.id": 1})
    with tracing.phase("drafter.step", parent=root, level="step"):
        for name in ("drafter.loss", "drafter.backward"):
            with tracing.phase(name):
                pass
    root.end()


APPLICATION = """
import json, sys
sys.path.insert(0, {repo!r}); sys.path.insert(0, {tests!r})
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from test_compose import Enriching, run_phases

# The application sets OpenTelemetry up first, as every OTel library expects it to.
memory, enriching = InMemorySpanExporter(), Enriching()
provider = TracerProvider(resource=Resource.create({{"service.name": "the-app"}}),
                          sampler=ParentBased(TraceIdRatioBased({ratio})))
provider.add_span_processor(enriching)
provider.add_span_processor(SimpleSpanProcessor(memory))
trace.set_tracer_provider(provider)

import tracing
telemetry = tracing.setup(install_global_provider={install_global})  # the defaults
with trace.get_tracer("app").start_as_current_span("request"):
    with tracing.phase("inside.request"):
        pass
for _ in range({batches}):
    run_phases()
report = telemetry.shutdown()
spans = memory.get_finished_spans()
print(json.dumps({{
    "same_provider": telemetry.provider is provider,
    "started": enriching.started, "ended": enriching.ended,
    "names": [s.name for s in spans],
    "enriched": all(s.attributes.get("app.enriched") for s in spans),
    "services": sorted({{s.resource.attributes["service.name"] for s in spans}}),
    "request_trace": len({{s.context.trace_id for s in spans
                          if s.name in ("request", "inside.request")}}),
    "phases_counted": telemetry.stats.get("drafter.loss").count,
    "summary": report.summary(), "to_application": report.spans_to_application,
}}))
"""


def _application(ratio: float = 1.0, batches: int = 1, install_global: bool = False) -> dict:
    code = textwrap.dedent(APPLICATION).format(
        repo=str(REPO),
        tests=str(Path(__file__).parent),
        ratio=ratio,
        batches=batches,
        install_global=install_global,
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("install_global", [False, True])
def test_an_applications_global_provider_gets_every_phase_with_on_start(install_global) -> None:
    """The bar: the application set the global TracerProvider with its own processor
    first, then used tracing with its defaults (also asking it to install its own)."""
    seen = _application(install_global=install_global)
    phases = ["batch", "drafter.step", "drafter.loss", "drafter.backward", "inside.request"]
    assert seen["same_provider"]
    assert sorted(seen["started"]) == sorted([*phases, "request"])  # on_start, every one
    assert sorted(seen["ended"]) == sorted(seen["started"])
    assert sorted(seen["names"]) == sorted([*phases, "request"]) and seen["enriched"]
    assert seen["services"] == ["the-app"]  # one pipeline, the application's resource
    assert seen["request_trace"] == 1  # a phase inside the app's span joins its trace
    assert seen["to_application"] == 5 and "span processors 5 (flushed)" in seen["summary"]


def test_the_applications_sampler_decides_and_the_tables_count_everything() -> None:
    seen = _application(ratio=0.0, batches=20)
    assert seen["names"] == [] and seen["to_application"] == 0
    assert seen["phases_counted"] == 20  # the tables see every phase


def test_a_provider_passed_in_is_used_as_it_is(memory) -> None:
    enriching = Enriching()
    provider = TracerProvider(resource=Resource.create({"service.name": "passed"}))
    provider.add_span_processor(enriching)
    provider.add_span_processor(SimpleSpanProcessor(memory))
    telemetry = tracing.setup(tracing.TracingConfig(), provider=provider)
    run_phases()
    report = telemetry.shutdown(timeout_s=2.0)
    assert telemetry.provider is provider and report.spans_to_application == 4
    assert enriching.started == ["batch", "drafter.step", "drafter.loss", "drafter.backward"]
    assert {s.resource.attributes["service.name"] for s in memory.get_finished_spans()} == {
        "passed"
    }
    provider.shutdown()


def test_a_no_op_global_provider_leaves_tracing_its_own(memory) -> None:
    """The API's default (a proxy) is not an application's provider."""
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    telemetry = tracing.setup(tracing.TracingConfig(), exporters=[memory])
    assert telemetry.own_provider and isinstance(telemetry.provider, TracerProvider)
    run_phases()
    assert telemetry.shutdown(timeout_s=2.0).spans_exported == 4


def test_a_provider_of_another_sdk_records_through_the_api_alone(memory) -> None:
    class OtherSdk(trace.TracerProvider):  # an API implementation that is not the SDK
        def __init__(self) -> None:
            self.names: list[str] = []

        def get_tracer(self, name, *args, **kwargs):  # type: ignore[no-untyped-def]
            sdk = TracerProvider()
            sdk.add_span_processor(SimpleSpanProcessor(memory))
            return sdk.get_tracer(name)

    telemetry = tracing.setup(tracing.TracingConfig(), provider=OtherSdk())
    run_phases()
    report = telemetry.shutdown(timeout_s=2.0)
    assert len(memory.get_finished_spans()) == 4 and report.spans_to_application == 4


def test_with_no_exporter_a_processor_added_to_the_provider_gets_every_phase() -> None:
    """`telemetry.provider.add_span_processor` works without an exporter configured,
    and hands the phases to the SDK's Tracer: `on_start` for each, as for SDK spans."""
    telemetry = tracing.setup(tracing.TracingConfig())
    assert not telemetry.tracing_spans  # no processor: phases cost no span
    enriching, memory = Enriching(), InMemorySpanExporter()
    telemetry.provider.add_span_processor(enriching)
    telemetry.provider.add_span_processor(SimpleSpanProcessor(memory))
    run_phases()
    with telemetry.provider.get_tracer("lib").start_as_current_span("sdk.span"):
        pass
    telemetry.shutdown(timeout_s=2.0)
    phases = ["batch", "drafter.step", "drafter.loss", "drafter.backward"]
    assert enriching.started == [*phases, "sdk.span"]
    assert all(s.attributes["app.enriched"] for s in memory.get_finished_spans())
    assert {s.instrumentation_scope.name for s in memory.get_finished_spans()} == {"tracing", "lib"}


def test_a_processor_added_to_the_fast_path_takes_it_over(memory) -> None:
    telemetry = tracing.setup(tracing.TracingConfig(), exporters=[memory])
    assert isinstance(tracing.spans.runtime().tracer, FastTracer)
    run_phases()
    enriching = Enriching()
    telemetry.provider.add_span_processor(enriching)
    run_phases()
    assert telemetry.shutdown(timeout_s=2.0).spans_exported == 8  # both halves, exported
    assert enriching.started == ["batch", "drafter.step", "drafter.loss", "drafter.backward"]


def test_the_sampler_from_the_environment_decides_and_the_tables_count_all(clean_env, memory):
    clean_env.setenv("OTEL_TRACES_SAMPLER", "always_off")  # the SDK reads it
    telemetry = tracing.setup(tracing.TracingConfig(), exporters=[memory])
    run_phases()
    telemetry.shutdown(timeout_s=2.0)
    assert memory.get_finished_spans() == () and telemetry.stats.get("drafter.loss").count == 1
    assert "AlwaysOff" in telemetry.sampler


def test_a_sampler_that_is_not_parent_based_decides_children_too(memory) -> None:
    seen: list[tuple[str, bool]] = []

    class ChildrenOnly(Sampler):
        def should_sample(
            self,
            parent_context,
            trace_id,
            name,
            kind=None,
            attributes=None,
            links=None,
            trace_state=None,
        ):  # type: ignore[no-untyped-def]
            parent = trace.get_current_span(parent_context).get_span_context()
            seen.append((name, parent.is_valid))
            decision = Decision.RECORD_AND_SAMPLE if parent.is_valid else Decision.DROP
            return SamplingResult(decision, attributes)

        def get_description(self) -> str:
            return "children only"

    provider = TracerProvider(sampler=ChildrenOnly())
    provider.add_span_processor(SimpleSpanProcessor(memory))
    telemetry = tracing.setup(tracing.TracingConfig(), provider=provider)
    with tracing.phase("root"), tracing.phase("root.child"):
        pass
    telemetry.shutdown(timeout_s=2.0)
    assert seen == [("root", False), ("root.child", True)]
    assert [s.name for s in memory.get_finished_spans()] == ["root.child"]
