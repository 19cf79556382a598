from __future__ import annotations

import io
import json
import math
import random
import threading
import time

import pytest

import tracing
from tracing import PhaseStats, ProfileStats, Reporter, StatsSnapshot


def test_percentiles_within_a_bucket():
    stats = ProfileStats()
    for ms in range(1, 101):
        stats.add("step", ms / 1e3)
    s = stats.get("step")
    assert s.count == 100 and s.total_s == pytest.approx(5.05)
    assert s.min_s == pytest.approx(0.001) and s.max_s == pytest.approx(0.1)
    assert s.p50_s == pytest.approx(0.050, rel=0.1)
    assert s.p95_s == pytest.approx(0.095, rel=0.1)
    assert s.mean_s == pytest.approx(0.0505)


def test_concurrent_adds_are_exact():
    stats = ProfileStats()
    per_thread = 100_000

    def work():
        for _ in range(per_thread):
            stats.add("x", 0.5)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = stats.get("x")
    assert s.count == 8 * per_thread
    assert s.total_s == 0.5 * 8 * per_thread  # exact: sums of 0.5 are exact in binary
    assert len(s.threads) == 8


def test_interval_and_cumulative_views():
    stats = ProfileStats()
    stats.add("a", 1.0)
    first = stats.take_interval()
    stats.add("a", 3.0)
    stats.add("b", 2.0)
    second = stats.take_interval()
    assert first.phases["a"].count == 1
    assert second.phases["a"].count == 1 and second.phases["a"].min_s == 3.0
    assert second.phases["b"].total_s == 2.0
    total = stats.snapshot()
    assert total.phases["a"].count == 2 and total.phases["a"].total_s == 4.0
    assert stats.take_interval().phases == {}


def test_snapshot_round_trip_and_merge_across_ranks():
    snaps = []
    for rank in range(3):
        stats = ProfileStats(rank=rank)
        for _ in range(rank + 1):
            stats.add("drafter.step", 0.1 * (rank + 1))
        data = json.loads(json.dumps(stats.snapshot().to_dict()))
        snaps.append(StatsSnapshot.from_dict(data))
    merged = StatsSnapshot.merge(snaps)
    step = merged.phases["drafter.step"]
    assert step.count == 6 and step.max_s == pytest.approx(0.3)
    assert len(step.threads) == 3  # one thread per rank, kept apart
    table = tracing.format_table(merged, rank_snapshots=snaps)
    row = next(line for line in table.splitlines() if line.startswith("drafter.step"))
    assert "100.00ms (r0)" in row and "900.00ms (r2)" in row


def test_table_content_and_share():
    snap = StatsSnapshot(
        phases={
            "hs_queue.wait": PhaseStats(4, 2.0, 0.5, 0.5, {-8: 4}, {"t1": 4}),
            "batch": PhaseStats(2, 1.0, 0.5, 0.5, {-8: 2}, {}),
        },
        wall_s=10.0,
    )
    lines = tracing.format_table(snap, title="T").splitlines()
    assert lines[0] == "T"
    header = ["phase", "count", "total", "mean", "min", "p50", "p95", "max", "share"]
    assert lines[1].split() == header
    wait = lines[3].split()
    assert wait[:5] == ["hs_queue.wait", "4", "2.00s", "500.00ms", "500.00ms"]
    assert wait[-1] == "20.0%"
    assert lines[2].split()[-1] == "-"  # cross-thread span: no share


def test_classic_usage_prints_one_line_per_name():
    stats = ProfileStats()
    stats.add("fwd", 0.25)
    stats.add("fwd", 0.75)
    assert str(stats) == "fwd: n=2 total=1.00s mean=500.00ms min=250.00ms max=750.00ms"


def test_reporter_interval_throughput_verdict_and_final():
    stats = ProfileStats()
    out = io.StringIO()
    tokens = {"n": 0}
    reporter = Reporter(stats, interval_s=60.0, stream=out, verdict=lambda s: "target-bound")
    reporter.add_rate("target", lambda: tokens["n"], unit="tok/s")
    reporter.add_gauge("hs_queue depth", lambda: 3)
    reporter.add_gauge("broken", lambda: 1 / 0)
    stats.add("target.forward", 0.2)
    tokens["n"] = 1000
    text = reporter.report_interval()
    assert "target.forward" in text and "200.00ms" in text
    assert "tok/s" in text and "hs_queue depth 3" in text and "broken n/a" in text
    assert text.splitlines()[-1] == "verdict: target-bound"
    stats.add("target.forward", 0.4)
    reporter.stop(final=True)
    final = out.getvalue().split("tracing: total")[1]
    assert final.splitlines()[2].split()[:3] == ["target.forward", "2", "600.00ms"]
    reporter.stop(final=True)  # the final table prints once
    assert out.getvalue().count("tracing: total") == 1


def test_reporter_interval_source_adds_per_rank_rows():
    """A source of gathered snapshots replaces the local interval (min/max per rank);
    None or an exception falls back to this process's own stats."""
    snaps = []
    for rank in range(2):
        other = ProfileStats(rank=rank)
        other.add("drafter.step", 0.1 * (rank + 1))
        snaps.append(other.snapshot())
    local = ProfileStats()
    local.add("target.forward", 0.2)
    reporter = Reporter(local, interval_s=60.0, stream=io.StringIO(), verdict=lambda s: "ok")
    answers = iter([(StatsSnapshot.merge(snaps), snaps), None])
    reporter.set_interval_source(lambda: next(answers))
    merged = reporter.report_interval()
    assert "2 ranks" in merged.splitlines()[0] and "200.00ms (r1)" in merged
    assert "target.forward" not in merged and merged.splitlines()[-1] == "verdict: ok"
    alone = reporter.report_interval()
    assert "target.forward" in alone and "ranks" not in alone.splitlines()[0]
    reporter.set_interval_source(lambda: 1 / 0)
    local.add("target.forward", 0.1)
    assert "ranks" not in reporter.report_interval().splitlines()[0]


def test_an_interval_without_phases_prints_nothing_and_a_first_table_comes_on_request():
    stats = ProfileStats()
    out = io.StringIO()
    stats.add("target.load", 1.5)  # timed before the reporter starts: a start-up
    reporter = Reporter(stats, interval_s=3600.0, stream=out).start()
    try:
        reporter.report_soon()  # e.g. when the first step ends
        deadline = time.monotonic() + 5.0
        while "target.load" not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "target.load" in out.getvalue() and "1.50s" in out.getvalue()
        assert reporter.report_interval() == ""  # nothing timed since: no empty table
        assert "no phases recorded" not in out.getvalue()
    finally:
        reporter.stop(final=False)


def test_reporter_thread_prints_every_interval():
    stats = ProfileStats()
    out = io.StringIO()
    reporter = Reporter(stats, interval_s=0.05, stream=out).start()
    end_s = time.monotonic() + 0.3
    while time.monotonic() < end_s:  # something timed in every interval
        stats.add("x", 0.001)
        time.sleep(0.01)
    reporter.stop(final=False)
    assert out.getvalue().count("tracing: last") >= 2


def test_excepthook_prints_final_table_then_chains():
    stats = ProfileStats()
    stats.add("drafter.step", 0.1)
    out = io.StringIO()
    seen = []
    import sys

    previous = sys.excepthook
    sys.excepthook = lambda *args: seen.append(args[0])
    reporter = Reporter(stats, interval_s=1.0, stream=out)
    try:
        reporter.install_exit_hooks()
        sys.excepthook(RuntimeError, RuntimeError("boom"), None)
    finally:
        reporter.uninstall_exit_hooks()
        sys.excepthook = previous
    assert "(stopped by RuntimeError)" in out.getvalue() and "drafter.step" in out.getvalue()
    assert seen == [RuntimeError]


def test_bad_interval_is_rejected():
    with pytest.raises(tracing.TracingConfigError, match="got 0"):
        Reporter(ProfileStats(), interval_s=0)


def test_chunked_folding_matches_per_value_figures():
    from tracing.snapshot import MIN_BUCKET, bucket_edge_s, bucket_of
    from tracing.stats import _FOLD_AT

    rng = random.Random(3)
    edges = [bucket_edge_s(b) for b in range(-100, 20)]
    values = [rng.lognormvariate(-7, 3) for _ in range(3 * _FOLD_AT)]
    values += edges + [math.nextafter(e, 0.0) for e in edges] + [0.0, -1e-3, 1e-12, 5e-10]
    rng.shuffle(values)
    stats = ProfileStats()
    expected: dict[int, int] = {}
    first = None
    for index, seconds in enumerate(values):
        stats.add("x", seconds)
        bucket = bucket_of(seconds) if seconds > bucket_edge_s(MIN_BUCKET) else MIN_BUCKET
        expected[bucket] = expected.get(bucket, 0) + 1
        if index == len(values) // 2:
            first = stats.take_interval()  # a read in the middle folds what is pending
    for seconds in edges:  # an edge opens its bucket
        assert bucket_edge_s(bucket_of(seconds)) == seconds
    total = stats.snapshot().phases["x"]
    assert first is not None and first.phases["x"].count == len(values) // 2 + 1
    assert total.count == len(values) and total.buckets == expected
    assert total.total_s == pytest.approx(math.fsum(values), rel=1e-12)
    assert total.min_s == min(values) and total.max_s == max(values)


def test_thread_keys_stay_distinct_when_idents_are_reused():
    stats = ProfileStats()
    for _ in range(4):  # one after another: the OS may hand out the same ident again
        thread = threading.Thread(target=stats.add, args=("x", 0.25))
        thread.start()
        thread.join()
    assert len(stats.get("x").threads) == 4


def test_ended_threads_leave_no_pending_lists_and_their_wall_stops():
    stats = ProfileStats()
    for _ in range(50):  # a thread per task, as a pool of short-lived workers
        thread = threading.Thread(target=stats.add, args=("task", 0.01))
        thread.start()
        thread.join()
    stats.add("main", 0.01)
    snap = stats.take_interval()
    assert snap.phases["task"].count == 50
    assert list(stats._pending) == [stats.thread_key()]  # only this (living) thread's
    time.sleep(0.05)
    stats.add("main", 0.01)
    later = stats.take_interval()
    assert set(later.thread_wall_s) == {stats.thread_key()}  # the ended ones have none now
    assert stats.snapshot().phases["task"].count == 50
