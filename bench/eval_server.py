"""`eval --server` (τ from vLLM's own counters) against in-process `eval`, side by side:
the same drafter, target and prompts; prints both τ, their ratio and the wall-time ratio.

    python bench/eval_server.py --drafter DIR --target HF_DIR --eval-data PROMPTS.jsonl
        [--max-new-tokens 64] [--concurrency 1]

vLLM's CPU build comes from tools/vllm/venv.sh, started and stopped as `train
--eval-engine vllm` does (dflash.run.engine). The server starts first (its start-up is
not counted: a user evaluates against a server that runs), then each evaluation runs
alone. The in-process wall time includes its greedy baseline, as `eval` always measures
the speedup; its speculative decoding alone is printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dflash.run.engine import served_drafter

ROOT = Path(__file__).resolve().parents[1]


def vllm_command() -> str:
    """vLLM's CPU build (tools/vllm/venv.sh) as `served_drafter` starts it."""
    python = subprocess.run(
        ["bash", str(ROOT / "tools/vllm/venv.sh")], capture_output=True, text=True, check=True
    ).stdout.split()[-1]
    flags = "--dtype float32 --max-model-len 2048 --enforce-eager"
    return f"{shlex.quote(python)} -m vllm.entrypoints.openai.api_server {flags}"


def evaluate(args: list[str], out: Path) -> tuple[dict, float]:
    start_s = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "dflash.cli", "eval", *args, "--json", str(out)],
        check=True,
        stderr=subprocess.DEVNULL,
    )
    return json.loads(out.read_text()), time.perf_counter() - start_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", type=Path, required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--eval-data", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=1)
    opts = parser.parse_args()
    common = [
        "--target",
        opts.target,
        "--eval-data",
        opts.eval_data,
        "--max-new-tokens",
        str(opts.max_new_tokens),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        block = json.loads((opts.drafter / "config.json").read_text())["block_size"]
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # the server inherits it
        # `train --eval-engine vllm`'s own start and stop of the engine.
        with served_drafter(vllm_command(), opts.target, opts.drafter, block, work) as url:
            served, served_s = evaluate(
                ["--server", url, "--concurrency", str(opts.concurrency), *common],
                work / "served.json",
            )
        ours, ours_s = evaluate(["--drafter", str(opts.drafter), *common], work / "ours.json")
    print(
        f"τ pooled: server {served['tau_pooled']:.4f}, in process {ours['tau_pooled']:.4f} "
        f"(ratio {served['tau_pooled'] / ours['tau_pooled']:.4f})"
    )
    if served.get("tau") is not None:
        print(f"τ per-prompt mean: server {served['tau']:.4f}, in process {ours['tau']:.4f}")
    for who, figures in (("server", served), ("in process", ours)):
        rates = [round(a, 4) for a in figures["acceptance_per_position"]]
        print(f"acceptance per position, {who}: {rates}")
    print(
        f"wall: eval --server {served_s:.1f} s, in-process eval {ours_s:.1f} s "
        f"({ours_s / served_s:.1f}x); in-process speculative decoding alone "
        f"{ours['speculative_s']:.1f} s ({ours['speculative_s'] / served_s:.1f}x)"
    )


if __name__ == "__main__":
    main()
