"""Tokens/s of the pipelined trainer vs the single-threaded reference, in one run.

Both train the default config (built-in tiny target, embedded corpus) for the same
number of steps from the same seed, without the τ evaluation; tokens/s is measured
over the training loop only (setup excluded), as summary.json reports it.

    python bench/pipeline_vs_reference.py                  # 40 steps each, cpu
    python bench/pipeline_vs_reference.py --steps 100 --repeats 2 \\
        --target-devices cuda:0 --drafter-devices cuda:1
    python bench/pipeline_vs_reference.py --against ../old-checkout --steps 300 --repeats 6

With `--against CHECKOUT` it compares checkouts instead: `dflash-train train` of the
default config (the pipeline, telemetry as the command sets it up) from this checkout
and from the other one, alternating run by run, each checkout first on PYTHONPATH so
one virtual environment serves both; it prints the median tokens/s of each and their
ratio.

The first run on a machine prepares the tiny target (a minute or two, cached).
On a small shared CPU the two sides compete for the same cores, and torch's
intra-op threads (OMP_NUM_THREADS) suffer badly when the machine is oversubscribed;
compare runs at equal load, and try OMP_NUM_THREADS=1. The figure that matters is
on separate devices.
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

import torch

from dflash.config.settings import config_from_options
from dflash.run.pipelined import run_pipeline
from dflash.run.reference import train_reference

HERE = Path(__file__).resolve().parents[1]


def _quiet(_: str) -> None:
    pass


def _cli_run(checkout: Path, steps: int, out: Path, devices: list[str]) -> tuple[float, float]:
    """(tokens/s, CPU µs per token) of the training loop of one `dflash-train train` of the
    default config run from `checkout` (summary.json)."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    cmd = [sys.executable, "-m", "dflash.cli", "train", "--steps", str(steps),
           "--eval-prompts", "0", "--output-dir", str(out), *devices]  # fmt: skip
    subprocess.run(cmd, env=env, cwd=out.parent, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    tokens = summary["tokens_per_s"] * summary["train_s"]
    return float(summary["tokens_per_s"]), 1e6 * summary["pipeline"]["train_cpu_s"] / tokens


def compare_checkouts(args: argparse.Namespace) -> int:
    other = args.against.resolve()
    devices = ["--target-devices", args.target_devices, "--drafter-devices",
               args.drafter_devices]  # fmt: skip
    rates: dict[str, list[float]] = {"this": [], "other": []}
    cpu: dict[str, list[float]] = {"this": [], "other": []}
    with tempfile.TemporaryDirectory(prefix="dflash-bench-") as tmp:
        for repeat in range(args.repeats):
            order = ("this", "other") if repeat % 2 == 0 else ("other", "this")
            for name in order:
                checkout = HERE if name == "this" else other
                out = Path(tmp) / f"{name}-{repeat}"
                rate, cpu_us = _cli_run(checkout, args.steps, out, devices)
                rates[name].append(rate)
                cpu[name].append(cpu_us)
    ratios = [a / b for a, b in zip(rates["this"], rates["other"], strict=True)]
    print(f"dflash-train train, default config, {args.steps} steps, {args.repeats} alternating "
          f"runs of each; {os.cpu_count()} CPUs; this {HERE}, other {other}")  # fmt: skip
    for name, values in rates.items():
        runs = " ".join(f"{r:,.0f}" for r in values)
        print(f"{name:<6} median {statistics.median(values):>9,.0f} tokens/s, "
              f"{statistics.median(cpu[name]):.2f} CPU µs/token  (runs {runs})")  # fmt: skip
    print(
        f"this / other: median of per-round ratios {statistics.median(ratios):.3f} "
        f"(rounds {' '.join(f'{r:.3f}' for r in ratios)}); ratio of medians "
        f"{statistics.median(rates['this']) / statistics.median(rates['other']):.3f}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=1, help="alternating runs of each")
    parser.add_argument("--target-devices", default="auto")
    parser.add_argument("--drafter-devices", default="auto")
    parser.add_argument(
        "--against",
        type=Path,
        default=None,
        help="another checkout: compare its training tokens/s with this one's",
    )
    args = parser.parse_args(argv)
    if args.against is not None:
        return compare_checkouts(args)
    results: dict[str, list[float]] = {"reference": [], "pipeline": []}
    pipe_figures: dict = {}
    with tempfile.TemporaryDirectory(prefix="dflash-bench-") as tmp:
        for repeat in range(args.repeats):
            for name in ("reference", "pipeline"):
                cfg = config_from_options({
                    "steps": args.steps,
                    "eval_prompts": 0,
                    "output_dir": str(Path(tmp) / f"{name}-{repeat}"),
                    "target_devices": args.target_devices.split(","),
                    "drafter_devices": args.drafter_devices.split(","),
                })  # fmt: skip
                train = train_reference if name == "reference" else run_pipeline
                summary = train(cfg, log=_quiet if repeat or name == "pipeline" else print)
                results[name].append(summary["tokens_per_s"])
                pipe_figures = summary.get("pipeline", pipe_figures)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"default config, {args.steps} steps, {args.repeats} run(s) each, "
          f"targets {args.target_devices}, drafters {args.drafter_devices}; "
          f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
          f"load average {load:.1f}")  # fmt: skip
    print(f"{'trainer':<10} {'tokens/s (best)':>16} {'tokens/s (all runs)':>32}")
    for name, rates in results.items():
        runs = " ".join(f"{r:,.0f}" for r in rates)
        print(f"{name:<10} {max(rates):>16,.0f} {runs:>32}")
    ratio = max(results["pipeline"]) / max(results["reference"])
    print(f"pipeline / reference: {ratio:.2f}x")
    depths = pipe_figures.get("queue_depth_mean", {})
    print(
        f"pipeline sides: target {pipe_figures.get('target_tokens_per_s', 0):,.0f} tokens/s, "
        f"drafter {pipe_figures.get('drafter_tokens_per_s', 0):,.0f} tokens/s, mean depth at get "
        + ", ".join(f"{k} {v:.2f}" for k, v in depths.items())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
