"""Tracing overhead on the default training config, runs interleaved in one script.

Each pair runs `dflash-train train` twice on the same config: once with all telemetry
off (`--trace-level off --timeline off`, no metrics), once with everything on: every
phase exported over OTLP/gRPC, the OTel metrics exported every second to the same live
receiver (a sink process on 127.0.0.1 that accepts and discards both) and the default
timeline. Training tokens/s come from each run's summary.json (training time only, no
setup or eval). Prints each pair and the median ratio on/off; the goal is >= 0.99.

Wall-clock throughput on a shared 2-core machine moves by several percent from run to
run, more than the effect measured; the CPU seconds per training token (every thread
of the process, from summary.json) move far less, so the script prints their ratio
too: the share of the machine that tracing costs.

With --control each pair also runs all-off a second time: the off/off ratios show how far
this machine moves between two identical runs, measured alongside.

The order of the runs inside a pair goes through every permutation in turn, so each
mode runs in each position, and after each other mode, equally often: no mode gains
from its place in the sequence. Each median comes with its distribution-free 95%
confidence interval (order statistics of the pair ratios); on a shared 2-core VM even
20 pairs leave it about 4% wide, so a few pairs cannot resolve the 1% goal.
`bench/trace_overhead_in_run.py` measures the per-phase part of the cost inside one run.

Usage: python bench/trace_overhead.py [--pairs 20] [--steps 300] [--control]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from otlp_sink import OtlpSink

ON_ENV = {"OTEL_METRIC_EXPORT_INTERVAL": "1000"}
OFF_ENV = {"OTEL_METRICS_EXPORTER": "none"}


def train(out: Path, steps: int, extra: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(training tokens/s, CPU seconds per 1k training tokens)."""
    cmd = [sys.executable, "-m", "dflash.cli", "train", "--steps", str(steps), "--output-dir",
           str(out), "--eval-prompts", "0", "--save-every", "0", *extra]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, **env})  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    tokens = summary["tokens_per_s"] * summary["train_s"]
    return float(summary["tokens_per_s"]), 1000 * summary["pipeline"]["train_cpu_s"] / tokens


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """Distribution-free confidence interval of the median: the k-th smallest and k-th
    largest value, for the largest k whose coverage is still at least `level`."""
    ordered, n = sorted(values), len(values)
    k = 0
    # X ~ Binomial(n, 1/2), the values below the true median: P(X <= k) is the chance that
    # ordered[k] lies above it; twice that is the miss chance of [ordered[k], ordered[n-1-k]].
    while k + 1 <= n // 2 and 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n <= 1 - level:
        k += 1
    if k == 0:
        return ordered[0], ordered[-1]  # too few pairs for the level: the whole range
    return ordered[k - 1], ordered[n - k]


def summary(values: list[float]) -> str:
    low, high = median_interval(values)
    return (f"{statistics.median(values):.3f} (95% CI {low:.3f}-{high:.3f}; pairs "
            f"{min(values):.3f}-{max(values):.3f})")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=20, help="interleaved off/phase pairs")
    parser.add_argument("--steps", type=int, default=300, help="training steps per run")
    parser.add_argument("--control", action="store_true",
                        help="run all-off twice in each pair and print the off/off ratios: "
                             "the noise floor of this machine, measured alongside")  # fmt: skip
    args = parser.parse_args(argv)
    if args.pairs < 1 or args.steps < 1:
        parser.error("--pairs and --steps must be at least 1")
    sink = OtlpSink()
    traced = ["--trace-level", "phase", "--otlp-endpoint", sink.endpoint, "--otlp-protocol", "grpc"]
    off_args = ["--trace-level", "off", "--timeline", "off"]
    ratios, cpu_ratios, control = [], [], []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            train(Path(tmp) / "warmup", 20, [], {})  # target prepared, caches warm
            modes = [("off", off_args, OFF_ENV), ("phase", traced, ON_ENV)]
            if args.control:
                modes.insert(1, ("off again", off_args, OFF_ENV))
            orders = itertools.cycle(itertools.permutations(modes))
            for i in range(args.pairs):
                order = next(orders)
                figures = {name: train(Path(tmp) / f"{name}{i}".replace(" ", "_"), args.steps,
                                       extra, env) for name, extra, env in order}  # fmt: skip
                (off, off_cpu), (phase, phase_cpu) = figures["off"], figures["phase"]
                ratios.append(phase / off)
                cpu_ratios.append(off_cpu / phase_cpu)
                line = (f"pair {i}: off {off:,.0f} tok/s {off_cpu:.3f} cpu-s/1k tok, "
                        f"traces+metrics {phase:,.0f} tok/s {phase_cpu:.3f} cpu-s/1k tok; "
                        f"ratios: tokens/s {ratios[-1]:.3f}, cpu {cpu_ratios[-1]:.3f}")  # fmt: skip
                if args.control:
                    again = figures["off again"][0]
                    control.append(again / off)
                    line += f"; off again {again:,.0f} (off/off {control[-1]:.3f})"
                print(line, flush=True)
        spans = sink.spans()
    finally:
        sink.close()
    print(f"median ratio on/off: tokens/s {summary(ratios)} (goal >= 0.99), CPU per token "
          f"off/traced {summary(cpu_ratios)}, over {args.pairs} pairs; the receiver got "
          f"{spans:,} spans")  # fmt: skip
    if control:
        print(f"noise floor: median off/off {summary(control)}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
