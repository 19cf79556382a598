"""Phases compose with the OpenTelemetry set-up around them: a processor added to the
provider `setup` returns gets every phase span, and the provider's sampler decides."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
)

import tracing

REPO = Path(__file__).resolve().parents[2]

PROGRAM = """
import tracing
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

telemetry = tracing.setup(tracing.TracingConfig(exporter="file", trace_file={path!r}))
telemetry.provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
with tracing.phase("outer"):
    for i in range(3):
        with tracing.phase("inner", attributes={{"i": i}}):
            pass
telemetry.shutdown()
"""


def test_a_ten_line_program_sees_every_phase_on_its_own_console_processor(tmp_path) -> None:
    code = textwrap.dedent(PROGRAM.format(path=str(tmp_path / "spans.jsonl")))
    assert len(code.strip().splitlines()) <= 10
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.count('"name": "inner"') == 3
    assert done.stdout.count('"name": "outer"') == 1


def _setup_with_an_exporter() -> tuple[tracing.Telemetry, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    telemetry = tracing.setup(tracing.TracingConfig(), exporters=[InMemorySpanExporter()])
    telemetry.provider.add_span_processor(SimpleSpanProcessor(exporter))
    return telemetry, exporter


def test_a_processor_added_later_gets_phases_and_sdk_spans() -> None:
    telemetry, exporter = _setup_with_an_exporter()
    try:
        with tracing.phase("phase.one"):
            pass
        with telemetry.provider.get_tracer("lib").start_as_current_span("sdk.span"):
            pass
        names = sorted(s.name for s in exporter.get_finished_spans())
        assert names == ["phase.one", "sdk.span"]
        phase = next(s for s in exporter.get_finished_spans() if s.name == "phase.one")
        assert phase.instrumentation_scope.name == "tracing"
    finally:
        telemetry.shutdown(timeout_s=2.0)


def test_the_providers_sampler_decides_new_traces() -> None:
    telemetry, exporter = _setup_with_an_exporter()
    try:
        telemetry.provider.sampler = ALWAYS_OFF
        with tracing.phase("dropped"), tracing.phase("dropped.child"):
            pass
        telemetry.provider.sampler = ALWAYS_ON
        with tracing.phase("kept"), tracing.phase("kept.child"):
            pass
        names = sorted(s.name for s in exporter.get_finished_spans())
        assert names == ["kept", "kept.child"]
        assert telemetry.stats.get("dropped").count == 1  # the tables count it anyway
    finally:
        telemetry.shutdown(timeout_s=2.0)


def test_a_sampler_that_is_not_parent_based_decides_children_too() -> None:
    """The specification's ALWAYS_OFF drops every span; a custom sampler sees each child
    with its parent's context; a ParentBased one leaves children to their parent."""
    seen: list[tuple[str, bool]] = []

    class ChildrenOnly(Sampler):
        def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None,
                          links=None, trace_state=None):  # fmt: skip
            parent = trace.get_current_span(parent_context).get_span_context()
            seen.append((name, parent.is_valid))
            decision = Decision.RECORD_AND_SAMPLE if parent.is_valid else Decision.DROP
            return SamplingResult(decision, attributes)

        def get_description(self) -> str:
            return "children only"

    telemetry, exporter = _setup_with_an_exporter()
    try:
        telemetry.provider.sampler = ChildrenOnly()
        with tracing.phase("root"), tracing.phase("root.child"):
            pass
        assert seen == [("root", False), ("root.child", True)]
        assert [s.name for s in exporter.get_finished_spans()] == ["root.child"]
        telemetry.provider.sampler = ParentBased(ALWAYS_ON)
        with tracing.phase("kept"), tracing.phase("kept.child"):
            pass
        assert len(seen) == 2  # children of a ParentBased sampler follow their parent
    finally:
        telemetry.shutdown(timeout_s=2.0)
