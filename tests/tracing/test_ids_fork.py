"""Span ids that stay unique when the program seeds `random`, and tracing across fork."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import subprocess
import sys
from pathlib import Path

from memory_setup import setup_memory
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import tracing

_SEEDED_CHILD = """
import random, sys
sys.path.insert(0, sys.argv[1])
from memory_setup import setup_memory
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
import tracing
random.seed(0)  # what transformers.set_seed / seed_everything do
exporter = InMemorySpanExporter()
setup_memory(exporter)
for _ in range(5):
    tracing.start_span("batch").end()
print(" ".join(f"{s.context.trace_id:032x}" for s in exporter.get_finished_spans()))
"""


def test_processes_that_seed_random_get_disjoint_trace_ids() -> None:
    here = str(Path(__file__).parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(here).parents[1]), here])}
    child = [sys.executable, "-c", _SEEDED_CHILD, here]
    options = {"capture_output": True, "text": True, "timeout": 120, "env": env, "check": True}
    runs = [subprocess.run(child, **options).stdout.split() for _ in range(2)]
    assert len(runs[0]) == len(runs[1]) == 5
    assert not set(runs[0]) & set(runs[1])


def _draws(traced: bool, memory: InMemorySpanExporter) -> list[float]:
    telemetry = setup_memory(memory) if traced else tracing.setup(tracing.TracingConfig())
    random.seed(1234)
    draws = []
    for _ in range(20):
        root = tracing.start_span("batch")
        with tracing.phase("step", parent=root):
            draws.append(random.random())
        root.end()
    telemetry.shutdown(timeout_s=1.0)
    return draws


def test_tracing_leaves_the_programs_random_sequence_alone(memory) -> None:
    traced = _draws(True, memory)
    assert len(memory.get_finished_spans()) == 40  # the traced run did record spans
    assert traced == _draws(False, memory)


def _child(queue: multiprocessing.Queue) -> None:
    for index in range(3):
        with tracing.phase("child.work", level="step", attributes={"index": index}):
            pass
    stats = tracing.get_stats()
    queue.put({"names": sorted(stats.names()), "count": stats.get("child.work").count})


def _span_names(path: Path) -> list[str]:
    return [
        span["name"]
        for line in path.read_text().splitlines()
        for rs in json.loads(line)["resourceSpans"]
        for ss in rs["scopeSpans"]
        for span in ss["spans"]
    ]


def test_forked_child_exports_its_own_spans(clean_env, tmp_path: Path) -> None:
    clean_env.setenv("OTEL_BSP_SCHEDULE_DELAY", "30000")  # only the exit flush exports
    path = tmp_path / "trace.jsonl"
    telemetry = tracing.setup(tracing.TracingConfig(trace_file=str(path)))
    try:
        with tracing.phase("parent.work", level="step"):
            pass
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=_child, args=(queue,))
        # Fork while the stats lock is held: the child must not inherit a held lock.
        with telemetry.stats._lock:
            child.start()
        seen = queue.get(timeout=60)
        child.join(timeout=60)
        assert child.exitcode == 0
        # The child's tables are its own; its spans were flushed when it exited.
        assert seen == {"names": ["child.work"], "count": 3}
        assert _span_names(path) == ["child.work"] * 3
    finally:
        report = telemetry.shutdown(timeout_s=2.0)
    assert report.spans_exported == 1 and sorted(_span_names(path))[-1] == "parent.work"


def _pool_task(i: int) -> int:
    with tracing.phase("pool.task"):
        return os.getpid()


def test_a_closed_and_joined_pools_workers_flush_every_span(clean_env, tmp_path) -> None:
    clean_env.setenv("OTEL_BSP_SCHEDULE_DELAY", "30000")
    path = tmp_path / "t.jsonl"
    telemetry = tracing.setup(tracing.TracingConfig(trace_file=str(path)))
    pool = multiprocessing.get_context("fork").Pool(2)
    try:
        assert len(set(pool.map(_pool_task, range(6), chunksize=1))) >= 1
        pool.close()
        pool.join()
    finally:
        telemetry.shutdown(timeout_s=2.0)
    assert _span_names(path) == ["pool.task"] * 6
