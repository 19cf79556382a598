"""Device timing: clocks that record device events, and the thread that resolves them.

`CudaClock` uses torch.cuda events (torch is imported here only); `HostClock` is a
host-clock stand-in, so the resolution path runs, and is tested, without a GPU.
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

from tracing.config import call_logged

logger = logging.getLogger("tracing")


class DeviceClock(Protocol):
    """`applies_to(device)`: whether phases on it get device timing (not on a CPU device).
    Thread contract: `record`/`synchronize` run on the phase's thread, `query`,
    `elapsed_s` and `release` (the events may be recorded again) on the resolver thread."""

    def applies_to(self, device: object) -> bool: ...
    def record(self, device: object) -> Any: ...
    def query(self, event: Any) -> bool: ...
    def elapsed_s(self, start: Any, end: Any) -> float: ...
    def release(self, device: object, *events: Any) -> None: ...
    def synchronize(self, device: object) -> None: ...


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
        self._free: dict[object, deque[Any]] = {}

    def applies_to(self, device: object) -> bool:
        known = self._applies.get(device)
        if known is None:
            known = self._applies[device] = self._torch.device(device).type == "cuda"
        return known

    def record(self, device: object) -> Any:
        free = self._free.get(device)
        try:
            # (mypy ignore below) None raises AttributeError: one lookup on the hot path
            event = free.pop()  # type: ignore[union-attr]
        except (AttributeError, IndexError):
            event = self._torch.cuda.Event(enable_timing=True)
        event.record(self._torch.cuda.current_stream(device))
        return event

    def release(self, device: object, *events: Any) -> None:
        free = self._free.setdefault(device, deque())
        if len(free) < EVENT_POOL_SIZE:
            free.extend(events)

    def query(self, event: Any) -> bool:
        return bool(event.query())

    def elapsed_s(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end)) / 1e3

    def synchronize(self, device: object) -> None:
        self._torch.cuda.synchronize(device)


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


OnResolved = Callable[[float | None], None]  # called with the device seconds, or None
_Pending = tuple[Any, Any, OnResolved]  # (start event, end event, on_resolved)


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
        self._queues_lock = threading.Lock()  # adding a device's queue (rare)
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="tracing-device-resolver", daemon=True
        )
        self._thread.start()

    def submit(self, start: Any, end: Any, on_resolved: OnResolved, device: object = None) -> None:
        queue = self._queues.get(device)
        if queue is None:
            with self._queues_lock:
                queue = self._queues.setdefault(device, deque())
        queue.append((start, end, on_resolved))
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
                start, end, callback = queue[0]
                try:
                    if not self.clock.query(end):
                        break
                    device_s = self.clock.elapsed_s(start, end)
                    self.clock.release(device, start, end)
                except Exception:  # a broken event must not stall the others
                    logger.exception("tracing: device event could not be resolved")
                    device_s = None
                queue.popleft()
                call_logged(callback, device_s)
                progressed = True
        return progressed

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
                _, _, callback = queue.popleft()
                call_logged(callback, None)
                left += 1
        return left
