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

Usage: python bench/trace_overhead.py [--pairs 4] [--steps 300]
"""

from __future__ import annotations

import argparse
import json
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=4, help="interleaved off/phase pairs")
    parser.add_argument("--steps", type=int, default=300, help="training steps per run")
    args = parser.parse_args(argv)
    sink = OtlpSink()
    traced = ["--trace-level", "phase", "--otlp-endpoint", sink.endpoint, "--otlp-protocol", "grpc"]
    ratios, cpu_ratios = [], []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            train(Path(tmp) / "warmup", 20, [], {})  # target prepared, caches warm
            for i in range(args.pairs):
                # Alternate which goes first so drift in machine load cancels out.
                order = [("off", ["--trace-level", "off", "--timeline", "off"], OFF_ENV),
                         ("phase", traced, ON_ENV)]  # fmt: skip
                if i % 2:
                    order.reverse()
                figures = {name: train(Path(tmp) / f"{name}{i}", args.steps, extra, env)
                           for name, extra, env in order}  # fmt: skip
                (off, off_cpu), (phase, phase_cpu) = figures["off"], figures["phase"]
                ratios.append(phase / off)
                cpu_ratios.append(off_cpu / phase_cpu)
                print(f"pair {i}: off {off:,.0f} tok/s {off_cpu:.3f} cpu-s/1k tok, traces+metrics "
                      f"{phase:,.0f} tok/s {phase_cpu:.3f} cpu-s/1k tok; ratios: tokens/s "
                      f"{ratios[-1]:.3f}, cpu {cpu_ratios[-1]:.3f}", flush=True)  # fmt: skip
        spans = sink.spans()
    finally:
        sink.close()
    print(f"median ratio on/off: tokens/s {statistics.median(ratios):.3f} (goal >= 0.99), "
          f"CPU per token off/traced {statistics.median(cpu_ratios):.3f}, over {args.pairs} "
          f"pairs; the receiver got {spans:,} spans")  # fmt: skip
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
