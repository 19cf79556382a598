"""The export process: records that rebuild the very same OTLP, a real receiver fed by
the child, and what happens when the child dies, the program dies or Ctrl-C comes."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.span import TraceState

import tracing
from tracing.export import wire
from tracing.export.exporters import make_exporter
from tracing.export.process import ProcessExporter, build_exporters
from tracing.handle import readable_spans
from tracing.record import SCOPE_NAME, SCOPE_VERSION

REPO = Path(__file__).resolve().parents[2]


class Capture(SpanExporter):
    """Keeps each batch as the processor hands it over (handles stay handles)."""

    takes_records = True

    def __init__(self) -> None:
        self.batches: list[list[object]] = []

    def export(self, spans: Sequence[object]) -> SpanExportResult:  # type: ignore[override]
        self.batches.append(list(spans))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


class Unmarshallable:
    def __str__(self) -> str:
        return "unmarshallable"


def _record_a_trace() -> list[object]:
    capture = Capture()
    telemetry = tracing.setup(
        tracing.TracingConfig(level="phase", service_name="wire-test"),
        exporters=[capture],
        install_global_provider=False,
    )
    try:
        root = tracing.start_span("batch", {"dflash.batch.id": 7, "ids": [1, 2, 3]})
        with tracing.phase("drafter.step", parent=root, attributes={"thread.name": "d-0"}):
            with tracing.phase("drafter.loss", attributes={"bad": Unmarshallable(), "ok": 1.5}):
                pass
        early = tracing.start_span("hs_queue.wait", parent=root)
        early.start_time_ns = root.start_time_ns - 5_000  # a wait begun before its parent
        early.end()
        with pytest.raises(RuntimeError), tracing.phase("target.forward", parent=root):
            raise RuntimeError("boom")
        root.end()
        remote = SpanContext(
            0xABC, 0xDEF, True, TraceFlags(TraceFlags.SAMPLED), TraceState([("k", "v")])
        )
        foreign = tracing.start_span("from.remote", parent=trace.set_span_in_context(
            trace.NonRecordingSpan(remote)))  # fmt: skip
        foreign.end()
        tracer = telemetry.provider.get_tracer("other.lib", "9.9")
        with tracer.start_as_current_span(
            "sdk.span", kind=SpanKind.CLIENT, links=[Link(remote, {"why": "batch"})]
        ) as span:
            span.add_event("note", {"n": 1})
        assert telemetry.force_flush(10.0)
    finally:
        tracing.shutdown(timeout_s=2.0)
    return [span for batch in capture.batches for span in batch]


def test_records_rebuild_the_same_otlp_request() -> None:
    spans = _record_a_trace()
    assert len(spans) == 7
    readable = readable_spans(spans)
    resource = readable[0].resource
    payload = wire.encode_batch(spans, (SCOPE_NAME, SCOPE_VERSION, None))
    rebuilt = wire.SpanBuilder(Resource(dict(resource.attributes), resource.schema_url))
    expected = encode_spans(readable).SerializeToString()
    assert encode_spans(rebuilt.build(payload)).SerializeToString() == expected
    fast = wire.RequestBuilder(Resource(dict(resource.attributes), resource.schema_url))
    assert fast.request(payload).request.SerializeToString() == expected
    step = next(s for s in spans if getattr(s, "name", "") == "drafter.step")
    assert fast._fast(wire.handle_record(step, 0)) is not None  # phases take the fast path
    loss = next(s for s in rebuilt.build(payload) if s.name == "drafter.loss")
    # What is not an attribute value is cleaned as the SDK cleans it (its str, here).
    assert dict(loss.attributes) == {"bad": "unmarshallable", "ok": 1.5}


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_spans_reach_a_real_receiver_through_the_export_process(request, protocol) -> None:
    receiver = request.getfixturevalue(f"{protocol}_receiver")
    cfg = tracing.TracingConfig(
        exporter="otlp",
        otlp_endpoint=receiver.endpoint,
        otlp_protocol=protocol,
        service_name="via-child",
    )
    telemetry = tracing.setup(cfg)
    exporter = telemetry.processors[0].exporter
    assert isinstance(exporter, ProcessExporter)
    child_pid = exporter._proc.pid
    for i in range(50):
        with tracing.phase("work", level="step", attributes={"i": i}):
            pass
    report = telemetry.shutdown(timeout_s=10.0)
    assert report.spans_exported == 50 and report.clean
    names = [name for received in receiver.requests for name in received.span_names]
    assert names == ["work"] * 50
    assert receiver.requests[0].resource["service.name"] == 'string_value: "via-child"'
    assert child_pid != os.getpid()
    assert _gone(child_pid, 5.0), "the export process outlived its shutdown"


def _file_exporter(path: Path) -> ProcessExporter:
    return ProcessExporter(("file", str(path)), Resource({"service.name": "f"}))


def _names(path: Path) -> list[str]:
    return [
        span["name"]
        for line in path.read_text().splitlines()
        for rs in json.loads(line)["resourceSpans"]
        for ss in rs["scopeSpans"]
        for span in ss["spans"]
    ]


def _spans(*names: str) -> list[object]:
    capture = Capture()
    tracing.setup(tracing.TracingConfig(level="phase"), exporters=[capture])
    try:
        for name in names:
            with tracing.phase(name, level="step"):
                pass
        tracing.active().force_flush(10.0)
    finally:
        tracing.shutdown(timeout_s=2.0)
    return [span for batch in capture.batches for span in batch]


def test_a_dead_export_process_costs_nothing_but_speed(tmp_path: Path, caplog) -> None:
    path = tmp_path / "trace.jsonl"
    exporter = _file_exporter(path)
    try:
        assert exporter.export(_spans("first")) == SpanExportResult.SUCCESS
        exporter._proc.kill()
        exporter._proc.wait(10)
        with caplog.at_level(logging.WARNING, logger="tracing"):
            assert exporter.export(_spans("second")) == SpanExportResult.SUCCESS
            assert exporter.export(_spans("third")) == SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()
    assert _names(path) == ["first", "second", "third"]
    warnings = [r.getMessage() for r in caplog.records if "export process" in r.getMessage()]
    assert len(warnings) == 1 and "exporting spans in this process" in warnings[0]


def test_ctrl_c_meant_for_the_program_leaves_the_export_process(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    exporter = _file_exporter(path)
    try:
        assert exporter.export(_spans("before")) == SpanExportResult.SUCCESS
        assert os.getsid(exporter._proc.pid) != os.getsid(0)  # not in the terminal's group
        os.kill(exporter._proc.pid, signal.SIGINT)
        time.sleep(0.3)
        assert exporter._proc.poll() is None
        assert exporter.export(_spans("after")) == SpanExportResult.SUCCESS
        assert exporter._local is None  # still the child's work
    finally:
        exporter.shutdown()
    assert _names(path) == ["before", "after"]


def test_the_export_process_ends_when_the_program_is_killed(tmp_path: Path) -> None:
    program = textwrap.dedent(
        f"""
        import os, sys, time
        sys.path.insert(0, {str(REPO)!r})
        from opentelemetry.sdk.resources import Resource
        from tracing.export.process import ProcessExporter
        exporter = ProcessExporter(("file", {str(tmp_path / "t.jsonl")!r}), Resource({{}}))
        print(exporter._proc.pid, flush=True)
        time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(proc.stdout.readline())
        proc.kill()
        proc.wait(10)
        assert _gone(child_pid, 10.0), "the export process outlived a killed program"
    finally:
        proc.kill()


def test_export_process_off_exports_in_this_process(tmp_path: Path) -> None:
    cfg = tracing.TracingConfig(
        exporter="file", trace_file=str(tmp_path / "t.jsonl"), export_process=False
    )
    resource = Resource({})
    (exporter,) = build_exporters(cfg, resource=resource)
    assert not isinstance(exporter, ProcessExporter)
    exporter.shutdown()
    in_child = tracing.TracingConfig(exporter="file", trace_file=cfg.trace_file)
    (child,) = build_exporters(in_child, resource=resource)
    assert isinstance(child, ProcessExporter)
    child.shutdown()


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # reap it when it is ours (a zombie still answers kill 0)
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            pass
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_the_sdk_exporters_send_requests_encoded_from_records(request, protocol) -> None:
    """The seam the export process uses: the SDK exporter sends our request as it is."""
    receiver = request.getfixturevalue(f"{protocol}_receiver")
    url = receiver.endpoint + ("" if protocol == "grpc" else "/v1/traces")
    exporter = make_exporter(("otlp", protocol, url, {}, 5.0))
    try:
        assert wire.install_encoded_batches(sys.modules[type(exporter).__module__])
        payload = wire.encode_batch(_spans("a", "b"), (SCOPE_NAME, SCOPE_VERSION, None))
        batch = wire.RequestBuilder(Resource({"service.name": "seam"})).request(payload)
        assert exporter.export(batch) == SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()
    assert [name for received in receiver.requests for name in received.span_names] == ["a", "b"]


def test_cleaned_records_keep_the_span_attribute_length_limit(monkeypatch) -> None:
    """A batch with a value marshal cannot write is cleaned with the limit the SDK's span
    uses for its attributes: the span-specific length limit, not the general one."""
    monkeypatch.setenv("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "2")
    monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT", "5")
    spans = _record_a_trace()
    readable = {s.name: s for s in readable_spans(spans)}
    resource = Resource(dict(readable["batch"].resource.attributes))
    payload = wire.encode_batch(spans, (SCOPE_NAME, SCOPE_VERSION, None))
    rebuilt = {s.name: s for s in wire.SpanBuilder(resource).build(payload)}
    assert dict(rebuilt["drafter.step"].attributes) == {"thread.name": "d-0"}
    assert dict(readable["drafter.step"].attributes) == {"thread.name": "d-0"}
