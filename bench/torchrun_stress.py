"""Runs the 2-rank torchrun training test many times under CPU load; prints the pass count.

A test that aborts once in a hundred runs blocks a landing sooner or later, so this
repeats `tests/dflash/run/test_pipelined.py::test_torchrun_two_ranks_train_identical_weights`
(2 gloo ranks, the real pipeline, checkpoints) while busy processes load every core.

    python bench/torchrun_stress.py                # 20 runs, one busy process per core
    python bench/torchrun_stress.py --runs 5 --load 0
    python bench/torchrun_stress.py --test \
        tests/dflash/offline/test_sample_cache.py::test_two_gloo_ranks_train_from_speculators_files

Each failure prints the end of its output (an abort shows as `terminate called ...`).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST = "tests/dflash/run/test_pipelined.py::test_torchrun_two_ranks_train_identical_weights"


def _busy(stop: mp.synchronize.Event) -> None:
    os.nice(5)  # load, but let the measured runs through
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x = (x * 31 + 7) % 1_000_003


def _run_once(test: str, timeout_s: float) -> tuple[bool, float, str]:
    start_s = time.perf_counter()
    cmd = [sys.executable, "-m", "pytest", test, "-x", "-q", "-p", "no:cacheprovider"]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        ok, output = proc.returncode == 0, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        ok, output = False, f"timeout after {timeout_s:.0f} s\n{exc.stdout or ''}"
    return ok, time.perf_counter() - start_s, output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--load", type=int, default=os.cpu_count() or 1, help="busy processes")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per run")
    parser.add_argument("--test", default=TEST, help="the pytest node id to repeat")
    args = parser.parse_args(argv)
    stop = mp.Event()
    busy = [mp.Process(target=_busy, args=(stop,), daemon=True) for _ in range(args.load)]
    for proc in busy:
        proc.start()
    passed, durations = 0, []
    try:
        for i in range(args.runs):
            ok, seconds, output = _run_once(args.test, args.timeout_s)
            passed += ok
            durations.append(seconds)
            print(f"run {i + 1}/{args.runs}: {'pass' if ok else 'FAIL'} in {seconds:.0f} s",
                  flush=True)  # fmt: skip
            if not ok:
                print("\n".join(output.splitlines()[-40:]), flush=True)
    finally:
        stop.set()
        for proc in busy:
            proc.join(5)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"torchrun 2 ranks: {passed}/{args.runs} passed under {args.load} busy process(es) "
          f"on {os.cpu_count()} CPUs (load average {load:.1f}); "
          f"median run {sorted(durations)[len(durations) // 2]:.0f} s")  # fmt: skip
    return 0 if passed == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
