"""The contract of a phase beyond one `with`: reuse, sharing between threads, OTel
context propagation, clipping to the parent, a stepping wall clock, and never raising;
and the reporter and force_flush telling the truth."""

from __future__ import annotations

import io
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from memory_setup import setup_memory
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import tracing


def test_a_phase_object_reused_in_a_loop_measures_each_entry(memory) -> None:
    setup_memory(memory)
    timer = tracing.phase("fwd")
    for _ in range(3):
        with timer:
            time.sleep(0.02)
    stats = tracing.get_stats().get("fwd")
    # Each entry ~20 ms; measured from the first entry they would be 20, 40, 60 ms.
    assert stats.count == 3 and stats.max_s < 2 * stats.min_s, stats
    spans = memory.get_finished_spans()
    assert len(spans) == 3 and len({s.context.span_id for s in spans}) == 3


def test_a_phase_object_shared_between_threads(memory, caplog) -> None:
    setup_memory(memory)
    timer = tracing.phase("fwd")  # the Megatron timers("fwd") habit
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(5):
                with timer:
                    barrier.wait(timeout=10)
        except BaseException as exc:  # noqa: BLE001 - the test reports any error
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors and tracing.get_stats().get("fwd").count == 20
    assert len(memory.get_finished_spans()) == 20
    assert "different Context" not in caplog.text


def test_misuse_is_logged_never_raised(memory, caplog) -> None:
    setup_memory(memory)
    with tracing.phase("x", level="verbose"):  # unknown level: treated as "phase"
        pass
    with tracing.phase("y", parent="not a parent"):
        pass
    with tracing.phase("z") as p:
        p.end()
    assert {s.name for s in memory.get_finished_spans()} == {"x", "y", "z"}
    assert "'verbose'" in caplog.text and "str" in caplog.text


def test_propagate_context_nests_otel_spans_under_the_phase(memory) -> None:
    telemetry = setup_memory(memory, propagate_context=True)
    other = InMemorySpanExporter()
    provider = TracerProvider()  # another library's own SDK tracer
    provider.add_span_processor(SimpleSpanProcessor(other))
    client = provider.get_tracer("http-client")
    with tracing.phase("data.batch") as outer:
        with client.start_as_current_span("GET /shard"):
            with tracing.phase("decode"):
                pass
    assert trace.get_current_span() is trace.INVALID_SPAN  # detached again
    (http,) = other.get_finished_spans()
    ours = {s.name: s for s in memory.get_finished_spans()}
    assert http.parent.span_id == ours["data.batch"].context.span_id
    assert ours["decode"].parent.span_id == http.context.span_id
    assert http.context.trace_id == outer.span.get_span_context().trace_id
    telemetry.shutdown()


def test_context_is_not_propagated_by_default(memory) -> None:
    setup_memory(memory)
    with tracing.phase("data.batch"):
        assert trace.get_current_span() is trace.INVALID_SPAN
        with tracing.phase("one", propagate=True):  # per-phase opt-in
            assert trace.get_current_span().get_span_context().is_valid


def test_a_wait_begun_before_its_parent_is_clipped_in_the_span_only(memory) -> None:
    setup_memory(memory)
    wait_start_ns = tracing.now_ns()
    time.sleep(0.02)
    root = tracing.start_span("batch")
    with tracing.phase("queue.wait", parent=root, start_time_ns=wait_start_ns):
        pass
    root.end()
    spans = {s.name: s for s in memory.get_finished_spans()}
    assert spans["queue.wait"].start_time == spans["batch"].start_time
    assert tracing.get_stats().get("queue.wait").total_s >= 0.02


_STEPPING_CLOCK = """
import sys, time
real = time.time_ns
calls = [0]
def stepping():  # NTP steps the wall clock back 1000 s between every two reads
    calls[0] += 1
    return real() - (10**12 if calls[0] % 2 == 0 else 0)
time.time_ns = stepping
sys.path.insert(0, sys.argv[1])
import tracing
for _ in range(4):
    with tracing.phase("step"):
        time.sleep(0.001)
stats = tracing.get_stats().get("step")
print(stats.min_s, stats.max_s)
"""


def test_durations_survive_a_wall_clock_step() -> None:
    root = str(Path(__file__).resolve().parents[2])
    child = [sys.executable, "-c", _STEPPING_CLOCK, root]
    out = subprocess.run(child, capture_output=True, text=True, timeout=120, check=True).stdout
    min_s, max_s = map(float, out.split())
    assert 0.001 <= min_s and max_s < 100.0


def test_reporter_thread_survives_a_failing_report() -> None:
    class Flaky(io.StringIO):
        calls = 0

        def write(self, text: str) -> int:
            Flaky.calls += 1
            if Flaky.calls == 1:
                raise OSError("stream gone")
            return super().write(text)

    stream = Flaky()
    stats = tracing.ProfileStats()
    reporter = tracing.Reporter(stats, interval_s=0.05, stream=stream).start()
    stats.add("x", 0.01)
    deadline = time.monotonic() + 10
    while "x" not in stream.getvalue() and time.monotonic() < deadline:
        stats.add("x", 0.01)
        time.sleep(0.02)
    reporter.stop(final=False)
    assert "x" in stream.getvalue() and Flaky.calls > 1


class _GateExporter(InMemorySpanExporter):
    """Exports only once the test opens the gate; fails while told to."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.fail = False

    def export(self, spans):  # type: ignore[override]
        self.gate.wait(10)
        return SpanExportResult.FAILURE if self.fail else super().export(spans)


def test_force_flush_is_true_only_when_nothing_is_queued(clean_env) -> None:
    clean_env.setenv("OTEL_BSP_SCHEDULE_DELAY", "30000")
    exporter = _GateExporter()
    telemetry = tracing.setup(tracing.TracingConfig(), exporters=[exporter])
    try:
        with tracing.phase("a"):
            pass
        assert telemetry.force_flush(0.2) is False  # the export is still blocked
        exporter.gate.set()
        assert telemetry.force_flush(5.0) is True
        assert len(exporter.get_finished_spans()) == 1
        exporter.fail = True
        with tracing.phase("b"):
            pass
        assert telemetry.force_flush(5.0) is False  # sent, but the exporter failed
    finally:
        telemetry.shutdown(timeout_s=1.0)


@pytest.mark.parametrize("level", ["off", "phase"])
def test_phase_records_stats_at_every_level(level: str) -> None:
    telemetry = tracing.setup(tracing.TracingConfig(level=level))
    timer = tracing.phase("x")
    with timer:
        pass
    with timer:
        pass
    assert telemetry.stats.get("x").count == 2
    telemetry.shutdown()


def test_a_requested_stop_is_not_an_error(memory) -> None:
    class Stopped(Exception):
        pass

    tracing.setup(
        tracing.TracingConfig(),
        span_processors=[SimpleSpanProcessor(memory)],
        stop_exceptions=(Stopped, KeyboardInterrupt),
    )
    for exc in (Stopped(), KeyboardInterrupt(), ValueError("bad")):
        with pytest.raises(type(exc)):
            with tracing.phase(type(exc).__name__):
                raise exc
    status = {s.name: s.status.status_code.name for s in memory.get_finished_spans()}
    assert status == {"Stopped": "UNSET", "KeyboardInterrupt": "UNSET", "ValueError": "ERROR"}


class _BrokenHook:
    """A phase hook whose every method raises."""

    def phase_started(self, phase: object) -> None:
        raise RuntimeError("start")

    def phase_ended(self, phase: object, exc: object) -> None:
        raise RuntimeError("end")

    def span_started(self, handle: object) -> None:
        raise RuntimeError("span start")

    def span_ended(self, handle: object, end_time_ns: int) -> None:
        raise RuntimeError("span end")


def test_a_raising_hook_breaks_neither_the_phase_nor_its_span(caplog) -> None:
    exporter = InMemorySpanExporter()
    telemetry = tracing.setup(
        tracing.TracingConfig(level="phase"),
        span_processors=[SimpleSpanProcessor(exporter)],
        phase_hooks=[_BrokenHook()],
    )
    try:
        root = tracing.start_span("root")  # span_started raises inside: not here
        for _ in range(3):
            with tracing.phase("work", parent=root):
                assert tracing.current_phase().name == "work"
        assert tracing.current_phase() is None  # the phase did not stay open
        root.end()  # span_ended raises inside: not here
        stats = telemetry.stats.snapshot().phases
        assert stats["work"].count == 3
        names = [span.name for span in exporter.get_finished_spans()]
        assert names.count("work") == 3 and names.count("root") == 1
        parents = {s.parent.span_id for s in exporter.get_finished_spans() if s.name == "work"}
        assert parents == {root.span.get_span_context().span_id}
    finally:
        report = telemetry.shutdown(timeout_s=2.0)
    assert report.hook_errors == 3 * 2 + 2  # phase start and end, span start and end
    assert "phase hook errors 8" in report.summary()
    logged = [r.getMessage() for r in caplog.records if "raised (further" in r.getMessage()]
    assert len(logged) == 4  # once per hook method
