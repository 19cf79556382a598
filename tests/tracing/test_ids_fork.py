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
    runs = [
        subprocess.run([sys.executable, "-c", _SEEDED_CHILD, here], capture_output=True,
                       text=True, timeout=120, env=env, check=True).stdout.split()
        for _ in range(2)
    ]  # fmt: skip
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


def _child(path: str, queue: multiprocessing.Queue) -> None:
    for index in range(3):
        with tracing.phase("child.work", level="step", attributes={"index": index}):
            pass
    stats = tracing.get_stats()
    queue.put({"names": sorted(stats.names()), "count": stats.get("child.work").count})


def test_forked_child_exports_its_own_spans(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    cfg = tracing.TracingConfig(exporter="file", trace_file=str(path), schedule_delay_s=30.0)
    telemetry = tracing.setup(cfg)
    try:
        with tracing.phase("parent.work", level="step"):
            pass
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=_child, args=(str(path), queue))
        # Fork while the stats lock is held: the child must not inherit a held lock.
        with telemetry.stats._lock:
            child.start()
        seen = queue.get(timeout=60)
        child.join(timeout=60)
        assert child.exitcode == 0
    finally:
        report = telemetry.shutdown(timeout_s=2.0)
    # The child's tables are its own; its spans went to its own file at its exit (the
    # schedule delay is far longer than the test: only the exit flush can explain them).
    assert seen == {"names": ["child.work"], "count": 3}
    lines = (tmp_path / f"trace.jsonl.pid{child.pid}").read_text().splitlines()
    names = [
        span["name"]
        for line in lines
        for rs in json.loads(line)["resourceSpans"]
        for ss in rs["scopeSpans"]
        for span in ss["spans"]
    ]
    assert names == ["child.work"] * 3
    child_resource = _resource(json.loads(lines[0]))
    parent_resource = _resource(json.loads(path.read_text().splitlines()[0]))
    assert int(child_resource["process.pid"]) == child.pid != int(parent_resource["process.pid"])
    assert child_resource["service.instance.id"] != parent_resource["service.instance.id"]
    assert child_resource["service.name"] == parent_resource["service.name"]
    parent_lines = path.read_text().splitlines()
    assert report.spans_exported == 1 and "parent.work" in parent_lines[0]
    assert "child.work" not in path.read_text()


def _resource(request: dict) -> dict[str, object]:
    attrs = request["resourceSpans"][0]["resource"]["attributes"]
    return {a["key"]: next(iter(a["value"].values())) for a in attrs}


def _pool_task(i: int) -> int:
    with tracing.phase("pool.task"):
        return os.getpid()


def test_spans_of_pool_workers_terminated_by_pool_exit_are_counted_as_lost(tmp_path) -> None:
    """`with Pool() as p:` terminates its workers (SIGTERM): a worker killed before it
    flushed has its spans counted as lost in the parent's report; one that took the
    pool's stop sentinel first exits and flushes. Every span is one or the other (or,
    killed mid-flush, both). A closed and joined pool's workers all flush, and nothing
    is counted."""
    cfg = tracing.TracingConfig(
        exporter="file", trace_file=str(tmp_path / "t.jsonl"), schedule_delay_s=30.0
    )
    telemetry = tracing.setup(cfg)
    ctx = multiprocessing.get_context("fork")
    try:
        with ctx.Pool(2) as pool:
            killed = set(pool.map(_pool_task, range(6), chunksize=1))
        lost_in_killed = telemetry.ledger.lost() if telemetry.ledger else (0, 0)
        clean_pool = ctx.Pool(2)
        clean = set(clean_pool.map(_pool_task, range(4), chunksize=1))
        clean_pool.close()
        clean_pool.join()
    finally:
        report = telemetry.shutdown(timeout_s=2.0)
    flushed = {pid: _span_count(tmp_path / f"t.jsonl.pid{pid}") for pid in killed | clean}
    # Every span is flushed or counted; a worker killed between writing its batch and
    # recording it is counted although its spans arrived: the count is an upper bound.
    assert report.spans_lost_in_children + sum(flushed[pid] for pid in killed) >= 6
    assert report.spans_lost_in_children <= 6
    assert (report.children_lost, report.spans_lost_in_children) == lost_in_killed
    assert report.children_lost >= sum(flushed[pid] == 0 for pid in killed)
    if report.children_lost:
        assert "lost in" in report.summary() and not report.clean
    assert sum(flushed[pid] for pid in clean) == 4


def _span_count(path: Path) -> int:
    if not path.exists():
        return 0
    return sum(
        len(ss["spans"])
        for line in path.read_text().splitlines()
        for rs in json.loads(line)["resourceSpans"]
        for ss in rs["scopeSpans"]
    )
