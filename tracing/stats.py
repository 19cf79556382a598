"""ProfileStats: a thread-safe accumulator of named durations with bounded memory.

Classic use keeps working: `stats.add("fwd", dt)` then `print(stats)`. Two views, both
`StatsSnapshot`s (tracing.snapshot): cumulative (`snapshot()`) and the last interval
(`take_interval()`, which starts the next one).
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time
import weakref
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from threading import get_ident

from tracing.format import format_compact
from tracing.snapshot import MIN_BUCKET, TINY_S, PhaseStats, StatsSnapshot, bucket_edge_s, bucket_of

_FOLD_AT = 1024
"""Pending durations per (thread, name) that `add` lets pile up before folding them."""
NO_THREAD = None
"""Pass as `thread=` for durations that belong to no single thread (cross-thread spans)."""
_CURRENT_THREAD = object()
_thread_serials = itertools.count()  # next() is atomic under the GIL


@dataclass(slots=True)
class _Live:
    """Figures of one name in the current interval, updated under the lock."""

    count: int = 0
    total_s: float = 0.0
    min_s: float = math.inf
    max_s: float = 0.0
    buckets: dict[int, int] = field(default_factory=dict)
    threads: dict[object, int] = field(default_factory=dict)
    thread_total_s: dict[object, float] = field(default_factory=dict)

    def fold(self, values: list[float], thread: object) -> None:
        """Adds a chunk of durations of one thread. Sorting (C) then bisecting bucket
        edges costs far less per value than computing each value's bucket: this runs
        for every duration ever added."""
        values.sort()
        n = len(values)
        total_s = sum(values)
        self.count += n
        self.total_s += total_s
        if values[0] < self.min_s:
            self.min_s = values[0]
        if values[-1] > self.max_s:
            self.max_s = values[-1]
        buckets = self.buckets
        start = bisect_right(values, TINY_S)
        if start:
            buckets[MIN_BUCKET] = buckets.get(MIN_BUCKET, 0) + start
        while start < n:
            bucket = bucket_of(values[start])
            end = bisect_left(values, bucket_edge_s(bucket + 1), start)
            buckets[bucket] = buckets.get(bucket, 0) + end - start
            start = end
        if thread is not None:
            self.threads[thread] = self.threads.get(thread, 0) + n
            self.thread_total_s[thread] = self.thread_total_s.get(thread, 0.0) + total_s

    def frozen(self) -> PhaseStats:
        threads = {str(key): n for key, n in self.threads.items()}
        totals = {str(key): s for key, s in self.thread_total_s.items()}
        return PhaseStats(
            self.count, self.total_s, self.min_s, self.max_s, dict(self.buckets), threads, totals
        )


class ProfileStats:
    """Thread-safe named-duration accumulator; `add(name, seconds)` from any thread.
    `add` only appends the duration to a pending list of its (thread, name); the lists
    are folded into the figures in chunks (when one grows long, and before every read),
    with C-level loops: a lock around per-call updates cost more than the rest of a
    level-off phase. Appends are atomic and only folding removes from a list (under the
    lock), so no duration is lost or counted twice."""

    def __init__(self, rank: int | None = None) -> None:
        self.rank = rank
        self._start_fresh()
        _instances.add(self)

    def _start_fresh(self) -> None:
        """Empty figures and a new lock: at creation, and in a forked child (its figures are
        its own; its copy of the lock may be held by a thread that did not survive the fork)."""
        self._lock = threading.Lock()
        # thread key -> name -> durations not folded yet (a thread appends to its own).
        self._pending: dict[object, dict[str, list[float]]] = {}
        self._local = threading.local()  # .key and .pending of the calling thread
        # `_live` holds the current interval; finished intervals fold into `_done`.
        self._live: dict[str, _Live] = {}
        self._done: dict[str, PhaseStats] = {}
        self._thread_start_s: dict[str, float] = {}
        # A thread's pending lists go once it has ended (and been folded); its wall time
        # stops at the fold that saw it gone.
        self._threads: dict[str, weakref.ref[threading.Thread]] = {}
        self._thread_end_s: dict[str, float] = {}
        self._start_s = time.monotonic()
        self._interval_start_s = self._start_s

    def add(self, name: str, seconds: float, thread: object = _CURRENT_THREAD) -> None:
        """Records one duration. `thread` defaults to the calling thread (for the share column)."""
        if thread is _CURRENT_THREAD:
            try:
                values = self._local.pending[name]
            except (AttributeError, KeyError):
                values = self._thread_pending(seconds).setdefault(name, [])
            if len(values) >= _FOLD_AT:
                with self._lock:
                    self._fold(self._local.key, name, values)
        else:
            # setdefault is atomic: two threads adding the same NO_THREAD name share a list.
            values = self._pending.setdefault(thread, {}).setdefault(name, [])
            if len(values) >= _FOLD_AT:
                with self._lock:
                    self._fold(thread, name, values)
        values.append(seconds)

    def _thread_pending(self, seconds: float = 0.0) -> dict[str, list[float]]:
        """This thread's pending lists, registered on first use under `thread_key()`. Its
        wall time starts with the interval that ended in its first record (`seconds`
        before now): a thread started late is not idle before it existed."""
        local = self._local
        if not hasattr(local, "pending"):
            key = f"{get_ident()}.{next(_thread_serials)}"
            self._thread_start_s[key] = time.monotonic() - max(0.0, seconds)
            self._threads[key] = weakref.ref(threading.current_thread())
            local.key = key
            local.pending = self._pending.setdefault(key, {})
        pending: dict[str, list[float]] = local.pending
        return pending

    def thread_key(self) -> str:
        """The key under which this thread's durations are counted (unique per thread:
        thread idents are reused once a thread ends)."""
        self._thread_pending()
        key: str = self._local.key
        return key

    def _fold(self, thread: object, name: str, values: list[float]) -> None:
        """Moves a pending list into `_live`; the caller holds the lock."""
        n = len(values)  # appends after this point stay for the next fold
        if n:
            chunk = values[:n]
            del values[:n]
            self._live.setdefault(name, _Live()).fold(chunk, thread)

    def _fold_all(self) -> None:
        # list(...) copies in one step: adders may insert new threads and names meanwhile.
        for thread, by_name in list(self._pending.items()):
            for name, values in list(by_name.items()):
                self._fold(thread, name, values)
        self._prune_ended_threads()

    def _prune_ended_threads(self) -> None:
        """Drops the (folded, empty) pending lists of threads that have ended: a program
        that starts a thread per task must not grow them for ever."""
        for key, ref in list(self._threads.items()):
            thread = ref()
            if thread is None or not thread.is_alive():
                del self._threads[key]
                self._pending.pop(key, None)
                self._thread_end_s[key] = time.monotonic()

    def snapshot(self) -> StatsSnapshot:
        """Cumulative figures since creation (or `reset`)."""
        with self._lock:
            self._fold_all()
            phases = {name: PhaseStats().merge(stats) for name, stats in self._done.items()}
            for name, live in self._live.items():
                phases.setdefault(name, PhaseStats()).merge(live.frozen())
            return self._window(phases, self._start_s, time.monotonic())

    def take_interval(self) -> StatsSnapshot:
        """Figures since the previous call (or creation); the next interval starts now."""
        with self._lock:
            self._fold_all()
            start_s, now_s = self._interval_start_s, time.monotonic()
            self._interval_start_s = now_s
            phases = {name: live.frozen() for name, live in self._live.items()}
            self._live = {}
            for name, stats in phases.items():
                self._done.setdefault(name, PhaseStats()).merge(stats)
            return self._window(phases, start_s, now_s)

    def _window(self, phases: dict[str, PhaseStats], start_s: float, now_s: float) -> StatsSnapshot:
        """`phases` from `start_s` to `now_s`, with each thread's wall time; under the lock."""
        walls = {}
        for key, thread_start_s in list(self._thread_start_s.items()):
            end_s = min(now_s, self._thread_end_s.get(key, now_s))
            if end_s > start_s:  # a thread gone before the window has no wall in it
                walls[key] = end_s - max(start_s, thread_start_s)
        return StatsSnapshot(phases, now_s - start_s, rank=self.rank, thread_wall_s=walls)

    def reset(self) -> None:
        with self._lock:
            self._fold_all()
            self._live.clear()
            self._done.clear()
            self._start_s = self._interval_start_s = time.monotonic()
            for key in self._thread_end_s:  # ended threads have no wall from now on
                self._thread_start_s.pop(key, None)
            self._thread_end_s.clear()

    def get(self, name: str) -> PhaseStats | None:
        """Cumulative figures of one name, or None if never recorded."""
        return self.snapshot().phases.get(name)

    def names(self) -> list[str]:
        with self._lock:
            self._fold_all()
            return list(dict.fromkeys([*self._done, *self._live]))

    def __contains__(self, name: object) -> bool:
        return name in self.names()

    def format_compact(self) -> str:
        return format_compact(self.snapshot())

    __str__ = format_compact


_instances: weakref.WeakSet[ProfileStats] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for stats in list(_instances):
        stats._start_fresh()


os.register_at_fork(after_in_child=_after_fork_in_child)
