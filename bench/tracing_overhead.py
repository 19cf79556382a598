"""Cost per phase of both span paths, side by side in one run (ns/phase and ratios), and
the default training config's tokens/s with each.

  classic     two clock reads and a dict update (the classic ProfileStats approach)
  off         tracing.phase with spans off (level off): clock reads + ProfileStats.add
  fast        tracing.phase with a span on tracing's own provider (the default config):
              the fast path (tracing.fast) into the SDK's BatchSpanProcessor and OTLP/gRPC
              exporter, sending to a sink collector in a subprocess; the clock stops when
              every span is exported (force_flush), so the export thread's work counts
  sdk         the same processor, exporter and sink, the spans made by the SDK's Tracer
              (what every phase costs on an application's provider)
  *.nested    parented implicitly by an enclosing phase (the current phase)
  *.propagate like nested, with propagate_context=True (an OTel context attach + detach)
  *.hot       the same loops, clock stopped when the loop ends (export work still queued:
              what the training thread itself sees while the exporter keeps up)
  *.cpu       CPU time of the process, all its threads, over the loop and its export

With --run-steps N, `dflash-train train` on the default config (the embedded tiny target;
--run-args adds arguments, e.g. the SmolLM2 recipe's) runs N steps exporting every phase
over OTLP/gRPC to the sink, --run-pairs times on each path, interleaved (the SDK path by
adding a do-nothing span processor, which hands phases to the SDK's Tracer); it prints
every run's tokens/s and training CPU seconds and the fast/sdk ratio of each pair (their
spread is the machine's noise).

Usage: python bench/tracing_overhead.py [--phases N] [--repeats R]
         [--run-steps N [--run-pairs K] [--run-args "..."] [--skip-phases]]
Bars: off <= 0.8 us; on the path kept, hot <= 10 us on the training thread and cpu <= 17
us of CPU in all threads per phase exported over OTLP/gRPC.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

# Run from a checkout: prefer its `tracing` over whatever the environment installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OTEL_BSP_MAX_QUEUE_SIZE", "65536")  # the loops outrun any exporter
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider  # noqa: E402
from otlp_sink import OtlpSink  # noqa: E402  (bench/ is the script's directory)

import tracing  # noqa: E402
from tracing.fast import FastTracer, PhaseIds  # noqa: E402
from tracing.telemetry import build_resource  # noqa: E402

Timing = tuple[float, ...]


def bench_classic(n: int) -> float:
    stats: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    clock = time.perf_counter
    start = time.perf_counter_ns()
    for _ in range(n):
        t0 = clock()
        entry = stats["phase"]
        entry[0] += 1
        entry[1] += clock() - t0
    return (time.perf_counter_ns() - start) / n


def bench_off(n: int) -> float:
    phase = tracing.phase
    start = time.perf_counter_ns()
    for _ in range(n):
        with phase("phase"):
            pass
    return (time.perf_counter_ns() - start) / n


def bench_traced(n: int, telemetry: tracing.Telemetry, nested: bool) -> Timing:
    """(loop only, loop + export of all its spans, process CPU of both) in ns per phase."""
    phase = tracing.phase
    root = tracing.start_span("batch")
    cpu_start = time.process_time_ns()
    start = time.perf_counter_ns()
    with phase("outer", parent=root) if nested else contextlib.nullcontext():
        for _ in range(n):
            with phase("phase") if nested else phase("phase", parent=root):
                pass
    loop_end = time.perf_counter_ns()
    root.end()
    assert telemetry.force_flush(120.0), "export did not finish"
    cpu = (time.process_time_ns() - cpu_start) / n
    return (loop_end - start) / n, (time.perf_counter_ns() - start) / n, cpu


def _best(runs: list[Timing]) -> Timing:
    return tuple(min(run[i] for run in runs) for i in range(len(runs[0])))


def _setup(path: str, endpoint: str, propagate: bool = False) -> tracing.Telemetry:
    """Tracing exporting over OTLP/gRPC, its phases on the fast path or the SDK's Tracer."""
    cfg = tracing.TracingConfig(otlp_endpoint=endpoint, otlp_protocol="grpc", run_id="bench")
    provider = None
    if path == "sdk":  # tracing's processors and exporter on a provider passed in
        provider = TracerProvider(resource=build_resource(cfg), id_generator=PhaseIds())
    telemetry = tracing.setup(cfg, provider=provider, propagate_context=propagate)
    is_fast = isinstance(tracing.spans.runtime().tracer, FastTracer)
    assert is_fast == (path == "fast"), path
    bench_traced(1000, telemetry, nested=False)  # warm up: gRPC channel, code paths
    return telemetry


def run_paths(n: int, repeats: int, endpoint: str) -> dict[str, float]:
    results = {"classic": min(bench_classic(n * 10) for _ in range(repeats))}
    tracing.setup(tracing.TracingConfig(level="off"))
    results["off"] = min(bench_off(n * 10) for _ in range(repeats))
    for path in ("fast", "sdk"):
        for variant, nested, propagate in (
            ("", False, False),
            (".nested", True, False),
            (".propagate", True, True),
        ):
            telemetry = _setup(path, endpoint, propagate)
            hot, wall, cpu = _best([bench_traced(n, telemetry, nested) for _ in range(repeats)])
            report = telemetry.shutdown(timeout_s=10.0)
            assert not report.spans_not_delivered, report.summary()
            name = path + variant
            results[name + ".hot"], results[name], results[name + ".cpu"] = hot, wall, cpu
    return results


class _DoNothing(SpanProcessor):
    """Added to tracing's provider, it hands every phase to the SDK's Tracer."""


def run_training(
    steps: int, endpoint: str, extra: list[str], pairs: int
) -> dict[str, list[dict[str, float]]]:
    """The default config (plus `extra` arguments) for `steps` steps exporting every phase,
    `pairs` times on each path, interleaved fast, sdk, fast, ...: the machine drifts."""
    from dflash.cli import cli

    real_setup, figures = tracing.setup, {"fast": [], "sdk": []}
    for path in ("fast", "sdk") * pairs:

        def setup(*args, path=path, **kwargs):  # type: ignore[no-untyped-def]
            telemetry = real_setup(*args, **kwargs)
            if path == "sdk":
                telemetry.provider.add_span_processor(_DoNothing())
            return telemetry

        tracing.setup = setup
        with tempfile.TemporaryDirectory() as out:
            args = ["train", "--steps", str(steps), "--output-dir", out, "--eval-prompts", "0"]
            args += ["--save-every", "0", "--timeline", "off", "--otlp-endpoint", endpoint]
            cli.main([*args, "--otlp-protocol", "grpc", *extra], standalone_mode=False)
            summary = json.loads((Path(out) / "summary.json").read_text())
        tracing.setup = real_setup
        run = {"tokens_per_s": summary["tokens_per_s"]}
        run["train_cpu_s"] = summary["pipeline"]["train_cpu_s"]
        figures[path].append(run)
        print(f"train {path}: {run['tokens_per_s']:,.0f} tokens/s", file=sys.stderr, flush=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phases", type=int, default=20000, help="phases per traced measurement")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per mode; best kept")
    parser.add_argument("--run-steps", type=int, default=0, help="also train N steps per path")
    parser.add_argument("--run-pairs", type=int, default=2, help="training runs per path")
    parser.add_argument("--run-args", default="", help="more `train` arguments, one string")
    parser.add_argument("--skip-phases", action="store_true", help="training runs only")
    args = parser.parse_args()
    sink = OtlpSink()
    try:
        results = {} if args.skip_phases else run_paths(args.phases, args.repeats, sink.endpoint)
        training = (
            run_training(args.run_steps, sink.endpoint, shlex.split(args.run_args), args.run_pairs)
            if args.run_steps
            else {}
        )
    finally:
        sink.close()
    if results:
        print_paths(results)
    if training:
        print_training(args.run_steps, training)


def print_paths(results: dict[str, float]) -> None:
    classic = results["classic"]
    print(f"{'mode':<20} {'ns/phase':>10} {'x classic':>10}")
    for mode, ns in results.items():
        print(f"{mode:<20} {ns:>10.0f} {ns / classic:>10.1f}")
    for path in ("fast", "sdk"):
        print(
            f"{path}: hot {results[path + '.hot'] / 1e3:.1f} us (<= 10), cpu "
            f"{results[path + '.cpu'] / 1e3:.1f} us (<= 17), wall until exported "
            f"{results[path] / 1e3:.1f} us; propagate +"
            f"{(results[path + '.propagate.hot'] - results[path + '.nested.hot']) / 1e3:.2f} us"
        )
    print(
        f"off {results['off'] / 1e3:.2f} us (<= 0.8); sdk/fast hot "
        f"{results['sdk.hot'] / results['fast.hot']:.2f}x, cpu "
        f"{results['sdk.cpu'] / results['fast.cpu']:.2f}x"
    )


def print_training(steps: int, training: dict[str, list[dict[str, float]]]) -> None:
    """Every run, and the ratio of each interleaved pair: its spread is the noise."""
    for path, runs in training.items():
        tokens = ", ".join(f"{run['tokens_per_s']:,.0f}" for run in runs)
        cpu = ", ".join(f"{run['train_cpu_s']:.1f}" for run in runs)
        print(f"train {steps} steps, {path}: tokens/s {tokens}; training CPU s {cpu}")
    ratios = sorted(
        fast["tokens_per_s"] / sdk["tokens_per_s"]
        for fast, sdk in zip(training["fast"], training["sdk"], strict=True)
    )
    median = statistics.median(ratios)
    print(
        f"fast/sdk tokens/s per pair: median {median:.3f}, min {ratios[0]:.3f}, "
        f"max {ratios[-1]:.3f} ({len(ratios)} pairs)"
    )


if __name__ == "__main__":
    main()
