"""The model-independent machinery: stop-aware queues, barrier, stage threads."""

from __future__ import annotations

import threading
import time

import pytest

from dflash.pipeline.queues import (
    BoundedQueue,
    PipelineCounters,
    PipelineError,
    StageGroup,
    StageThread,
    StopAwareBarrier,
    Stopped,
)


def _run_in_thread(fn) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, errors


def test_queue_is_fifo_and_reports_depth_at_get() -> None:
    q: BoundedQueue[int] = BoundedQueue("q", 3, threading.Event())
    for i in range(3):
        q.put(i)
    assert q.get_with_depth() == (0, 3)
    assert q.get_with_depth() == (1, 2)
    assert q.get() == 2


def test_queue_size_below_one_is_rejected() -> None:
    with pytest.raises(ValueError, match="batch_queue size must be >= 1, got 0"):
        BoundedQueue("batch_queue", 0, threading.Event())


@pytest.mark.parametrize("blocking_call", ["get", "put"])
def test_blocked_get_and_put_wake_on_stop(blocking_call: str) -> None:
    stop = threading.Event()
    q: BoundedQueue[int] = BoundedQueue("q", 1, stop)
    if blocking_call == "put":
        q.put(0)  # full: the next put blocks
    thread, errors = _run_in_thread(q.get if blocking_call == "get" else lambda: q.put(1))
    time.sleep(0.2)
    assert thread.is_alive(), "the call should block while the queue is empty/full"
    start_s = time.monotonic()
    stop.set()
    thread.join(2.0)
    assert not thread.is_alive()
    assert time.monotonic() - start_s < 0.5
    assert len(errors) == 1 and isinstance(errors[0], Stopped)


def test_barrier_releases_all_parties_and_is_reusable() -> None:
    stop = threading.Event()
    barrier = StopAwareBarrier(3, stop)
    arrivals: list[int] = []
    lock = threading.Lock()

    def party() -> None:
        for _ in range(5):
            index = barrier.wait()
            with lock:
                arrivals.append(index)

    threads = [_run_in_thread(party) for _ in range(3)]
    for thread, errors in threads:
        thread.join(5.0)
        assert not thread.is_alive() and not errors
    assert sorted(arrivals) == sorted([0, 1, 2] * 5)


def test_barrier_waiter_raises_stopped_when_a_party_never_arrives() -> None:
    stop = threading.Event()
    barrier = StopAwareBarrier(2, stop)
    thread, errors = _run_in_thread(barrier.wait)
    time.sleep(0.1)
    stop.set()
    thread.join(2.0)
    assert not thread.is_alive()
    assert isinstance(errors[0], Stopped)


class _Raiser(StageThread):
    def loop(self) -> None:
        self.enter("target.forward")
        raise RuntimeError("device on fire\nsecond line is dropped")


class _Waiter(StageThread):
    def __init__(self, name: str, group: StageGroup, q: BoundedQueue[int]):
        super().__init__(name, group)
        self.q = q

    def loop(self) -> None:
        while True:
            self.enter("hs_queue.wait")
            self.q.get()


def test_failure_stops_every_stage_and_names_thread_phase_and_error() -> None:
    group = StageGroup()
    q: BoundedQueue[int] = BoundedQueue("hs_queue", 1, group.stop)
    waiters = [_Waiter(f"drafter-{i}", group, q) for i in range(2)]
    _Raiser("target-0", group)
    start_s = time.monotonic()
    group.start()
    group.wait()
    assert group.shutdown(timeout_s=2.0) == []
    assert time.monotonic() - start_s < 2.0
    assert all(w.phase == "stopped" for w in waiters)
    with pytest.raises(PipelineError) as info:
        group.raise_if_failed()
    message = str(info.value)
    assert message == "thread 'target-0' failed in target.forward: RuntimeError: device on fire"
    assert "\n" not in message
    assert "Traceback" in info.value.traceback_text


def test_threads_are_named_daemons() -> None:
    group = StageGroup()
    stage = _Waiter("drafter-0", group, BoundedQueue("q", 1, group.stop))
    assert stage.name == "drafter-0" and stage.daemon


class _Stuck(StageThread):
    def loop(self) -> None:
        self.enter("data.next_batch")
        while not self.stop_event.is_set():
            time.sleep(0.01)


def test_watchdog_fails_a_stage_stuck_in_one_phase() -> None:
    group = StageGroup()
    _Stuck("prefetch", group)
    group.start()
    group.wait(stall_timeout_s=0.3)
    assert group.shutdown(2.0) == []
    with pytest.raises(PipelineError, match="'prefetch' failed in data.next_batch: TimeoutError"):
        group.raise_if_failed()


def test_counters_rates_and_depths() -> None:
    counters = PipelineCounters()
    counters.add_target(100)
    counters.add_drafter(60)
    counters.add_drafter(60)
    for depth in (0, 2, 4):
        counters.queue_depth("hs_queue", depth)
    time.sleep(0.01)
    snap = counters.snapshot()
    assert (snap.target_tokens, snap.drafter_tokens, snap.drafter_steps) == (100, 120, 2)
    assert snap.queue_depths["hs_queue"] == (4, 2.0, 4)
    assert snap.drafter_tokens_per_s == pytest.approx(120 / snap.elapsed_s)
    counters.stop_clock()
    frozen_s = counters.snapshot().elapsed_s
    time.sleep(0.02)
    assert counters.snapshot().elapsed_s == frozen_s
