"""The pipeline stages with synthetic work: faults, stalls, spans, counters, order."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import pytest

from dflash import names
from dflash.pipeline.queues import PipelineError
from dflash.pipeline.stages import Pipeline


@dataclass(frozen=True)
class FakeBatch:
    batch_id: int
    num_tokens: int = 10


def build(
    n: int = 8, forward=None, step=None, make_batch=FakeBatch, targets=1, drafters=1, record=None
) -> Pipeline:
    def default_step(batch, target_out, phase):
        with phase("drafter.loss"):
            return target_out

    return Pipeline.build(
        make_batch=make_batch,
        indices=range(n),
        forwards=[("cpu", forward or (lambda b: b.batch_id * 10))] * targets,
        steps=[("cpu", step or default_step, None)] * drafters,
        on_step=record or (lambda *a: None),
        batch_queue_size=2,
        hs_queue_size=2,
    )


def test_single_threads_deliver_every_batch_in_order() -> None:
    seen: list[tuple[int, int, int, int]] = []
    pipe = build(n=10, record=lambda r, n, b, res: seen.append((r, n, b.batch_id, res)))
    assert pipe.run() == []
    pipe.raise_if_failed()
    assert seen == [(0, i, i, i * 10) for i in range(10)]
    snap = pipe.counters.snapshot()
    assert (snap.target_tokens, snap.drafter_tokens, snap.drafter_steps) == (100, 100, 10)
    assert set(snap.queue_depths) == {"batch_queue", "hs_queue"}
    assert all(peak <= 2 for _, _, peak in snap.queue_depths.values())


def test_many_threads_deliver_every_batch_once() -> None:
    seen: list[int] = []
    lock = threading.Lock()

    def record(replica, n, batch, result):
        with lock:
            seen.append(batch.batch_id)

    pipe = build(n=30, targets=3, drafters=2, record=record)
    assert pipe.run() == []
    pipe.raise_if_failed()
    assert sorted(seen) == list(range(30))


def _assert_fails_fast(pipe: Pipeline, pattern: str, limit_s: float = 2.0) -> list[str]:
    start_s = time.monotonic()
    stuck = pipe.run()
    assert time.monotonic() - start_s < limit_s
    with pytest.raises(PipelineError) as info:
        pipe.raise_if_failed()
    assert re.fullmatch(pattern, str(info.value)), str(info.value)
    return stuck


def test_target_thread_raising_stops_everything_with_its_name_and_phase() -> None:
    def forward(batch):
        if batch.batch_id == 3:
            raise RuntimeError("CUDA error: device-side assert")
        return 0

    pipe = build(n=100, forward=forward, targets=2, drafters=2)
    msg = r"thread 'target-[01]' failed in target.forward: RuntimeError: CUDA error: device-side"
    msg += " assert"
    stuck = _assert_fails_fast(pipe, msg)
    assert stuck == [] and not any(s.is_alive() for s in pipe.group.stages)


def test_drafter_thread_raising_names_the_trainer_phase() -> None:
    def step(batch, target_out, phase):
        with phase("drafter.anchor_selection"):
            pass
        with phase("drafter.loss"):
            if batch.batch_id == 2:
                raise ValueError("loss is nan")
        return 0.0

    pipe = build(n=50, step=step)
    stuck = _assert_fails_fast(
        pipe, r"thread 'drafter-0' failed in drafter\.loss: ValueError: loss is nan"
    )
    assert stuck == []


def test_stalled_producer_is_reported_and_never_hangs() -> None:
    release = threading.Event()

    def make_batch(index):
        if index == 2:
            release.wait(30)  # a data source that hangs
        return FakeBatch(index)

    pipe = build(n=10, make_batch=make_batch)
    start_s = time.monotonic()
    stuck = pipe.run(stall_timeout_s=0.5)
    elapsed_s = time.monotonic() - start_s
    release.set()
    assert elapsed_s < 0.5 + 2.0 + 1.0
    assert stuck == ["prefetch"]  # it cannot be interrupted; it is a daemon and is reported
    with pytest.raises(
        PipelineError, match=r"^thread 'prefetch' failed in data.batch: TimeoutError"
    ):
        pipe.raise_if_failed()


@pytest.fixture
def spans():
    """Real tracing into the SDK's in-memory exporter; the finished spans, by call."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    import tracing

    exporter = InMemorySpanExporter()
    tracing.setup(tracing.TracingConfig(), span_processors=[SimpleSpanProcessor(exporter)])
    yield exporter.get_finished_spans
    tracing.shutdown(timeout_s=1.0)


def test_one_trace_per_batch_with_waits_under_the_batch_they_received(spans) -> None:
    import tracing

    pipe = build(n=5, targets=2)
    pipe.run()
    pipe.raise_if_failed()
    finished = spans()
    roots = [s for s in finished if s.name == names.BATCH]
    assert sorted(r.attributes[names.BATCH_ID] for r in roots) == list(range(5))
    assert len({r.context.trace_id for r in roots}) == 5
    by_id = {s.context.span_id: s for s in finished}
    for root in roots:
        trace = [s for s in finished if s.context.trace_id == root.context.trace_id]
        parents = {s.name: by_id[s.parent.span_id].name for s in trace if s.parent is not None}
        # The trainer's phases are opened without a parent: they nest under drafter.step.
        assert parents == {
            names.DATA_BATCH: names.BATCH,
            names.BATCH_QUEUE_WAIT: names.BATCH,
            names.TARGET_FORWARD: names.BATCH,
            names.HS_QUEUE_PUT: names.BATCH,
            names.HS_QUEUE_WAIT: names.BATCH,
            names.DRAFTER_STEP: names.BATCH,
            names.LOSS: names.DRAFTER_STEP,
        }
        named = {s.name: s for s in trace}
        for wait in (names.BATCH_QUEUE_WAIT, names.HS_QUEUE_WAIT):
            assert names.QUEUE_DEPTH in named[wait].attributes
            assert named[wait].start_time <= named[wait].end_time
        assert named[names.DRAFTER_STEP].end_time <= root.end_time
    # Time blocked on hs_queue.put feeds the tables (the verdict) and is in each trace:
    # the target waiting on the drafter, beside the drafter waiting on the target.
    assert tracing.get_stats().snapshot().phases[names.HS_QUEUE_PUT].count == 5
    assert [s.name for s in finished].count(names.HS_QUEUE_PUT) == 5


def test_failing_batch_trace_is_ended_with_the_error(spans) -> None:
    from opentelemetry.trace import StatusCode

    def forward(batch):
        raise KeyError("layer 7")

    pipe = build(n=3, forward=forward)
    pipe.run()
    first = next(s for s in spans() if s.name == names.BATCH)
    assert first.status.status_code == StatusCode.ERROR and first.end_time is not None
    assert any(e.name == "exception" for e in first.events)


def test_snapshot_is_a_read_only_copy_with_queue_depths() -> None:
    pipe = build(n=6)
    pipe.run()
    snap = pipe.snapshot()
    assert snap.drafter_steps == 6 and snap.queued_now == {"batch_queue": 0, "hs_queue": 0}
    with pytest.raises(AttributeError):
        snap.drafter_steps = 0  # type: ignore[misc]


def test_first_signal_stops_the_stages_and_handlers_are_restored() -> None:
    from dflash.signals import SignalStop

    stop = threading.Event()
    before = signal.getsignal(signal.SIGTERM)
    with SignalStop(stop) as signals:
        os.kill(os.getpid(), signal.SIGTERM)
        deadline_s = time.monotonic() + 2
        while not stop.is_set() and time.monotonic() < deadline_s:
            time.sleep(0.01)
    assert stop.is_set() and signals.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.slow
def test_second_ctrl_c_exits_at_once_with_130() -> None:
    code = (
        "import os, signal, threading, time\n"
        "from dflash.signals import SignalStop\n"
        "with SignalStop(threading.Event()):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(0.2)\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(10)\n"
        "print('not reached')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    # os._exit(130) in the handler: the 10 s sleep and the print never happen.
    assert proc.returncode == 130, proc.stderr
    assert "not reached" not in proc.stdout
