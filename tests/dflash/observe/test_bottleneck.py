import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import tracing
from dflash.observe.bottleneck import (
    WaitShares,
    shared_device,
    snapshot_verdict,
    verdict,
    wait_shares,
)
from dflash.pipeline.stages import Pipeline
from tracing import PhaseStats


@pytest.mark.parametrize(
    ("shares", "expected"),
    [
        (WaitShares(0.02, 0.01, 0.41), "drafters waited 41% on hs_queue: target-bound"),
        (WaitShares(0.02, 0.55, 0.03), "drafter-bound; add drafter devices"),
        (WaitShares(0.60, 0.00, 0.50), "input-bound"),
        (WaitShares(0.30, 0.00, 0.05), "targets waited 30% on batch_queue: input-bound"),
        (WaitShares(0.05, 0.04, 0.10), "balanced: no stage waited more than 10%"),
        (
            WaitShares(0.02, 0.01, 0.41, reads_cache=True),
            "drafters waited 41% on hs_queue: reader-bound; the hidden-state cache is read",
        ),
        (
            WaitShares(0.02, 0.55, 0.03, reads_cache=True),
            "the cache reader waited 55% on a full hs_queue: drafter-bound",
        ),
    ],
)
def test_verdict_names_the_bottleneck(shares: WaitShares, expected: str) -> None:
    assert expected in verdict(shares)


def test_a_streamed_run_names_the_engine() -> None:
    # The spool's reader waits in target.read while the engine has not written the next
    # sample: the drafters' wait then points at the engine, not at a disk or a target.
    stats = PhaseStats(10, 4.0, 0.1, 0.6, {0: 10}, {"d": 10}, {"d": 4.0})
    step = PhaseStats(10, 6.0, 0.5, 0.7, {0: 10}, {"d": 10}, {"d": 6.0})
    read = PhaseStats(10, 9.5, 0.9, 1.0, {0: 10}, {"t": 10}, {"t": 9.5})
    snap = tracing.StatsSnapshot(
        phases={"hs_queue.wait": stats, "drafter.step": step, "target.read": read},
        wall_s=10.0,
        thread_wall_s={"d": 10.0, "t": 10.0},
    )
    line = snapshot_verdict(snap, streamed=True)
    assert line is not None and "drafters waited 40% on hs_queue: engine-bound" in line, line
    # The same snapshot from a hidden cache on disk: the reader, not an engine.
    line = snapshot_verdict(snap)
    assert line is not None and "reader-bound" in line and "engine" not in line, line
    # The engine ahead of training: the reader blocks on a full hs_queue, and the engine
    # on a full spool.
    full = WaitShares(0.02, 0.55, 0.03, reads_cache=True, streamed=True)
    assert "the spool reader waited 55% on a full hs_queue (the vLLM engine waits on a " in (
        verdict(full)
    )
    assert "drafter-bound" in verdict(full)


def test_threshold_moves_the_line() -> None:
    shares = WaitShares(0.0, 0.0, 0.12)
    assert verdict(shares).startswith("balanced")
    assert "target-bound" in verdict(shares, threshold=0.10)


# --- the verdict of real pipeline runs with synthetic stages of known cost -------------


@dataclass(frozen=True)
class FakeBatch:
    batch_id: int
    num_tokens: int = 64


def run_stages(
    *,
    targets: int,
    drafters: int,
    make_s: float,
    forward_s: float,
    step_s: float,
    batches: int,
    hs_queue_size: int = 4,
) -> tracing.StatsSnapshot:
    """Runs the real pipeline threads on sleeps; the cumulative snapshot of its phases."""

    def make_batch(index: int) -> FakeBatch:
        time.sleep(make_s)
        return FakeBatch(index)

    def forward(batch: FakeBatch) -> int:
        time.sleep(forward_s)
        return batch.batch_id

    def step(batch: FakeBatch, target_out: int, phase: Any) -> float:
        with phase("drafter.block_prediction"):
            time.sleep(step_s)
        return 0.0

    pipe = Pipeline.build(
        make_batch=make_batch,
        indices=range(batches),
        forwards=[("cpu", forward)] * targets,
        steps=[("cpu", step, None)] * drafters,
        on_step=lambda *_: None,
        batch_queue_size=2,
        hs_queue_size=hs_queue_size,
    )
    stats = tracing.get_stats()
    stats.reset()
    assert pipe.run() == []
    pipe.raise_if_failed()
    return stats.snapshot()


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing.setup(tracing.TracingConfig(), span_processors=[SimpleSpanProcessor(exporter)])
    yield exporter
    tracing.shutdown(timeout_s=1.0)


@pytest.mark.parametrize("targets", [8, 2])
def test_input_bound_with_many_target_threads(targets: int, spans: InMemorySpanExporter) -> None:
    # Prefetch 50 ms per batch, forward 5 ms: every target thread idles ~90 % or more.
    costs = dict(make_s=0.05, forward_s=0.005, step_s=0.002)
    snap = run_stages(targets=targets, drafters=1, batches=16, **costs)
    shares = wait_shares(snap)
    assert shares.target_input_wait > 0.6, shares
    line = snapshot_verdict(snap)
    assert line is not None and "input-bound" in line and "target-bound" not in line
    # The exported wait spans still start inside their batch's trace.
    by_id = {s.context.span_id: s for s in spans.get_finished_spans()}
    waits = [s for s in by_id.values() if s.name == "batch_queue.wait"]
    assert waits and all(w.start_time >= by_id[w.parent.span_id].start_time for w in waits)


def test_drafter_bound_with_two_drafters() -> None:
    costs = dict(make_s=0.001, forward_s=0.005, step_s=0.04)
    snap = run_stages(targets=1, drafters=2, batches=24, hs_queue_size=1, **costs)
    shares = wait_shares(snap)
    assert shares.target_output_wait > 0.4, shares
    line = snapshot_verdict(snap)
    assert line is not None and "drafter-bound; add drafter devices" in line


def test_per_thread_shares_average_over_the_stage() -> None:
    # Two target threads over 10 s: one waited 9 s, the other 1 s but recorded no wait
    # at all in another window: the stage's share is the mean over its threads.
    stats = PhaseStats(2, 10.0, 1.0, 9.0, {0: 2}, {"a": 1, "b": 1}, {"a": 9.0, "b": 1.0})
    forward = PhaseStats(3, 1.0, 0.3, 0.4, {0: 3}, {"a": 1, "b": 1, "c": 1})
    snap = tracing.StatsSnapshot(
        phases={"batch_queue.wait": stats, "target.forward": forward},
        wall_s=10.0,
        thread_wall_s={"a": 10.0, "b": 10.0, "c": 5.0},
    )
    assert snap.thread_shares("batch_queue.wait") == {"a": 0.9, "b": 0.1}
    assert wait_shares(snap).target_input_wait == pytest.approx((0.9 + 0.1 + 0.0) / 3)


def test_shared_device_names_the_device_as_the_limit() -> None:
    assert shared_device(["cpu", "cpu", "cpu"]) == "cpu"
    assert shared_device(["cuda", "cuda:0"]) == "cuda:0"
    assert shared_device(["cuda:0", "cuda:1"]) is None
    shares = WaitShares(0.02, 0.55, 0.03)
    line = verdict(shares, shared_device="cpu")
    assert "drafter-bound" in line and "cpu itself is the limit" in line
    assert "add drafter devices" not in line
    line = verdict(WaitShares(0.02, 0.01, 0.41), shared_device="cpu")
    assert "target-bound" in line and "add target devices" not in line
