from __future__ import annotations

import threading
import time

import pytest
from memory_setup import setup_memory
from opentelemetry.trace import StatusCode

import tracing
from tracing.clock import now_ns


def by_name(exporter):
    return {span.name: span for span in exporter.get_finished_spans()}


def test_phase_names_parents_attributes(memory):
    setup_memory(memory)
    root = tracing.start_span("batch", {"batch.id": 7})
    with tracing.phase("drafter.step", parent=root, attributes={"step": 3}):
        with tracing.phase("drafter.loss"):
            pass
    root.end()
    spans = by_name(memory)
    assert set(spans) == {"batch", "drafter.step", "drafter.loss"}
    assert spans["batch"].parent is None
    assert spans["drafter.step"].parent.span_id == spans["batch"].context.span_id
    assert spans["drafter.loss"].parent.span_id == spans["drafter.step"].context.span_id
    assert spans["drafter.loss"].context.trace_id == spans["batch"].context.trace_id
    assert spans["drafter.step"].attributes["step"] == 3
    assert spans["batch"].attributes["batch.id"] == 7
    # The library's default service.name is the specification's, not an application's.
    assert spans["batch"].resource.attributes["service.name"].startswith("unknown_service")


def test_root_span_crosses_threads_and_wait_span_start_time(memory):
    setup_memory(memory)
    handed = {}

    def producer():
        handed["root"] = tracing.start_span("batch")

    thread = threading.Thread(target=producer)
    thread.start()
    thread.join()
    # The consumer began waiting 5 ms ago, on the phases' clock (tracing.clock.now_ns: the
    # wall clock drifts from the monotonic one the phases use).
    t0 = now_ns() - 5_000_000
    with tracing.phase("hs_queue.wait", parent=handed["root"].context, start_time_ns=t0):
        pass
    ender = threading.Thread(target=handed["root"].end)
    ender.start()
    ender.join()
    spans = by_name(memory)
    assert spans["hs_queue.wait"].start_time == t0
    assert spans["hs_queue.wait"].end_time - t0 >= 5_000_000
    assert spans["hs_queue.wait"].parent.span_id == spans["batch"].context.span_id
    assert tracing.get_stats().get("hs_queue.wait").total_s >= 0.005


def test_exception_marks_error_and_propagates(memory):
    setup_memory(memory)
    with pytest.raises(ValueError, match="bad batch"):
        with tracing.phase("target.forward"):
            raise ValueError("bad batch")
    span = by_name(memory)["target.forward"]
    assert span.status.status_code is StatusCode.ERROR
    assert span.events[0].name == "exception"
    assert span.events[0].attributes["exception.type"] == "ValueError"
    assert tracing.get_stats().get("target.forward").count == 1


def test_decorator_form(memory):
    setup_memory(memory)

    @tracing.phase("drafter.backward")
    def backward(x):
        return x * 2

    assert backward(2) == 4 and backward(3) == 6
    assert [s.name for s in memory.get_finished_spans()] == ["drafter.backward"] * 2


def test_levels_filter_spans_but_not_stats(memory):
    setup_memory(memory, level="step")
    with tracing.phase("drafter.step", level="step"):
        with tracing.phase("drafter.loss"):
            pass
    assert [s.name for s in memory.get_finished_spans()] == ["drafter.step"]
    stats = tracing.get_stats()
    assert stats.get("drafter.loss").count == 1 and stats.get("drafter.step").count == 1


def test_sampling_keeps_stats_exact(memory):
    setup_memory(memory, sample_ratio=0.1)
    for _ in range(500):
        root = tracing.start_span("batch")
        with tracing.phase("drafter.step", parent=root):
            pass
        root.end()
    exported = len([s for s in memory.get_finished_spans() if s.name == "drafter.step"])
    assert 10 < exported < 120  # about 50 of 500 sampled
    assert tracing.get_stats().get("drafter.step").count == 500
    assert tracing.get_stats().get("batch").count == 500


def test_phase_before_setup_feeds_default_stats():
    tracing.shutdown(timeout_s=1.0)
    before = tracing.get_stats().get("pre.setup")
    with tracing.phase("pre.setup") as p:
        p.set_attribute("ignored", 1)  # no span: a no-op, never an error
    after = tracing.get_stats().get("pre.setup")
    assert after.count == (before.count if before else 0) + 1


def test_events_timing_through_host_clock(memory):
    clock = tracing.HostClock(auto_complete=False)
    telemetry = setup_memory(memory, cuda_timing="events", device_clock=clock)
    with tracing.phase("target.forward", device="cuda:0"):
        time.sleep(0.002)
    # The phase returned without waiting: its span is not ended until the events complete.
    assert memory.get_finished_spans() == ()
    assert len(clock.events) == 2
    clock.complete_all()
    deadline = time.monotonic() + 2.0
    while not memory.get_finished_spans() and time.monotonic() < deadline:
        time.sleep(0.005)
    span = by_name(memory)["target.forward"]
    assert span.attributes["tracing.device.duration"] >= 0.002  # seconds; no unit in the key
    assert span.attributes["tracing.timing.mode"] == "events"
    assert "tracing.device" not in span.attributes  # the device is the application's to name
    device = telemetry.stats.get("target.forward" + tracing.DEVICE_SUFFIX)
    assert device.count == 1 and device.total_s >= 0.002
    # The span keeps its host end time, not the time the resolver ended it.
    host = telemetry.stats.get("target.forward")
    assert span.end_time - span.start_time == pytest.approx(host.total_s * 1e9, rel=1e-6)


def test_a_busy_device_does_not_hold_up_another_and_events_are_released(memory):
    clock = tracing.HostClock(auto_complete=False)
    setup_memory(memory, cuda_timing="events", device_clock=clock)
    with tracing.phase("slow", device="cuda:0"):
        pass
    with tracing.phase("fast", device="cuda:1"):
        pass
    for event in clock.events[2:]:  # cuda:1's pair completes, cuda:0's (older) does not
        event.done = True
    deadline = time.monotonic() + 2.0
    while not memory.get_finished_spans() and time.monotonic() < deadline:
        time.sleep(0.005)
    # Each phase ends after its device-time child (tests/tracing/test_device_spans.py).
    assert [s.name for s in memory.get_finished_spans()] == ["fast.device", "fast"]
    # The anchor taken for cuda:1 and the start event go back to the clock for reuse;
    # the end event is the device's next anchor.
    assert clock.released == 2
    clock.complete_all()
    while len(memory.get_finished_spans()) < 4 and time.monotonic() < deadline:
        time.sleep(0.005)
    names = [s.name for s in memory.get_finished_spans()]
    assert names == ["fast.device", "fast", "slow.device", "slow"]


def test_unresolved_events_are_reported_at_shutdown(memory):
    clock = tracing.HostClock(auto_complete=False)
    telemetry = setup_memory(memory, cuda_timing="events", device_clock=clock)
    with tracing.phase("target.forward", device="cuda:0"):
        pass
    report = telemetry.shutdown(timeout_s=0.5)
    assert report.device_unresolved == 1
    assert [s.name for s in memory.get_finished_spans()] == ["target.forward"]


def test_sync_mode_synchronizes_both_ends(memory):
    clock = tracing.HostClock()
    setup_memory(memory, cuda_timing="sync", device_clock=clock)
    with tracing.phase("drafter.step", device="cuda:1"):
        pass
    with tracing.phase("cpu.only"):  # no device: no synchronization
        pass
    assert clock.synchronize_calls == 2
    assert by_name(memory)["drafter.step"].attributes["tracing.timing.mode"] == "sync"


@pytest.mark.slow  # imports torch
def test_device_timing_without_cuda_warns_and_falls_back(memory):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.warns(RuntimeWarning, match="cuda_timing='events'"):
        setup_memory(memory, cuda_timing="events")
    with tracing.phase("target.forward", device="cuda:0"):
        pass
    assert "tracing.device.duration" not in by_name(memory)["target.forward"].attributes
