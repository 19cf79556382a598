"""Plain-data duration figures: the log-bucket histogram, PhaseStats and StatsSnapshot.

Each name keeps count, total, min, max and a histogram of log-spaced buckets (p50/p95
within one bucket, about 9 % relative). Snapshots convert to and from dicts and merge
across ranks. `tracing.stats.ProfileStats` fills them.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from math import floor, inf, log2, pow
from typing import Any

Json = Any  # a JSON value as json.loads returns it: any of JSON's types

# 8 buckets per doubling: bucket b covers [2**(b/8), 2**((b+1)/8)) seconds.
BUCKETS_PER_OCTAVE = 8
MIN_BUCKET = -30 * BUCKETS_PER_OCTAVE  # ~1 ns; shorter (or zero) durations land here
TINY_S = 2.0 ** (MIN_BUCKET / BUCKETS_PER_OCTAVE)  # durations up to this: bucket MIN_BUCKET


def bucket_edge_s(bucket: int) -> float:
    """Lower edge of `bucket`: bucket b covers [edge(b), edge(b + 1))."""
    return pow(2.0, bucket / BUCKETS_PER_OCTAVE)


def bucket_of(seconds: float) -> int:
    """The bucket of a duration above TINY_S, consistent with `bucket_edge_s` even
    where log2 rounds across an edge."""
    bucket = floor(log2(seconds) * BUCKETS_PER_OCTAVE)
    if seconds >= bucket_edge_s(bucket + 1):
        bucket += 1
    elif seconds < bucket_edge_s(bucket):
        bucket -= 1
    return bucket


def _bucket_mid_s(bucket: int) -> float:
    return pow(2.0, (bucket + 0.5) / BUCKETS_PER_OCTAVE)


@dataclass
class PhaseStats:
    """Figures of one name over one window (an interval or the whole run)."""

    count: int = 0
    total_s: float = 0.0
    min_s: float = inf
    max_s: float = 0.0
    buckets: dict[int, int] = field(default_factory=dict)
    threads: dict[str, int] = field(default_factory=dict)
    """Records per thread key; empty for names recorded with `thread=NO_THREAD`."""
    thread_total_s: dict[str, float] = field(default_factory=dict)
    """Seconds per thread key (the same keys as `threads`)."""

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

    def merge(self, other: PhaseStats, thread_prefix: str = "") -> PhaseStats:
        """Adds `other` in (thread keys prefixed); returns self: `PhaseStats().merge(s)` copies."""
        self.count += other.count
        self.total_s += other.total_s
        self.min_s = min(self.min_s, other.min_s)
        self.max_s = max(self.max_s, other.max_s)
        for bucket, n in other.buckets.items():
            self.buckets[bucket] = self.buckets.get(bucket, 0) + n
        for key, n in other.threads.items():
            self.threads[thread_prefix + key] = self.threads.get(thread_prefix + key, 0) + n
        for key, seconds in other.thread_total_s.items():
            key = thread_prefix + key
            self.thread_total_s[key] = self.thread_total_s.get(key, 0.0) + seconds
        return self

    def to_dict(self) -> dict[str, Json]:
        data = asdict(self)  # copies of the dicts; JSON wants str keys and no infinity
        data["min_s"] = self.min_s if self.count else None
        data["buckets"] = {str(b): n for b, n in self.buckets.items()}
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Json]) -> PhaseStats:
        min_s = data.get("min_s")
        return cls(
            count=int(data["count"]),
            total_s=float(data["total_s"]),
            min_s=inf if min_s is None else float(min_s),
            max_s=float(data["max_s"]),
            buckets={int(b): int(n) for b, n in data.get("buckets", {}).items()},
            threads={str(k): int(n) for k, n in data.get("threads", {}).items()},
            thread_total_s={str(k): float(v) for k, v in data.get("thread_total_s", {}).items()},
        )


@dataclass
class StatsSnapshot:
    """Plain-data copy of the accumulator over a window of `wall_s` seconds."""

    phases: dict[str, PhaseStats]
    wall_s: float
    end_time_s: float = field(default_factory=time.time)
    rank: int | None = None
    thread_wall_s: dict[str, float] = field(default_factory=dict)
    """Seconds each thread existed within the window (from its first record, or the
    window's start); a thread missing here is counted with `wall_s`."""

    def thread_wall(self, thread: str) -> float:
        return self.thread_wall_s.get(thread, self.wall_s)

    def thread_shares(self, name: str) -> dict[str, float]:
        """Per thread that recorded `name`: its seconds in `name` / its own wall time."""
        stats = self.phases.get(name)
        if stats is None:
            return {}
        shares = {}
        for thread, count in stats.threads.items():
            wall_s = self.thread_wall(thread)
            if wall_s > 0:
                # Figures without per-thread totals (older dicts) split the total by count.
                seconds = stats.thread_total_s.get(thread, stats.total_s * count / stats.count)
                shares[thread] = min(1.0, seconds / wall_s)
        return shares

    def threads_of(self, *names: str) -> set[str]:
        """The threads that recorded any of `names` (e.g. the phases of one stage)."""
        return set().union(*(self.phases[name].threads for name in names if name in self.phases))

    def share(self, name: str, threads: Iterable[str] | None = None) -> float | None:
        """Mean over `threads` (default: those that recorded `name`) of each thread's
        share of its own wall time spent in `name`; a listed thread that never recorded
        it counts 0. None for cross-thread names or an empty window."""
        stats = self.phases.get(name)
        if stats is None or not stats.threads or self.wall_s <= 0:
            return None
        per_thread = self.thread_shares(name)
        over = list(stats.threads if threads is None else threads)
        if not over:
            return None
        return sum(per_thread.get(thread, 0.0) for thread in over) / len(over)

    def to_dict(self) -> dict[str, Json]:
        return {**asdict(self), "phases": {name: s.to_dict() for name, s in self.phases.items()}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Json]) -> StatsSnapshot:
        return cls(
            phases={n: PhaseStats.from_dict(s) for n, s in data["phases"].items()},
            wall_s=float(data["wall_s"]),
            end_time_s=float(data.get("end_time_s", 0.0)),
            rank=data.get("rank"),
            thread_wall_s={str(k): float(v) for k, v in data.get("thread_wall_s", {}).items()},
        )

    @staticmethod
    def merge(snapshots: Iterable[StatsSnapshot]) -> StatsSnapshot:
        """Sum of several snapshots (e.g. one per rank). Threads stay distinct per snapshot."""
        merged: dict[str, PhaseStats] = {}
        thread_wall_s: dict[str, float] = {}
        wall_s = end_time_s = 0.0
        for index, snap in enumerate(snapshots):
            wall_s = max(wall_s, snap.wall_s)
            end_time_s = max(end_time_s, snap.end_time_s)
            prefix = f"{snap.rank if snap.rank is not None else index}/"
            for name, stats in snap.phases.items():
                merged.setdefault(name, PhaseStats()).merge(stats, thread_prefix=prefix)
                for thread in stats.threads:
                    thread_wall_s[prefix + thread] = snap.thread_wall(thread)
        return StatsSnapshot(merged, wall_s, end_time_s, thread_wall_s=thread_wall_s)
