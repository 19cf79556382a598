"""Device timing: clocks that record device events, and the thread that resolves them.

`CudaClock` uses torch.cuda events (torch is imported here only); `HostClock` is a
host-clock stand-in, so the resolution path runs, and is tested, without a GPU.

A device event has no time of its own, only a distance to another event of its device.
The resolver places a phase's events on the host clock (`now_ns`) from an anchor, an
event whose host time is known (`DeviceClock.anchor`, taken once per device), then
chains: each resolved end event becomes the device's next anchor, so the distances
stay short (CUDA gives them as float milliseconds, which lose microseconds over hours).
Each placed interval is kept where its events must lie, after the host recorded the
start and before the resolver saw the end complete, its device duration unchanged:
the drift between the two clocks never accumulates.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from tracing.clock import now_ns
from tracing.config import call_logged, warn_once

logger = logging.getLogger("tracing")

# Any: a clock's timing event (a torch.cuda.Event, a test clock's own): opaque here, only
# handed back to the clock that recorded it.
DeviceEvent = Any


class DeviceClock(Protocol):
    """`applies_to(device)`: whether phases on it get device timing (not on a CPU device).
    `anchor(device)`: an event recorded now and the host time (`now_ns`) at which it
    completed; it may wait for the device's queued work. `elapsed_s(a, b)` may be
    negative (b before a). Thread contract: `record`/`synchronize` run on the phase's
    thread, `anchor`, `query`, `elapsed_s` and `release` (the events may be recorded
    again) on the resolver thread."""

    def applies_to(self, device: object) -> bool: ...
    def record(self, device: object) -> DeviceEvent: ...
    def query(self, event: DeviceEvent) -> bool: ...
    def elapsed_s(self, start: DeviceEvent, end: DeviceEvent) -> float: ...
    def release(self, device: object, *events: DeviceEvent) -> None: ...
    def synchronize(self, device: object) -> None: ...
    def anchor(self, device: object) -> tuple[DeviceEvent, int]: ...


EVENT_POOL_SIZE = 256
"""Free events kept per device for reuse: creating a CUDA event costs a driver call
at every device-timed phase, re-recording a completed one does not."""


class CudaClock:
    """torch.cuda events on the device's current stream, reused once resolved."""

    def __init__(self) -> None:
        import torch

        self._torch: Any = torch  # torch's own stubs do not take the device as given
        self._applies: dict[object, bool] = {}
        # device -> completed events; deque append/pop are atomic across the two threads.
        self._free: dict[object, deque[DeviceEvent]] = {}

    def applies_to(self, device: object) -> bool:
        known = self._applies.get(device)
        if known is None:
            known = self._applies[device] = self._torch.device(device).type == "cuda"
        return known

    def record(self, device: object) -> DeviceEvent:
        free = self._free.get(device)
        try:
            # (mypy ignore below) None raises AttributeError: one lookup on the hot path
            event = free.pop()  # type: ignore[union-attr]
        except (AttributeError, IndexError):
            event = self._torch.cuda.Event(enable_timing=True)
        event.record(self._torch.cuda.current_stream(device))
        return event

    def release(self, device: object, *events: DeviceEvent) -> None:
        free = self._free.setdefault(device, deque())
        if len(free) < EVENT_POOL_SIZE:
            free.extend(events)

    def query(self, event: DeviceEvent) -> bool:
        return bool(event.query())

    def elapsed_s(self, start: DeviceEvent, end: DeviceEvent) -> float:
        return float(start.elapsed_time(end)) / 1e3

    def synchronize(self, device: object) -> None:
        self._torch.cuda.synchronize(device)

    def anchor(self, device: object) -> tuple[DeviceEvent, int]:
        # On the device's default stream, which waits for its other (blocking) streams:
        # the event completes when the queued work has, and the host sees that within
        # microseconds of it.
        event = self._torch.cuda.Event(enable_timing=True)
        event.record(self._torch.cuda.default_stream(device))
        event.synchronize()
        return event, now_ns()


@dataclass(slots=True)
class HostEvent:
    time_ns: int
    done: bool


class HostClock:
    """Host-clock fake: an event "completes" when the test says so (or at once)."""

    def __init__(self, auto_complete: bool = True) -> None:
        self.auto_complete = auto_complete
        self.events: list[HostEvent] = []
        self.synchronize_calls = self.released = 0

    def applies_to(self, device: object) -> bool:
        return device is not None

    def record(self, device: object) -> HostEvent:
        event = HostEvent(time.perf_counter_ns(), self.auto_complete)
        self.events.append(event)
        return event

    def complete_all(self) -> None:
        for event in self.events:
            event.done = True

    def query(self, event: HostEvent) -> bool:
        return event.done

    def elapsed_s(self, start: HostEvent, end: HostEvent) -> float:
        return (end.time_ns - start.time_ns) / 1e9

    def release(self, device: object, *events: HostEvent) -> None:
        self.released += len(events)

    def synchronize(self, device: object) -> None:
        self.synchronize_calls += 1

    def anchor(self, device: object) -> tuple[HostEvent, int]:
        # perf_counter and now_ns are both monotonic; one pair of reads relates them.
        return HostEvent(time.perf_counter_ns(), True), now_ns()


def cuda_clock_or_none(mode: str) -> CudaClock | None:
    """A CudaClock for `sync`/`events`, or None (with one warning) when CUDA is absent."""
    try:
        import torch

        if torch.cuda.is_available():
            return CudaClock()
    except ImportError:
        pass
    message = f"tracing: cuda_timing={mode!r} needs CUDA, which is not available; using 'off'"
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    return None


@dataclass(frozen=True, slots=True)
class DeviceTiming:
    """A phase's device time: `seconds` between its events, and where they lie on the
    host clock (`now_ns` nanoseconds; None when the device could not be anchored)."""

    seconds: float
    start_ns: int | None = None
    end_ns: int | None = None


OnResolved = Callable[[DeviceTiming | None], None]  # None: not resolved (stopped)
# (start event, end event, host ns the start event was recorded no earlier than, callback)
_Pending = tuple[DeviceEvent, DeviceEvent, int, OnResolved]


class EventResolver:
    """One daemon thread that waits for event pairs to complete, then calls back (with
    None for a pair not resolved before `stop`). `submit` never blocks; callbacks run on
    the resolver thread. Pairs wait in one queue per device: a device's events complete
    in the order they were recorded (one stream), so each queue is polled at its head,
    and a busy device never holds up the timings of another."""

    def __init__(self, clock: DeviceClock, poll_interval_s: float = 0.001) -> None:
        self.clock = clock
        self._poll_interval_s = poll_interval_s
        self._queues: dict[object, deque[_Pending]] = {}
        # device -> (an event, its host time): the resolver thread's alone.
        self._anchors: dict[object, tuple[DeviceEvent, int]] = {}
        self._queues_lock = threading.Lock()  # adding a device's queue (rare)
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="tracing-device-resolver", daemon=True
        )
        self._thread.start()

    def submit(
        self,
        start: DeviceEvent,
        end: DeviceEvent,
        on_resolved: OnResolved,
        device: object = None,
        not_before_ns: int = 0,
    ) -> None:
        """`not_before_ns`: a host time (`now_ns`) no later than the recording of `start`."""
        queue = self._queues.get(device)
        if queue is None:
            with self._queues_lock:
                queue = self._queues.setdefault(device, deque())
        queue.append((start, end, not_before_ns, on_resolved))
        if not self._wake.is_set():
            self._wake.set()

    @property
    def pending(self) -> int:
        return sum(len(queue) for queue in list(self._queues.values()))

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.pending:
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            if not self._resolve_ready():
                time.sleep(self._poll_interval_s)

    def _resolve_ready(self) -> bool:
        """Resolves the completed pairs at each queue's head; False when there were none."""
        progressed = False
        for device, queue in list(self._queues.items()):
            while queue:
                start, end, not_before_ns, callback = queue[0]
                timing: DeviceTiming | None
                try:
                    if not self.clock.query(end):
                        break
                    seen_ns = now_ns()  # the end event completed before this
                    timing = self._place(device, start, end, not_before_ns, seen_ns)
                except Exception:  # a broken event must not stall the others
                    logger.exception("tracing: device event could not be resolved")
                    timing = None
                queue.popleft()
                call_logged(callback, timing)
                progressed = True
        return progressed

    def _place(
        self, device: object, start: DeviceEvent, end: DeviceEvent, not_before_ns: int, seen_ns: int
    ) -> DeviceTiming:
        """The pair's device time on the host clock; `end` becomes the device's anchor."""
        clock = self.clock
        seconds = clock.elapsed_s(start, end)
        anchor = self._anchors.get(device)
        if anchor is None:
            try:
                anchor = self._anchors[device] = clock.anchor(device)
            except Exception as exc:  # the seconds still count; the span has no place
                warn_once(f"anchor {device}", f"device {device} not anchored: {exc!r}")
                clock.release(device, start, end)
                return DeviceTiming(seconds)
        anchor_event, anchor_ns = anchor
        duration_ns = round(seconds * 1e9)
        start_ns = anchor_ns + round(clock.elapsed_s(anchor_event, start) * 1e9)
        # Where the events must lie: the clocks' drift is taken out at every pair.
        start_ns = max(min(start_ns, seen_ns - duration_ns), not_before_ns)
        end_ns = start_ns + duration_ns
        self._anchors[device] = (end, end_ns)
        clock.release(device, anchor_event, start)
        return DeviceTiming(seconds, start_ns, end_ns)

    def stop(self, timeout_s: float) -> int:
        """Resolves what completes within `timeout_s`, ends the rest without device time;
        returns how many those were."""
        deadline = time.monotonic() + timeout_s
        while self.pending and time.monotonic() < deadline:
            time.sleep(self._poll_interval_s)
        self._stop.set()
        self._wake.set()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        left = 0
        for queue in list(self._queues.values()):
            while queue:
                *_, callback = queue.popleft()
                call_logged(callback, None)
                left += 1
        return left
