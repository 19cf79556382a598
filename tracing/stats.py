"""ProfileStats: a thread-safe accumulator of named durations with bounded memory.

Classic use keeps working: `stats.add("fwd", dt)` then `print(stats)`. Each name keeps
count, total, min, max and a histogram of log-spaced buckets (p50/p95 within one
bucket, about 9 % relative). Two views exist: cumulative (`snapshot()`) and the last
interval (`take_interval()`, which starts the next one). Snapshots are plain data,
convert to and from dicts, and merge across ranks.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from math import floor, log2
from threading import get_ident
from typing import Any

# 8 buckets per doubling: bucket b covers [2**(b/8), 2**((b+1)/8)) seconds.
BUCKETS_PER_OCTAVE = 8
_MIN_BUCKET = -30 * BUCKETS_PER_OCTAVE  # ~1 ns; shorter (or zero) durations land here
NO_THREAD = None
"""Pass as `thread=` for durations that belong to no single thread (cross-thread spans)."""
_CURRENT_THREAD = object()


def _bucket_mid_s(bucket: int) -> float:
    return 2.0 ** ((bucket + 0.5) / BUCKETS_PER_OCTAVE)


@dataclass
class PhaseStats:
    """Figures of one name over one window (an interval or the whole run)."""

    count: int = 0
    total_s: float = 0.0
    min_s: float = math.inf
    max_s: float = 0.0
    buckets: dict[int, int] = field(default_factory=dict)
    threads: dict[str, int] = field(default_factory=dict)
    """Records per thread key; empty for names recorded with `thread=NO_THREAD`."""

    @property
    def mean_s(self) -> float:
        return self.total_s / self.count if self.count else 0.0

    @property
    def p50_s(self) -> float:
        return self.quantile_s(0.50)

    @property
    def p95_s(self) -> float:
        return self.quantile_s(0.95)

    def quantile_s(self, q: float) -> float:
        """Bucket midpoint of the q-quantile, clamped to the exact min and max."""
        if not self.count:
            return 0.0
        rank = q * self.count
        seen = 0
        for bucket in sorted(self.buckets):
            seen += self.buckets[bucket]
            if seen >= rank:
                return min(self.max_s, max(self.min_s, _bucket_mid_s(bucket)))
        return self.max_s

    def merge(self, other: PhaseStats, thread_prefix: str = "") -> None:
        self.count += other.count
        self.total_s += other.total_s
        self.min_s = min(self.min_s, other.min_s)
        self.max_s = max(self.max_s, other.max_s)
        for bucket, n in other.buckets.items():
            self.buckets[bucket] = self.buckets.get(bucket, 0) + n
        for key, n in other.threads.items():
            self.threads[thread_prefix + key] = self.threads.get(thread_prefix + key, 0) + n

    def to_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "total_s": self.total_s,
            "min_s": self.min_s if self.count else None,
            "max_s": self.max_s,
            "buckets": {str(b): n for b, n in self.buckets.items()},
            "threads": dict(self.threads),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PhaseStats:
        min_s = data.get("min_s")
        return cls(
            count=int(data["count"]),
            total_s=float(data["total_s"]),
            min_s=math.inf if min_s is None else float(min_s),
            max_s=float(data["max_s"]),
            buckets={int(b): int(n) for b, n in data.get("buckets", {}).items()},
            threads={str(k): int(n) for k, n in data.get("threads", {}).items()},
        )


@dataclass
class StatsSnapshot:
    """Plain-data copy of the accumulator over a window of `wall_s` seconds."""

    phases: dict[str, PhaseStats]
    wall_s: float
    end_time_s: float = field(default_factory=time.time)
    rank: int | None = None

    def share(self, name: str) -> float | None:
        """Fraction of its threads' wall time spent in `name`; None for cross-thread names."""
        stats = self.phases.get(name)
        if stats is None or not stats.threads or self.wall_s <= 0:
            return None
        return stats.total_s / (len(stats.threads) * self.wall_s)

    def to_dict(self) -> dict[str, Any]:
        return {
            "phases": {name: s.to_dict() for name, s in self.phases.items()},
            "wall_s": self.wall_s,
            "end_time_s": self.end_time_s,
            "rank": self.rank,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StatsSnapshot:
        return cls(
            phases={n: PhaseStats.from_dict(s) for n, s in data["phases"].items()},
            wall_s=float(data["wall_s"]),
            end_time_s=float(data.get("end_time_s", 0.0)),
            rank=data.get("rank"),
        )

    @staticmethod
    def merge(snapshots: Iterable[StatsSnapshot]) -> StatsSnapshot:
        """Sum of several snapshots (e.g. one per rank). Threads stay distinct per snapshot."""
        merged: dict[str, PhaseStats] = {}
        wall_s = 0.0
        end_time_s = 0.0
        for index, snap in enumerate(snapshots):
            wall_s = max(wall_s, snap.wall_s)
            end_time_s = max(end_time_s, snap.end_time_s)
            prefix = f"{snap.rank if snap.rank is not None else index}/"
            for name, stats in snap.phases.items():
                merged.setdefault(name, PhaseStats()).merge(stats, thread_prefix=prefix)
        return StatsSnapshot(phases=merged, wall_s=wall_s, end_time_s=end_time_s)


class _Live:
    """Figures of one name in the current interval, updated under the lock (hot path)."""

    __slots__ = ("count", "total_s", "min_s", "max_s", "buckets", "threads")

    def __init__(self) -> None:
        self.count = 0
        self.total_s = 0.0
        self.min_s = math.inf
        self.max_s = 0.0
        self.buckets: dict[int, int] = {}
        self.threads: dict[Any, int] = {}

    def frozen(self) -> PhaseStats:
        threads = {str(key): n for key, n in self.threads.items()}
        return PhaseStats(
            self.count, self.total_s, self.min_s, self.max_s, dict(self.buckets), threads
        )


def _copy(stats: PhaseStats) -> PhaseStats:
    return PhaseStats(
        stats.count,
        stats.total_s,
        stats.min_s,
        stats.max_s,
        dict(stats.buckets),
        dict(stats.threads),
    )


class ProfileStats:
    """Thread-safe named-duration accumulator; `add(name, seconds)` from any thread."""

    def __init__(self, rank: int | None = None) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        # `add` touches only the current interval; finished intervals fold into `_done`.
        self._live: dict[str, _Live] = {}
        self._done: dict[str, PhaseStats] = {}
        self._start_s = time.monotonic()
        self._interval_start_s = self._start_s

    def add(self, name: str, seconds: float, thread: object = _CURRENT_THREAD) -> None:
        """Records one duration. `thread` defaults to the calling thread (for the share column)."""
        if thread is _CURRENT_THREAD:
            thread = get_ident()
        bucket = _MIN_BUCKET if seconds <= 1e-9 else floor(log2(seconds) * BUCKETS_PER_OCTAVE)
        with self._lock:
            live = self._live.get(name)
            if live is None:
                live = self._live[name] = _Live()
            live.count += 1
            live.total_s += seconds
            if seconds < live.min_s:
                live.min_s = seconds
            if seconds > live.max_s:
                live.max_s = seconds
            buckets = live.buckets
            buckets[bucket] = buckets.get(bucket, 0) + 1
            if thread is not None:
                threads = live.threads
                threads[thread] = threads.get(thread, 0) + 1

    def snapshot(self) -> StatsSnapshot:
        """Cumulative figures since creation (or `reset`)."""
        with self._lock:
            phases = {name: _copy(stats) for name, stats in self._done.items()}
            for name, live in self._live.items():
                phases.setdefault(name, PhaseStats()).merge(live.frozen())
            wall_s = time.monotonic() - self._start_s
        return StatsSnapshot(phases=phases, wall_s=wall_s, rank=self.rank)

    def take_interval(self) -> StatsSnapshot:
        """Figures since the previous call (or creation); the next interval starts now."""
        with self._lock:
            now_s = time.monotonic()
            live, self._live = self._live, {}
            wall_s = now_s - self._interval_start_s
            self._interval_start_s = now_s
            phases = {name: entry.frozen() for name, entry in live.items()}
            for name, stats in phases.items():
                self._done.setdefault(name, PhaseStats()).merge(stats)
        return StatsSnapshot(phases=phases, wall_s=wall_s, rank=self.rank)

    def reset(self) -> None:
        with self._lock:
            self._live.clear()
            self._done.clear()
            self._start_s = self._interval_start_s = time.monotonic()

    def get(self, name: str) -> PhaseStats | None:
        """Cumulative figures of one name, or None if never recorded."""
        return self.snapshot().phases.get(name)

    def names(self) -> list[str]:
        with self._lock:
            return list(dict.fromkeys([*self._done, *self._live]))

    def __contains__(self, name: object) -> bool:
        return name in self._live or name in self._done

    def format_compact(self) -> str:
        from tracing.format import format_compact

        return format_compact(self.snapshot())

    def format_table(self) -> str:
        from tracing.format import format_table

        return format_table(self.snapshot())

    def __str__(self) -> str:
        return self.format_compact()
