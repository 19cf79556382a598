"""Tokens/s of the pipelined trainer vs the single-threaded reference, in one run.

Both train the default config (built-in tiny target, embedded corpus) for the same
number of steps from the same seed, without the τ evaluation; tokens/s is measured
over the training loop only (setup excluded), as summary.json reports it.

    python bench/pipeline_vs_reference.py                  # 40 steps each, cpu
    python bench/pipeline_vs_reference.py --steps 100 --repeats 2 \\
        --target-devices cuda:0 --drafter-devices cuda:1

The first run on a machine prepares the tiny target (a minute or two, cached).
On a small shared CPU the two sides compete for the same cores, and torch's
intra-op threads (OMP_NUM_THREADS) suffer badly when the machine is oversubscribed;
compare runs at equal load, and try OMP_NUM_THREADS=1. The figure that matters is
on separate devices.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

from dflash.config import config_from_options
from dflash.pipeline import run_pipeline
from dflash.reference import train_reference


def _quiet(_: str) -> None:
    pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=1, help="alternating runs of each")
    parser.add_argument("--target-devices", default="auto")
    parser.add_argument("--drafter-devices", default="auto")
    args = parser.parse_args(argv)
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
