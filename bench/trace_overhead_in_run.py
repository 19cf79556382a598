"""Hot-path cost of traces and the timeline, measured inside one training run.

`bench/trace_overhead.py` compares whole runs; on a shared 2-core VM two identical runs
differ by a few percent, so it cannot resolve 1%. This script removes the between-run
noise for the part of the cost that is paid per phase: one `dflash-train train` runs in
a child process with traces exported over OTLP/gRPC to a live sink, metrics exported
every second and the default timeline; a switcher thread in that process installs, every
`--block-s` seconds, either the full tracing runtime (spans + timeline hooks) or a plain
one (the same ProfileStats, no span, no hook), in the order on, off, off, on, ... (so
drift and the position in the sequence cancel out), and counts the drafter steps each
block finishes. The exporters and the metrics reader run throughout,
so their fixed cost is in both arms: that part is what `trace_overhead.py` adds.

Each A/B run is followed by an A/A run (both arms the full runtime): its ratio shows how
far this method moves with nothing to find.

Usage: python bench/trace_overhead_in_run.py [--runs 2] [--steps 4000] [--block-s 1.0]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ORDER = (0, 1, 1, 0)  # 0: the full runtime, 1: the plain one (or the full one again, A/A)
WARMUP_STEPS = 30


def _steps(stats: object) -> int:
    phase = stats.snapshot().phases.get("drafter.step")  # type: ignore[attr-defined]
    return phase.count if phase is not None else 0


def _switch(blocks: list[tuple[int, int, float]], block_s: float, control: bool,
            done: threading.Event) -> None:  # fmt: skip
    import tracing.spans as spans

    while not done.is_set():  # wait for the run's own runtime, then for warm steps
        rt = spans.runtime()
        if rt.tracer is not None and _steps(rt.stats) > WARMUP_STEPS:
            break
        time.sleep(0.05)
    full = spans.runtime()
    plain = full if control else spans.Runtime(full.stats)
    count, start, k = _steps(full.stats), time.perf_counter(), 0
    while not done.wait(block_s):
        now_count, now = _steps(full.stats), time.perf_counter()
        blocks.append((ORDER[k % 4], now_count - count, now - start))
        k += 1
        spans.install(full if ORDER[k % 4] == 0 else plain)
        count, start = now_count, now


def one_run(steps: int, block_s: float, control: bool, endpoint: str, out: Path) -> dict:
    from dflash.cli import cli

    blocks: list[tuple[int, int, float]] = []
    done = threading.Event()
    switcher = threading.Thread(target=_switch, args=(blocks, block_s, control, done), daemon=True)
    switcher.start()
    try:
        cli.main(["train", "--steps", str(steps), "--output-dir", str(out), "--eval-prompts",
                  "0", "--save-every", "0", "--trace-level", "phase", "--otlp-endpoint",
                  endpoint, "--otlp-protocol", "grpc"], standalone_mode=False)  # fmt: skip
    finally:
        done.set()
        switcher.join()
    blocks = blocks[:-1]  # the last block ends after training did
    rates = {}
    for arm in (0, 1):
        mine = [b for b in blocks if b[0] == arm]
        rates[arm] = sum(b[1] for b in mine) / sum(b[2] for b in mine)
    return {"blocks": len(blocks), "on": rates[0], "off": rates[1], "ratio": rates[0] / rates[1]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="A/B runs, each followed by A/A")
    parser.add_argument("--steps", type=int, default=4000, help="training steps per run")
    parser.add_argument("--block-s", type=float, default=1.0, help="seconds per block")
    parser.add_argument("--one-run", choices=["ab", "aa"], help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.runs < 1 or args.steps <= WARMUP_STEPS or not args.block_s > 0:
        parser.error(f"--runs must be >= 1, --steps > {WARMUP_STEPS}, --block-s > 0")
    if args.one_run:
        result = one_run(args.steps, args.block_s, args.one_run == "aa", args.endpoint,
                         Path(args.out))  # fmt: skip
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    from otlp_sink import OtlpSink

    sink = OtlpSink()
    ratios: dict[str, list[float]] = {"ab": [], "aa": []}
    env = {**os.environ, "OTEL_METRIC_EXPORT_INTERVAL": "1000"}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.runs):
                for kind in ("ab", "aa"):
                    cmd = [sys.executable, __file__, "--one-run", kind, "--steps",
                           str(args.steps), "--block-s", str(args.block_s), "--endpoint",
                           sink.endpoint, "--out", str(Path(tmp) / f"{kind}{i}")]  # fmt: skip
                    done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
                    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
                    r = json.loads(line[len("RESULT ") :])
                    ratios[kind].append(r["ratio"])
                    label = "on/off" if kind == "ab" else "on/on (A/A)"
                    rates = f"{r['on']:.2f} / {r['off']:.2f}"
                    print(f"run {i} {label}: {r['blocks']} blocks, drafter steps/s {rates}, "
                          f"ratio {r['ratio']:.4f}", flush=True)  # fmt: skip
    finally:
        sink.close()
    print(f"in-run ratio on/off: median {statistics.median(ratios['ab']):.4f} over {args.runs} "
          f"runs; A/A (nothing to find): median {statistics.median(ratios['aa']):.4f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
