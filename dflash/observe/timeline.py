"""Timeline: every phase of every thread as Chrome trace-event JSON (Perfetto, chrome://tracing).

A consumer of tracing's phase hooks (tracing.hooks.PhaseHook), built for the run's
report: one root span per batch becomes a flow through the threads that worked on it.

    timeline = Timeline("run.json", rank=0)          # rank N writes run.json.rankN
    tracing.setup(cfg, phase_hooks=[timeline])
    timeline.watch("queue depth", {"hs_queue": hs_q.qsize})   # gauges, sampled
    timeline.watch_rate("tokens/s", {"drafter": lambda: drafter_tokens})
    timeline.start_sampling(interval_s=0.5)
    ...
    timeline.close()                                  # writes the file; idempotent

What the file holds: one track per thread (named after the thread) with every phase as
a complete ("X") slice, nested as the phases were; cross-thread spans (`start_span`, e.g.
one root per batch) as async slices and as a slice on the thread that started them
(until that thread starts the next one); flow arrows ("s"/"t"/"f") from that slice
through every phase parented on the span, in time order; counter ("C") tracks.

Hot path: a phase end appends one tuple to a list; everything else happens in `close`.
Memory is bounded by `max_events`; beyond it events are dropped and counted.
"""

from __future__ import annotations

import bisect
import itertools
import json
import logging
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

from dflash.summary import JSON
from tracing import Phase, SpanHandle, now_ns

logger = logging.getLogger("tracing")
Sampler = Mapping[str, Callable[[], float]]


def timeline_path(path: str | os.PathLike[str], rank: int) -> Path:
    """Rank 0 writes PATH itself, rank N writes PATH.rankN."""
    path = Path(path)
    return path if rank == 0 else path.with_name(f"{path.name}.rank{rank}")


def _check_writable(path: Path) -> None:
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise ValueError(f"timeline file {str(path)!r} cannot be written: {exc.strerror}") from None
    if not existed:
        path.unlink()


class Timeline:
    """A PhaseHook collecting slices, flows and counter samples for one process."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        rank: int = 0,
        max_events: int = 1_000_000,
        process_name: str | None = None,
    ) -> None:
        self.path = timeline_path(path, rank)
        _check_writable(self.path)
        self.rank = rank
        self.process_name = process_name or f"rank {rank}"
        self.max_events = max_events
        self.dropped = 0
        self._t0_ns = now_ns()
        # (thread id, name, start ns, end ns, flow serial or None, error name or None)
        self._slices: list[tuple[int, str, int, int, int | None, str | None]] = []
        # serial, name, start thread, start ns, end ns, batch attributes
        self._spans: list[tuple[int, str, int, int, int, dict[str, object]]] = []
        self._open_spans: dict[int, tuple[int, int, int]] = {}  # id(handle) -> serial, tid, ns
        self._counters: list[tuple[str, int, dict[str, float]]] = []
        self._thread_names: dict[int, str] = {}
        self._local = threading.local()
        self._tids = itertools.count(1)  # next() is atomic under the GIL
        self._serial = 0
        self._lock = threading.Lock()
        self._gauges: list[tuple[str, Sampler]] = []
        self._rates: list[tuple[str, Sampler, dict[str, tuple[int, float]]]] = []
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None
        self._closed = False
        self._written = False

    # --- PhaseHook (hot path) ---------------------------------------------------------

    def _tid(self) -> int:
        """A track id of the calling thread: a serial, not the thread ident, which the
        OS reuses once a thread ends (a later thread would land on an old track)."""
        local = self._local
        try:
            return local.tid
        except AttributeError:
            local.tid = tid = next(self._tids)
            self._thread_names[tid] = threading.current_thread().name
            return tid

    def phase_started(self, phase: Phase) -> None:
        pass  # the slice is taken whole at the end: the phase knows its start time

    def phase_ended(self, phase: Phase, exc: BaseException | None) -> None:
        if len(self._slices) >= self.max_events:
            self.dropped += 1
            return
        parent = phase._parent
        flow = None
        if isinstance(parent, SpanHandle):
            opened = self._open_spans.get(id(parent))
            flow = opened[0] if opened is not None else None
        error = type(exc).__name__ if exc is not None else None
        self._slices.append((self._tid(), phase.name, phase.start_time_ns, now_ns(), flow, error))

    def span_started(self, handle: SpanHandle) -> None:
        with self._lock:
            self._serial += 1
            serial = self._serial
        self._open_spans[id(handle)] = (serial, self._tid(), handle.start_time_ns)

    def span_ended(self, handle: SpanHandle, end_time_ns: int) -> None:
        opened = self._open_spans.pop(id(handle), None)
        if opened is None or len(self._spans) >= self.max_events:
            self.dropped += opened is not None
            return
        serial, tid, start_ns = opened
        attributes = dict(handle.attributes)
        self._spans.append((serial, handle.name, tid, start_ns, end_time_ns, attributes))

    # --- counters -------------------------------------------------------------------

    def add_counter(
        self, name: str, values: Mapping[str, float], time_ns: int | None = None
    ) -> None:
        """One sample of a counter track (several series per track, one per key)."""
        if len(self._counters) >= self.max_events:
            self.dropped += 1
            return
        when = now_ns() if time_ns is None else time_ns
        self._counters.append((name, when, {k: float(v) for k, v in values.items()}))

    def watch(self, name: str, gauges: Sampler) -> None:
        """Samples each gauge function into track `name` (on the sampling thread)."""
        self._gauges.append((name, dict(gauges)))

    def watch_rate(self, name: str, counters: Sampler) -> None:
        """Samples monotonic counters and records their per-second rate into `name`."""
        self._rates.append((name, dict(counters), {}))

    def start_sampling(self, interval_s: float = 0.5) -> Timeline:
        """Starts the daemon thread that samples `watch`/`watch_rate` every `interval_s`."""
        if not interval_s > 0:
            raise ValueError(f"timeline sampling interval must be > 0, got {interval_s!r}")
        self._sampler = threading.Thread(
            target=self._sample_loop, args=(interval_s,), name="timeline-sampler", daemon=True
        )
        self._sampler.start()
        return self

    def _sample_loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.sample()

    def sample(self) -> None:
        """Takes one sample of every watched gauge and rate now (never raises)."""
        sample_ns = now_ns()
        for name, gauges in self._gauges:
            values = _read(gauges)
            if values:
                self.add_counter(name, values, sample_ns)
        for name, counters, last in self._rates:
            rates = {}
            for key, value in _read(counters).items():
                if key in last:
                    then_ns, before = last[key]
                    if sample_ns > then_ns:
                        rates[key] = (value - before) * 1e9 / (sample_ns - then_ns)
                last[key] = (sample_ns, value)
            if rates:
                self.add_counter(name, rates, sample_ns)

    # --- output ---------------------------------------------------------------------

    def close(self, write: bool = True) -> Path | None:
        """Stops sampling and writes the file (atomically; not when `write` is False: the
        events are discarded). Idempotent; never raises. The path written, or None."""
        if self._closed:
            return self.path if self._written else None
        self._closed = True
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join(2.0)
        if not write:
            return None
        try:
            return self.write()
        except OSError as exc:
            logger.warning("tracing: timeline %s not written: %s", self.path, exc.strerror)
            return None

    def write(self) -> Path:
        doc = self.to_json()
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as out:
            json.dump(doc, out, separators=(",", ":"))
        os.replace(tmp, self.path)
        self._written = True
        if self.dropped:
            logger.warning("tracing: timeline dropped %d events (max_events)", self.dropped)
        return self.path

    def to_json(self) -> JSON:
        """The trace-event document: {"traceEvents": [...], "displayTimeUnit": "ms", ...}."""
        return build_document(self)


def _read(functions: Sampler) -> dict[str, float]:
    values = {}
    for key, fn in functions.items():
        try:
            values[key] = float(fn())
        except Exception:  # a counter callback never breaks the timeline
            continue
    return values


def build_document(tl: Timeline) -> JSON:
    pid = os.getpid()
    slices = list(tl._slices)
    spans = sorted(tl._spans)
    events: list[JSON] = []

    def us(ns: int) -> float:
        return round((ns - tl._t0_ns) / 1e3, 3)  # µs, to the ns: the clock's resolution

    by_thread: dict[int, list[tuple[int, int]]] = {}
    for tid, _, start, end, _, _ in slices:
        by_thread.setdefault(tid, []).append((start, end))
    for ranges in by_thread.values():
        ranges.sort()
    origins = _origin_slices(spans, by_thread)
    flows: dict[int, list[tuple[int, int, int]]] = {}  # serial -> (start, end, tid)
    for serial, (tid, start, end) in origins.items():
        flows.setdefault(serial, []).append((start, end, tid))
    for tid, name, start, end, flow, error in slices:
        args: JSON = {}
        if flow is not None:
            args["batch"] = flow
            flows.setdefault(flow, []).append((start, end, tid))
        if error is not None:
            args["error"] = error
        events.append(_complete(name, "phase", pid, tid, us(start), _dur_us(start, end), args))
    for serial, name, tid, start, end, attributes in spans:
        args = {"batch": serial, **{k: v for k, v in attributes.items() if _plain(v)}}
        if serial in origins:
            _, o_start, o_end = origins[serial]
            dur_us = _dur_us(o_start, o_end)
            events.append(_complete(name, "span", pid, tid, us(o_start), dur_us, args))
        common = {"cat": "span", "id": serial, "pid": pid, "tid": tid, "name": name}
        events.append({**common, "ph": "b", "ts": us(start), "args": args})
        events.append({**common, "ph": "e", "ts": us(end)})
    events += _flow_events(flows, pid, us)
    for name, when, values in tl._counters:
        events.append({"name": name, "ph": "C", "ts": us(when), "pid": pid, "args": values})
    events.sort(key=lambda e: (e["ts"], -e.get("dur", 0.0)))
    return {
        "traceEvents": _metadata(tl, pid) + events,
        "displayTimeUnit": "ms",
        "otherData": {
            "rank": tl.rank,
            "start_time_unix_ns": tl._t0_ns,
            "dropped_events": tl.dropped,
        },
    }


def _dur_us(start_ns: int, end_ns: int) -> float:
    return round((end_ns - start_ns) / 1e3, 3)


def _plain(value: object) -> bool:
    return isinstance(value, (str, int, float, bool))


def _complete(name: str, cat: str, pid: int, tid: int, ts: float, dur: float, args: JSON) -> JSON:
    event = {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "pid": pid, "tid": tid}
    if args:
        event["args"] = args
    return event


def _origin_slices(
    spans: list[tuple[int, str, int, int, int, dict[str, object]]],
    by_thread: Mapping[int, list[tuple[int, int]]],
) -> dict[int, tuple[int, int, int]]:
    """serial -> (tid, start, end) of each span's slice on the thread that started it:
    from its start until that thread starts the next span (or the span ends), cut so
    that it nests with that thread's phase slices."""
    per_thread: dict[int, list[tuple[int, int, int]]] = {}
    for serial, _, tid, start, end, _ in spans:
        per_thread.setdefault(tid, []).append((start, end, serial))
    origins = {}
    for tid, items in per_thread.items():
        items.sort()
        phases = by_thread.get(tid, [])
        starts = [p[0] for p in phases]
        for index, (start, end, serial) in enumerate(items):
            stop = min(end, items[index + 1][0]) if index + 1 < len(items) else end
            # Phases that began before it and are still open bound it from above; the
            # first phase starting inside it and outliving it cuts it off at its start.
            for _, p_end in phases[: bisect.bisect_right(starts, start)]:
                if p_end > start:
                    stop = min(stop, p_end)
            for p_start, p_end in phases[bisect.bisect_right(starts, start) :]:
                if p_start >= stop:
                    break
                if p_end > stop:
                    stop = p_start
                    break
            origins[serial] = (tid, start, max(start, stop))
    return origins


def _flow_events(
    flows: Mapping[int, list[tuple[int, int, int]]], pid: int, us: Callable[[int], float]
) -> list[JSON]:
    """One arrow chain per span, through its slices in time order. Each flow event sits
    just inside the start of its slice (so "enclosing slice" binding finds that slice,
    and the chain's timestamps follow the slices' start order)."""
    events = []
    for serial, steps in flows.items():
        steps = sorted(s for s in steps if s[1] > s[0])  # a zero-length slice encloses nothing
        if len(steps) < 2:
            continue
        last_ns = 0
        for index, (start, end, tid) in enumerate(steps):
            at_ns = min(end - 1, max(start + min(end - start, 1000) // 2, last_ns))
            last_ns = at_ns
            phase = "s" if index == 0 else "f" if index == len(steps) - 1 else "t"
            arrow = {"name": "batch", "cat": "flow", "ph": phase, "id": serial}
            events.append({**arrow, "pid": pid, "tid": tid, "ts": us(at_ns), "bp": "e"})
    return events


def _metadata(tl: Timeline, pid: int) -> list[JSON]:
    events: list[JSON] = [
        {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": tl.process_name}},
        {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": tl.rank}},
    ]
    for index, (tid, name) in enumerate(dict(tl._thread_names).items()):
        thread = {"ph": "M", "pid": pid, "tid": tid}
        events.append({**thread, "name": "thread_name", "args": {"name": name}})
        events.append({**thread, "name": "thread_sort_index", "args": {"sort_index": index}})
    return events
