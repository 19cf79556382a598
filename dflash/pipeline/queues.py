"""Model-independent pipeline machinery: stop-aware queues, barrier, stage threads.

Shaped like the OpenTelemetry batch span processor (bounded queues, named daemon
threads, a stop `Event`, `shutdown(timeout_s)` that joins), except that training
fails loudly: an exception in any stage sets the shared stop event, every other
stage wakes from its blocking call within `POLL_S`, and the first failure reaches
the caller as a `PipelineError`.

Nothing here blocks without a timeout: every wait polls the stop event, so one
failing thread can never leave another waiting forever.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from dflash.errors import first_line

T = TypeVar("T")

SHUTDOWN_TIMEOUT_S = 2.0  # every stage stops this soon after another one fails

# How often a blocked get/put/barrier looks at the stop event. Small against the
# 2 s stop budget, large enough that idle waiting costs nothing measurable.
POLL_S = 0.05


@contextmanager
def _blocked() -> Iterator[None]:
    """Mark the calling stage as waiting: time blocked on a queue or barrier is another
    stage's slowness, not a stall of this one. Leaving the wait counts as progress."""
    stage = threading.current_thread()
    if not isinstance(stage, StageThread):
        yield
        return
    before = stage.waiting
    stage.waiting = True
    try:
        yield
    finally:
        stage.waiting = before
        stage.phase_since_s = time.monotonic()


class Stopped(Exception):
    """Raised out of a blocking call because the pipeline's stop event was set."""


class PipelineError(RuntimeError):
    """A stage thread failed; the message is one line naming thread, phase and error."""

    def __init__(
        self,
        thread: str,
        phase: str,
        error: BaseException,
        traceback_text: str = "",
        log_path: str | None = None,
    ):
        self.thread = thread
        self.phase = phase
        self.error = error
        self.traceback_text = traceback_text
        self.log_path = log_path
        detail = first_line(error)
        name = type(error).__name__
        what = name if detail == name else f"{name}: {detail}"
        where = f" (traceback in {log_path})" if log_path else ""
        super().__init__(f"thread {thread!r} failed in {phase}: {what}{where}")

    def with_log(self, log_path: str) -> PipelineError:
        return PipelineError(self.thread, self.phase, self.error, self.traceback_text, log_path)


class BoundedQueue(Generic[T]):
    """A bounded FIFO whose blocking `get`/`put` give up with `Stopped` once `stop` is set."""

    def __init__(self, name: str, maxsize: int, stop: threading.Event):
        if maxsize < 1:
            raise ValueError(f"{name} size must be >= 1, got {maxsize}")
        self.name = name
        self.maxsize = maxsize
        self._stop = stop
        self._queue: queue.Queue[T] = queue.Queue(maxsize)

    def put(self, item: T) -> None:
        with _blocked():
            self._put(item)

    def _put(self, item: T) -> None:
        while True:
            if self._stop.is_set():
                raise Stopped(self.name)
            try:
                self._queue.put(item, timeout=POLL_S)
                return
            except queue.Full:
                continue

    def get_with_depth(self) -> tuple[T, int]:
        """Next item and the queue depth seen just before taking it (a starvation signal)."""
        with _blocked():
            return self._get_with_depth()

    def _get_with_depth(self) -> tuple[T, int]:
        while True:
            if self._stop.is_set():
                raise Stopped(self.name)
            depth = self._queue.qsize()
            try:
                return self._queue.get(timeout=POLL_S), depth
            except queue.Empty:
                continue

    def get(self) -> T:
        return self.get_with_depth()[0]

    def qsize(self) -> int:
        return self._queue.qsize()

    def drain(self) -> list[T]:
        """Take everything queued now without blocking (after the consumers stopped)."""
        items = []
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                return items


class StopAwareBarrier:
    """A reusable barrier for `parties` threads that raises `Stopped` instead of hanging.

    Once a generation trips, every thread of it passes, even if stop is set a moment
    later; so replicas either all complete a step or all abandon it.
    """

    def __init__(self, parties: int, stop: threading.Event):
        if parties < 1:
            raise ValueError(f"barrier needs >= 1 party, got {parties}")
        self.parties = parties
        self._stop = stop
        self._cond = threading.Condition()
        self._count = 0
        self._generation = 0

    def wait(self) -> int:
        """Block until all parties arrive; returns the arrival index (0 = first)."""
        with _blocked(), self._cond:
            generation = self._generation
            index = self._count
            self._count += 1
            if self._count == self.parties:
                self._count = 0
                self._generation += 1
                self._cond.notify_all()
                return index
            while self._generation == generation:
                if self._stop.is_set():
                    raise Stopped("barrier")
                self._cond.wait(POLL_S)
            return index


@dataclass(frozen=True)
class StageFailure:
    thread: str
    phase: str
    error: BaseException
    traceback_text: str

    def to_error(self) -> PipelineError:
        return PipelineError(self.thread, self.phase, self.error, self.traceback_text)


class StageThread(threading.Thread):
    """A named daemon thread running `loop()`; failures go to the owning `StageGroup`.

    Subclasses call `self.enter(phase)` before each unit of work so a failure or a
    stall names what the thread was doing, and so the watchdog sees progress. Time
    blocked in a `BoundedQueue` or `StopAwareBarrier` never counts as a stall.
    """

    def __init__(self, name: str, group: StageGroup):
        super().__init__(name=name, daemon=True)
        self.group = group
        self.stop_event = group.stop
        self.phase = "start"
        self.phase_since_s = time.monotonic()
        self.waiting = False  # set by _blocked() while in a queue or barrier
        group.add(self)

    def enter(self, phase: str) -> None:
        self.phase = phase
        self.phase_since_s = time.monotonic()

    def loop(self) -> None:
        raise NotImplementedError

    def run(self) -> None:
        try:
            self.loop()
            self.enter("done")
        except Stopped:
            self.enter("stopped")
        except BaseException as exc:  # any failure must reach the caller
            self.group.fail(self.name, self.phase, exc, traceback.format_exc())


@dataclass
class StageGroup:
    """The stages of one pipeline, their shared stop event and the first failure."""

    stop: threading.Event = field(default_factory=threading.Event)
    stages: list[StageThread] = field(default_factory=list)
    failure: StageFailure | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, stage: StageThread) -> None:
        self.stages.append(stage)

    def start(self) -> None:
        for stage in self.stages:
            stage.start()

    def fail(self, thread: str, phase: str, error: BaseException, traceback_text: str) -> None:
        with self._lock:
            if self.failure is None:
                self.failure = StageFailure(thread, phase, error, traceback_text)
        self.stop.set()

    def alive(self) -> list[StageThread]:
        return [s for s in self.stages if s.is_alive()]

    def wait(self, stall_timeout_s: float | None = None, tick: Callable[[], None] | None = None):
        """Block until every stage ends or the stop event is set.

        With `stall_timeout_s`, a stage that sits in one non-waiting phase longer than
        that fails the pipeline: a hung data source or device must not hang the run.
        `tick` runs on every poll (the caller's signal checks, reporting).
        """
        while not self.stop.is_set() and self.alive():
            time.sleep(POLL_S)
            if tick is not None:
                tick()
            if stall_timeout_s is not None:
                self._check_stall(stall_timeout_s)

    def _check_stall(self, stall_timeout_s: float) -> None:
        now_s = time.monotonic()
        for stage in self.alive():
            stalled_s = now_s - stage.phase_since_s
            if not stage.waiting and stalled_s > stall_timeout_s:
                error = TimeoutError(f"no progress for {stalled_s:.1f} s (stall timeout)")
                self.fail(stage.name, stage.phase, error, "")
                return

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> list[str]:
        """Set stop, join every stage within `timeout_s` in all; names of stages still alive."""
        self.stop.set()
        deadline_s = time.monotonic() + timeout_s
        for stage in self.stages:
            if stage.is_alive():
                stage.join(max(0.0, deadline_s - time.monotonic()))
        return [s.name for s in self.alive()]

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise self.failure.to_error() from self.failure.error


@dataclass(frozen=True)
class CounterSnapshot:
    """Cumulative throughput since the counters started (rates are over `elapsed_s`)."""

    elapsed_s: float
    target_tokens: int
    drafter_tokens: int
    target_batches: int
    drafter_steps: int
    # Per queue: depth seen at the last get, mean depth seen at get, and max.
    queue_depths: dict[str, tuple[int, float, int]]
    # Per queue: items queued at the moment of the snapshot.
    queued_now: Mapping[str, int] = field(default_factory=dict)

    @property
    def target_tokens_per_s(self) -> float:
        return self.target_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def drafter_tokens_per_s(self) -> float:
        return self.drafter_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


class PipelineCounters:
    """Thread-safe tokens and queue depths, read by reporting code through `snapshot()`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._start_s = time.monotonic()
        self._end_s: float | None = None
        self._target_tokens = 0
        self._drafter_tokens = 0
        self._target_batches = 0
        self._drafter_steps = 0
        self._depth: dict[str, list[int]] = {}  # name -> [last, sum, count, max]

    def restart_clock(self) -> None:
        with self._lock:
            self._start_s = time.monotonic()
            self._end_s = None

    def stop_clock(self) -> None:
        """Freeze `elapsed_s`: rates read after the run ends stay those of the run."""
        with self._lock:
            self._end_s = time.monotonic()

    def add_target(self, num_tokens: int) -> None:
        with self._lock:
            self._target_tokens += num_tokens
            self._target_batches += 1

    def add_drafter(self, num_tokens: int, steps: int = 1) -> None:
        with self._lock:
            self._drafter_tokens += num_tokens
            self._drafter_steps += steps

    def queue_depth(self, name: str, depth: int) -> None:
        with self._lock:
            entry = self._depth.setdefault(name, [0, 0, 0, 0])
            entry[0] = depth
            entry[1] += depth
            entry[2] += 1
            entry[3] = max(entry[3], depth)

    def snapshot(self, queued_now: Mapping[str, int] | None = None) -> CounterSnapshot:
        """A read-only copy; `queued_now` (the caller's queue sizes) is passed through."""
        with self._lock:
            depths = {
                name: (last, total / count if count else 0.0, peak)
                for name, (last, total, count, peak) in self._depth.items()
            }
            return CounterSnapshot(
                elapsed_s=(self._end_s or time.monotonic()) - self._start_s,
                target_tokens=self._target_tokens,
                drafter_tokens=self._drafter_tokens,
                target_batches=self._target_batches,
                drafter_steps=self._drafter_steps,
                queue_depths=depths,
                queued_now=dict(queued_now or {}),
            )
