"""The Chrome trace-event timeline, validated against the format's rules."""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tracing
from dflash.observe.timeline import Timeline, timeline_path

NUM_BATCHES = 6


@pytest.fixture(autouse=True)
def _shutdown() -> Iterator[None]:
    yield
    tracing.shutdown(timeout_s=1.0)


def run_pipeline(level: str = "off") -> None:
    """prefetch -> target -> drafter threads, one root span per batch (like dflash's)."""
    batch_q: queue.Queue[Any] = queue.Queue(maxsize=2)
    hs_q: queue.Queue[Any] = queue.Queue(maxsize=2)

    def prefetch() -> None:
        for index in range(NUM_BATCHES):
            root = tracing.start_span("batch", {"batch.id": index})
            sum(range(2000))
            batch_q.put(root)
        batch_q.put(None)

    def target() -> None:
        while (root := batch_q.get()) is not None:
            with tracing.phase("batch_queue.wait", parent=root):
                pass
            with tracing.phase("target.forward", parent=root):
                sum(range(5000))
            hs_q.put(root)
        hs_q.put(None)

    def drafter() -> None:
        while (root := hs_q.get()) is not None:
            with tracing.phase("drafter.step", level="step", parent=root):
                with tracing.phase("drafter.loss"):
                    sum(range(3000))
                with tracing.phase("drafter.backward"):
                    sum(range(3000))
            root.end()

    threads = [threading.Thread(target=f, name=f.__name__) for f in (prefetch, target, drafter)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)


def format_problems(doc: dict[str, Any]) -> list[str]:
    """Checks of the trace-event format (Chrome's spec), independent of the writer."""
    problems = []
    events = doc["traceEvents"]
    last_ts: dict[tuple[int, int], float] = {}
    stacks: dict[tuple[int, int], list[tuple[float, float, str]]] = {}
    slices: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for event in events:
        if event["ph"] == "M":
            continue
        key = (event["pid"], event.get("tid", 0))
        if event["ts"] < last_ts.get(key, float("-inf")):
            problems.append(f"ts goes back on thread {key}: {event}")
        last_ts[key] = event["ts"]
        if event["ph"] == "X":
            if event["dur"] < 0:
                problems.append(f"negative dur: {event}")
            stack = stacks.setdefault(key, [])
            start, end = event["ts"], event["ts"] + event["dur"]
            while stack and stack[-1][1] <= start + 1e-6:  # float µs from integer ns
                stack.pop()
            if stack and end > stack[-1][1] + 1e-6:
                problems.append(f"{event['name']} overlaps {stack[-1][2]} without nesting")
            stack.append((start, end, event["name"]))
            slices.setdefault(key, []).append((start, end))
    flows: dict[int, list[dict[str, Any]]] = {}
    for event in events:
        if event["ph"] in "stf":
            flows.setdefault(event["id"], []).append(event)
            key = (event["pid"], event["tid"])
            if not any(s <= event["ts"] <= e for s, e in slices.get(key, [])):
                problems.append(f"flow event binds to no slice: {event}")
    for flow_id, chain in flows.items():
        phases = "".join(e["ph"] for e in chain)
        if phases[0] != "s" or phases[-1] != "f" or set(phases[1:-1]) - {"t"}:
            problems.append(f"flow {flow_id} is not s t* f: {phases}")
    return problems


def test_timeline_has_threads_phases_flows_and_counters(tmp_path: Path) -> None:
    timeline = Timeline(tmp_path / "timeline.json")
    tracing.setup(tracing.TracingConfig(level="off"), phase_hooks=[timeline])
    depth = {"value": 0.0}
    timeline.watch("queue depth", {"hs_queue": lambda: depth["value"]})
    tokens = {"value": 0.0}
    timeline.watch_rate("tokens/s", {"drafter": lambda: tokens["value"]})
    timeline.sample()
    run_pipeline()
    depth["value"], tokens["value"] = 2.0, 512.0
    timeline.sample()
    path = timeline.close()
    assert path == tmp_path / "timeline.json"
    doc = json.loads(path.read_text())
    assert format_problems(doc) == []
    events = doc["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"prefetch", "target", "drafter"} <= set(names.values())
    per_thread: dict[str, set[str]] = {}
    for event in events:
        if event["ph"] == "X":
            per_thread.setdefault(names[event["tid"]], set()).add(event["name"])
    assert per_thread["prefetch"] == {"batch"}
    assert per_thread["target"] == {"batch_queue.wait", "target.forward"}
    assert per_thread["drafter"] == {"drafter.step", "drafter.loss", "drafter.backward"}
    steps = [e for e in events if e["ph"] == "X" and e["name"] == "drafter.step"]
    assert len(steps) == NUM_BATCHES
    flows: dict[int, list[str]] = {}
    for event in events:
        if event["ph"] in "stf":
            flows.setdefault(event["id"], []).append(names[event["tid"]])
    assert len(flows) == NUM_BATCHES
    for chain in flows.values():  # each batch: prefetch, then the target, then the drafter
        assert chain[0] == "prefetch" and chain[-1] == "drafter" and "target" in chain
    roots = [e for e in events if e["ph"] == "b"]
    assert sorted(e["args"]["batch"] for e in roots) == list(range(1, NUM_BATCHES + 1))
    counters = [e for e in events if e["ph"] == "C"]
    depths = [e["args"] for e in counters if e["name"] == "queue depth"]
    assert depths == [{"hs_queue": 0.0}, {"hs_queue": 2.0}]
    rates = [e for e in counters if e["name"] == "tokens/s"]
    assert len(rates) == 1 and rates[0]["args"]["drafter"] > 0


def test_threads_that_end_keep_their_own_tracks(tmp_path: Path) -> None:
    timeline = Timeline(tmp_path / "t.json")
    tracing.setup(tracing.TracingConfig(level="off"), phase_hooks=[timeline])

    def work() -> None:
        with tracing.phase(threading.current_thread().name):
            pass

    for index in range(4):  # one after the other: the OS may hand out the same ident
        thread = threading.Thread(target=work, name=f"worker-{index}")
        thread.start()
        thread.join()
    doc = json.loads(timeline.close().read_text())
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == 4 and all(names[e["tid"]] == e["name"] for e in slices)


def test_timeline_sees_unsampled_phases_and_attributes_of_sampled_roots(tmp_path: Path) -> None:
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    timeline = Timeline(tmp_path / "t.json")
    exporter = InMemorySpanExporter()
    tracing.setup(
        tracing.TracingConfig(level="phase", sample_ratio=0.0),
        span_processors=[SimpleSpanProcessor(exporter)],
        phase_hooks=[timeline],
    )
    run_pipeline()
    doc = json.loads(timeline.close().read_text())
    assert exporter.get_finished_spans() == ()  # nothing sampled ...
    assert format_problems(doc) == []
    steps = [e for e in doc["traceEvents"] if e.get("name") == "drafter.step" and e["ph"] == "X"]
    assert len(steps) == NUM_BATCHES  # ... yet every phase is on the timeline


def test_timeline_marks_errors_and_bounds_memory(tmp_path: Path) -> None:
    timeline = Timeline(tmp_path / "t.json", max_events=3)
    tracing.setup(tracing.TracingConfig(level="off"), phase_hooks=[timeline])
    with pytest.raises(RuntimeError):
        with tracing.phase("boom"):
            raise RuntimeError("x")
    for _ in range(5):
        with tracing.phase("p"):
            pass
    doc = json.loads(timeline.close().read_text())
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == 3 and slices[0]["args"] == {"error": "RuntimeError"}
    assert doc["otherData"]["dropped_events"] == 3


def test_one_file_per_rank_and_unwritable_path_is_one_line(tmp_path: Path) -> None:
    assert timeline_path(tmp_path / "t.json", 0) == tmp_path / "t.json"
    assert timeline_path(tmp_path / "t.json", 3) == tmp_path / "t.json.rank3"
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="cannot be written") as info:
        Timeline(blocker / "t.json", rank=1)
    assert "\n" not in str(info.value) and "t.json.rank1" in str(info.value)
    assert not (tmp_path / "t.json").exists()  # the check leaves no file behind


def test_format_check_catches_broken_nesting_and_flows() -> None:
    events = [
        {"ph": "X", "name": "a", "ts": 0.0, "dur": 10.0, "pid": 1, "tid": 1},
        {"ph": "X", "name": "b", "ts": 5.0, "dur": 10.0, "pid": 1, "tid": 1},
        {"ph": "s", "id": 1, "ts": 50.0, "pid": 1, "tid": 1},
        {"ph": "X", "name": "c", "ts": 1.0, "dur": 1.0, "pid": 1, "tid": 2},
    ]
    problems = format_problems({"traceEvents": events})
    assert any("overlaps a without nesting" in p for p in problems)
    assert any("binds to no slice" in p for p in problems)
    assert any("is not s t* f" in p for p in problems)
