"""The pipeline stages with synthetic work: faults, stalls, spans, counters, order."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest

from dflash.pipeline import Pipeline
from dflash.queues import PipelineError


@dataclass(frozen=True)
class FakeBatch:
    batch_id: int
    num_tokens: int = 10


def build(n: int = 8, forward=None, step=None, make_batch=FakeBatch, targets=1, drafters=1,
          telemetry=None, record=None) -> Pipeline:  # fmt: skip
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
        telemetry=telemetry,
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


class RecordingTelemetry:
    """Records (name, parent, start_time_ns, attributes) of every phase and span."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    @contextmanager
    def phase(self, name, *, level="phase", parent=None, start_time_ns=None, attributes=None,
              device=None):  # fmt: skip
        entry = {"name": name, "parent": parent, "start_ns": start_time_ns or time.time_ns(),
                 "attributes": dict(attributes or {})}  # fmt: skip
        with self.lock:
            self.spans.append(entry)
        yield
        entry["end_ns"] = time.time_ns()

    def record(self, name, seconds):
        with self.lock:
            self.spans.append({"name": name, "seconds": seconds, "stats_only": True})

    def close(self, log, gather_ranks):
        return None

    def start_span(self, name, attributes=None, *, level="step"):
        telemetry = self

        class Handle:
            context = object()
            start_time_ns = time.time_ns()

            def set_attribute(self, key, value):
                self.attributes[key] = value

            def record_exception(self, exc):
                self.error = exc

            def end(self, end_time_ns=None):
                self.end_ns = time.time_ns()

        handle = Handle()
        handle.attributes, handle.end_ns = dict(attributes or {}), None
        with telemetry.lock:
            telemetry.spans.append({"name": name, "handle": handle})
        return handle


def test_one_trace_per_batch_with_waits_under_the_batch_they_received() -> None:
    tel = RecordingTelemetry()
    pipe = build(n=5, telemetry=tel)
    pipe.run()
    pipe.raise_if_failed()
    roots = [s["handle"] for s in tel.spans if s["name"] == "batch"]
    assert [r.attributes["batch.id"] for r in roots] == list(range(5))
    assert all(r.end_ns is not None for r in roots)  # ended after the drafter step
    for root in roots:
        children = {s["name"]: s for s in tel.spans if s.get("parent") is root}
        assert set(children) == {"batch_queue.wait", "target.forward", "hs_queue.wait",
                                 "drafter.step"}  # fmt: skip
        for wait in ("batch_queue.wait", "hs_queue.wait"):
            assert "queue.depth" in children[wait]["attributes"]
            assert children[wait]["start_ns"] <= children[wait]["end_ns"]
        assert children["drafter.step"]["end_ns"] <= root.end_ns
    # The trainer's phases are opened without a parent: they nest under drafter.step.
    assert any(s["name"] == "drafter.loss" and s["parent"] is None for s in tel.spans)
    # Time blocked on hs_queue.put feeds the tables (the verdict), not the trace.
    puts = [s for s in tel.spans if s["name"] == "hs_queue.put"]
    assert len(puts) == 5 and all(s["stats_only"] for s in puts)


def test_failing_batch_trace_is_ended_with_the_error() -> None:
    tel = RecordingTelemetry()

    def forward(batch):
        raise KeyError("layer 7")

    pipe = build(n=3, forward=forward, telemetry=tel)
    pipe.run()
    first = next(s["handle"] for s in tel.spans if s["name"] == "batch")
    assert isinstance(first.error, KeyError) and first.end_ns is not None


def test_real_tracing_gives_one_trace_per_batch() -> None:
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    import tracing
    from dflash.observe import Observer

    exporter = InMemorySpanExporter()
    cfg = tracing.TracingConfig()
    telemetry = tracing.setup(cfg, span_processors=[SimpleSpanProcessor(exporter)])
    try:
        pipe = build(n=4, targets=2, telemetry=Observer(cfg, telemetry, world_size=1))
        pipe.run()
        pipe.raise_if_failed()
    finally:
        tracing.shutdown(timeout_s=1.0)
    spans = exporter.get_finished_spans()
    roots = [s for s in spans if s.name == "batch"]
    assert len(roots) == 4 and len({r.context.trace_id for r in roots}) == 4
    by_id = {s.context.span_id: s for s in spans}
    for root in roots:
        trace = [s for s in spans if s.context.trace_id == root.context.trace_id]
        parents = {s.name: by_id[s.parent.span_id].name for s in trace if s.parent is not None}
        assert parents == {
            "batch_queue.wait": "batch", "target.forward": "batch", "hs_queue.wait": "batch",
            "drafter.step": "batch", "drafter.loss": "drafter.step",
        }  # fmt: skip
        step = next(s for s in trace if s.name == "drafter.step")
        assert step.end_time <= root.end_time
        wait = next(s for s in trace if s.name == "hs_queue.wait")
        assert "queue.depth" in wait.attributes


def test_first_signal_stops_the_stages_and_handlers_are_restored() -> None:
    from dflash.queues import SignalStop

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
        "from dflash.queues import SignalStop\n"
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
