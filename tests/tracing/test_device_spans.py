"""`events` timing without a GPU: a fake device clock, injected where tracing takes its
device timing source (`tracing.setup(device_clock=...)`, the DeviceClock Protocol),
whose events complete at device times the test chooses. The real SDK records the spans
into an in-memory exporter: the device time of a phase is a child span placed on the
host clock, parented to the phase."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest
from memory_setup import setup_memory
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import tracing
from tracing.clock import now_ns
from tracing.device import DeviceClock

MS = 1_000_000  # ns


@dataclass
class FakeEvent:
    device_ns: int | None = None  # set when the fake device reaches the event


@dataclass
class FakeDeviceClock:
    """A device whose clock reads `offset_ns` ahead of the host's (another epoch, as a
    GPU's timer has); `anchor_error_ns` is how far its anchor's host time is off (the
    drift since a real anchor was taken)."""

    offset_ns: int = 7_000_000_000_000
    anchor_error_ns: int = 0
    fail_anchor: bool = False
    events: list[FakeEvent] = field(default_factory=list)
    anchors: int = 0
    released: int = 0

    def applies_to(self, device: object) -> bool:
        return device is not None

    def record(self, device: object) -> FakeEvent:
        event = FakeEvent()
        self.events.append(event)
        return event

    def query(self, event: FakeEvent) -> bool:
        return event.device_ns is not None

    def elapsed_s(self, start: FakeEvent, end: FakeEvent) -> float:
        assert start.device_ns is not None and end.device_ns is not None
        return (end.device_ns - start.device_ns) / 1e9

    def release(self, device: object, *events: FakeEvent) -> None:
        self.released += len(events)

    def synchronize(self, device: object) -> None:
        pass

    def anchor(self, device: object) -> tuple[FakeEvent, int]:
        if self.fail_anchor:
            raise RuntimeError("device lost")
        self.anchors += 1
        host_ns = now_ns()
        return FakeEvent(host_ns + self.offset_ns), host_ns + self.anchor_error_ns

    def run(self, event: FakeEvent, host_ns: int) -> None:
        """The device reaches `event` when the host clock reads `host_ns`."""
        event.device_ns = host_ns + self.offset_ns


def _clock_fits_the_protocol(clock: FakeDeviceClock) -> DeviceClock:
    return clock  # mypy on this file checks the fake against the Protocol setup takes


def wait_for(exporter: InMemorySpanExporter, count: int) -> dict[str, ReadableSpan]:
    deadline = time.monotonic() + 2.0
    while len(exporter.get_finished_spans()) < count and time.monotonic() < deadline:
        time.sleep(0.002)
    spans = exporter.get_finished_spans()
    assert len(spans) == count, [s.name for s in spans]
    return {span.name: span for span in spans}


def run_phase(clock: FakeDeviceClock, name: str, start_ms: int, end_ms: int) -> int:
    """A device phase whose kernels run from `start_ms` to `end_ms` after its host start
    (past its host end: the device works after the launches); its host start."""
    with tracing.phase(name, device="cuda:0") as p:
        pass
    start, end = clock.events[-2:]
    time.sleep((end_ms + 2) / 1e3)  # the device gets there before the resolver looks
    clock.run(start, p.start_time_ns + start_ms * MS)
    clock.run(end, p.start_time_ns + end_ms * MS)
    return p.start_time_ns


def test_device_time_is_a_child_span_on_the_host_clock(memory: InMemorySpanExporter) -> None:
    clock = FakeDeviceClock()
    telemetry = setup_memory(
        memory, device_clock=_clock_fits_the_protocol(clock), cuda_timing="events"
    )
    host_start = run_phase(clock, "drafter.step", start_ms=1, end_ms=5)
    spans = wait_for(memory, 2)
    step, device = spans["drafter.step"], spans["drafter.step.device"]
    assert device.parent is not None and device.parent.span_id == step.context.span_id
    assert device.context.trace_id == step.context.trace_id
    # The device's events, mapped through the anchor onto the host clock, exactly.
    assert device.start_time == host_start + 1 * MS
    assert device.end_time == host_start + 5 * MS
    assert device.end_time > step.end_time  # the device finished after the host returned
    assert device.attributes["tracing.track"] == "device"
    assert step.attributes["tracing.device.duration"] == pytest.approx(0.004)
    assert telemetry.stats.get("drafter.step" + tracing.DEVICE_SUFFIX).total_s == pytest.approx(
        0.004
    )


def test_one_anchor_per_device_then_each_end_event_anchors_the_next(
    memory: InMemorySpanExporter,
) -> None:
    clock = FakeDeviceClock()
    setup_memory(memory, device_clock=clock, cuda_timing="events")
    first = run_phase(clock, "target.forward", start_ms=0, end_ms=3)
    wait_for(memory, 2)
    second = run_phase(clock, "drafter.step", start_ms=2, end_ms=4)
    spans = wait_for(memory, 4)
    assert clock.anchors == 1  # the device is anchored (a synchronization) once
    assert spans["target.forward.device"].start_time == first
    assert spans["drafter.step.device"].start_time == second + 2 * MS
    assert spans["drafter.step.device"].end_time == second + 4 * MS
    # Each pair releases the device's previous anchor and its own start event for reuse;
    # its end event is kept as the next anchor.
    assert clock.released == 4


def test_a_drifted_anchor_is_kept_within_where_the_events_must_lie(
    memory: InMemorySpanExporter,
) -> None:
    # Anchor 50 ms early: the start would map before the host even recorded it.
    clock = FakeDeviceClock(anchor_error_ns=-50 * MS)
    setup_memory(memory, device_clock=clock, cuda_timing="events")
    host_start = run_phase(clock, "drafter.step", start_ms=1, end_ms=5)
    device = wait_for(memory, 2)["drafter.step.device"]
    assert device.start_time == host_start  # no earlier than the host's record
    assert device.end_time - device.start_time == 4 * MS  # the device's own duration


def test_a_late_anchor_is_kept_no_later_than_the_end_was_seen(
    memory: InMemorySpanExporter,
) -> None:
    # Anchor 10 s late: the end would map after the resolver saw it complete.
    clock = FakeDeviceClock(anchor_error_ns=10_000 * MS)
    setup_memory(memory, device_clock=clock, cuda_timing="events")
    run_phase(clock, "drafter.step", start_ms=1, end_ms=5)
    device = wait_for(memory, 2)["drafter.step.device"]
    assert device.end_time <= now_ns()  # not 10 s ahead: no later than seen complete
    assert device.end_time - device.start_time == 4 * MS


def test_no_device_span_for_a_phase_not_sampled(memory: InMemorySpanExporter) -> None:
    clock = FakeDeviceClock()
    telemetry = setup_memory(memory, device_clock=clock, cuda_timing="events", sample_ratio=0.0)
    run_phase(clock, "drafter.step", start_ms=0, end_ms=2)
    deadline = time.monotonic() + 2.0
    name = "drafter.step" + tracing.DEVICE_SUFFIX
    while telemetry.stats.get(name) is None and time.monotonic() < deadline:
        time.sleep(0.002)
    assert telemetry.stats.get(name).count == 1  # the tables still get the device time
    assert memory.get_finished_spans() == ()


def test_a_device_that_cannot_be_anchored_keeps_its_seconds_without_a_span(
    memory: InMemorySpanExporter,
) -> None:
    clock = FakeDeviceClock(fail_anchor=True)
    setup_memory(memory, device_clock=clock, cuda_timing="events")
    run_phase(clock, "drafter.step", start_ms=0, end_ms=2)
    step = wait_for(memory, 1)["drafter.step"]
    assert step.attributes["tracing.device.duration"] == pytest.approx(0.002)
    assert clock.released == 2  # the pair still goes back for reuse


def test_the_host_clock_stand_in_places_device_spans_inside_the_phase(
    memory: InMemorySpanExporter,
) -> None:
    # HostClock's "device" is the host: its events lie inside the phase's host interval.
    setup_memory(memory, device_clock=tracing.HostClock(), cuda_timing="events")
    with tracing.phase("target.forward", device="cuda:0"):
        time.sleep(0.003)
    spans = wait_for(memory, 2)
    phase, device = spans["target.forward"], spans["target.forward.device"]
    # (within the microsecond between an event's record and the phase's clock read)
    assert phase.start_time <= device.start_time
    assert device.end_time <= phase.end_time + MS // 10
    assert device.end_time - device.start_time >= 3 * MS
