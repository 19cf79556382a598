"""Cost per phase, side by side in one run (prints ns/phase and ratios).

  classic   two clock reads and a dict update (the classic ProfileStats approach)
  off       tracing.phase with spans off (level off): clock reads + ProfileStats.add
  traced    tracing.phase with a span + ProfileStats, through the bounded batch processor
            to the real OTLP gRPC exporter, sending to a sink collector in a subprocess;
            the clock stops when every span of the run is exported (force_flush), so the
            export thread's work (building SDK spans, OTLP encoding, gRPC) is counted
  nested    like traced, but parented implicitly by an enclosing phase (current phase)
  propagate like nested, with setup(propagate_context=True): each phase is also the
            current OTel span while it runs (one context attach + detach more)
  *.hot     the same loops, clock stopped when the loop ends (export work still queued:
            what the training thread itself sees while the exporter keeps up)
  traced.cpu the CPU time of the traced process, all its threads, over `traced` (the
            export thread's encoding included). Spans leave in-process: no child process
            of the traced program exists to count (the sink is the collector's stand-in)

With --metrics the OTel metrics signal runs through every mode as an application would
run it: a phase-duration histogram of the same ProfileStats and two callback gauges,
exported every 0.2 s over OTLP/gRPC to the same sink (its cost is on the reader thread).

Usage: python bench/tracing_overhead.py [--phases N] [--repeats R] [--metrics]
Goals (issue 21): off <= 1 us, traced.hot <= 10 us on the training thread, traced.cpu <= 20 us
of CPU in all processes; traced (wall until exported) and propagate are printed beside them.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

# Run from a checkout: prefer its `tracing` over whatever the environment installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from otlp_sink import OtlpSink  # noqa: E402  (bench/ is the script's directory)

import tracing  # noqa: E402
from tracing.metrics import Metrics, MetricsConfig, start_metrics  # noqa: E402


class ClassicProfileStats:
    """The classic approach: name -> [count, total]."""

    def __init__(self) -> None:
        self.stats: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])

    def add(self, name: str, dt: float) -> None:
        entry = self.stats[name]
        entry[0] += 1
        entry[1] += dt


def bench_classic(n: int) -> float:
    stats = ClassicProfileStats()
    clock = time.perf_counter
    start = time.perf_counter_ns()
    for _ in range(n):
        t0 = clock()
        stats.add("phase", clock() - t0)
    return (time.perf_counter_ns() - start) / n


def bench_phase(n: int, parent: object = None) -> float:
    phase = tracing.phase
    start = time.perf_counter_ns()
    for _ in range(n):
        with phase("phase", parent=parent):
            pass
    return (time.perf_counter_ns() - start) / n


def bench_traced(n: int, telemetry: tracing.Telemetry, root: tracing.SpanHandle) -> Timing:
    """(loop only, loop + export of all its spans, process CPU of both) in ns per phase."""
    phase = tracing.phase
    cpu_start = time.process_time_ns()
    start = time.perf_counter_ns()
    for _ in range(n):
        with phase("phase", parent=root):
            pass
    loop_end = time.perf_counter_ns()
    assert telemetry.force_flush(60.0), "export did not finish"
    cpu = (time.process_time_ns() - cpu_start) / n
    return (loop_end - start) / n, (time.perf_counter_ns() - start) / n, cpu


def bench_nested(n: int, telemetry: tracing.Telemetry, root: tracing.SpanHandle) -> Timing:
    phase = tracing.phase
    with phase("outer", parent=root):
        start = time.perf_counter_ns()
        for _ in range(n):
            with phase("phase"):
                pass
        loop_end = time.perf_counter_ns()
        assert telemetry.force_flush(60.0), "export did not finish"
        return (loop_end - start) / n, (time.perf_counter_ns() - start) / n


Timing = tuple[float, ...]


def _best(runs: list[Timing]) -> Timing:
    return tuple(min(run[i] for run in runs) for i in range(len(runs[0])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phases", type=int, default=20000, help="phases per traced measurement")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per mode; best kept")
    parser.add_argument("--metrics", action="store_true", help="export OTel metrics meanwhile")
    args = parser.parse_args()
    sink = OtlpSink()
    try:
        results = run_all(args.phases, args.repeats, sink.port, args.metrics)
    finally:
        sink.close()
    classic = results["classic"]
    print(f"{'mode':<10} {'ns/phase':>10} {'x classic':>10}")
    for mode, ns in results.items():
        if mode.startswith("_"):
            continue
        print(f"{mode:<10} {ns:>10.0f} {ns / classic:>10.1f}")
    print(
        f"goals: off {results['off'] / 1e3:.2f} us (<= 1), traced.hot "
        f"{results['traced.hot'] / 1e3:.1f} us (<= 10), traced.cpu "
        f"{results['traced.cpu'] / 1e3:.1f} us (<= 20); traced {results['traced'] / 1e3:.1f} us "
        f"wall, propagate {results['propagate'] / 1e3:.1f} us "
        f"(+{(results['propagate.hot'] - results['nested.hot']) / 1e3:.2f} us on the hot path); "
        f"exported {results['_exported']:.0f}, dropped {results['_dropped']:.0f}, "
        f"shutdown {results['_shutdown_s']:.2f}s" + (", metrics on" if args.metrics else "")
    )


def with_metrics(telemetry: tracing.Telemetry, port: int, on: bool) -> Metrics | None:
    """The metrics signal over `telemetry`'s stats, exporting every 0.2 s (when `on`)."""
    if not on:
        return None
    cfg = MetricsConfig(exporter="otlp", otlp_endpoint=f"http://127.0.0.1:{port}",
                        export_interval_s=0.2, namespace="bench")  # fmt: skip
    metrics = start_metrics(cfg, telemetry.cfg)
    metrics.observe_stats(telemetry.stats)
    metrics.observe("counter", "tokens", lambda: 1.0, unit="{token}")
    metrics.observe("updowncounter", "queue.size", lambda: 2.0, unit="{batch}")
    return metrics


def run_all(n: int, repeats: int, port: int, metrics_on: bool = False) -> dict[str, float]:
    cheap_n = n * 10
    results = {"classic": min(bench_classic(cheap_n) for _ in range(repeats))}
    off = tracing.setup(tracing.TracingConfig(level="off"))
    metrics = with_metrics(off, port, metrics_on)
    results["off"] = min(bench_phase(cheap_n) for _ in range(repeats))
    if metrics is not None:
        metrics.shutdown(2.0)
    cfg = tracing.TracingConfig(
        exporter="otlp", otlp_endpoint=f"http://127.0.0.1:{port}", max_queue_size=65536
    )
    telemetry = tracing.setup(cfg)
    metrics = with_metrics(telemetry, port, metrics_on)
    root = tracing.start_span("batch")
    bench_phase(1000, parent=root)  # warm up: gRPC channel, code paths
    telemetry.force_flush(5.0)
    results["traced.hot"], results["traced"], results["traced.cpu"] = _best(
        [bench_traced(n, telemetry, root) for _ in range(repeats)]
    )
    results["nested.hot"], results["nested"] = _best(
        [bench_nested(n, telemetry, root) for _ in range(repeats)]
    )
    root.end()
    if metrics is not None:
        metrics.shutdown(2.0)
    report = telemetry.shutdown(timeout_s=5.0)
    telemetry = tracing.setup(cfg, propagate_context=True)
    root = tracing.start_span("batch")
    bench_phase(1000, parent=root)
    telemetry.force_flush(5.0)
    results["propagate.hot"], results["propagate"] = _best(
        [bench_nested(n, telemetry, root) for _ in range(repeats)]
    )
    root.end()
    second = telemetry.shutdown(timeout_s=5.0)
    results["_exported"] = report.spans_exported + second.spans_exported
    results["_dropped"] = sum(r.spans_dropped + r.spans_not_delivered for r in (report, second))
    results["_shutdown_s"] = max(report.duration_s, second.duration_s)
    return results


if __name__ == "__main__":
    main()
