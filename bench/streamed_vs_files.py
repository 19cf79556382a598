"""Training tokens/s with the target's hidden states streamed from vLLM vs read from files
that the same engine wrote first, side by side.

Usage: python bench/streamed_vs_files.py --data CHATS.jsonl [--steps 20] [--seq-len 128]
       [--batch-size 2] [--target DIR] [--vllm-python PY] [--work-dir DIR]
Default target SmolLM2-135M-Instruct and vLLM's CPU venv (tools/vllm/model.sh, venv.sh).
Both sides train the same --steps on the same rows:
  files     `cache-hidden --format speculators --samples-only`, then
            tools/vllm/extract_hidden_states.py over its samples (each row once), then
            `train --hidden-cache` (the extraction and the training timed apart)
  streamed  `train --target-engine vllm`: the engine writes while the run trains (each
            sample as often as the run reads it)
and prints one JSON line: each side's training tokens/s (summary.json's), their wall
seconds, the files side's end to end (extraction plus training) and the host's load
average before and after, since the two sides compete for the same cores when vLLM runs
on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tools" / "vllm" / "extract_hidden_states.py"
SPOOL_SIZE = "8MB"


def tool_path(script: str) -> str:
    """The path tools/vllm/SCRIPT prints last (it builds the venv or model once)."""
    done = subprocess.run(
        ["bash", str(REPO / "tools" / "vllm" / script)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable},
        check=True,
    )
    return done.stdout.strip().splitlines()[-1]


def timed(command: list[str], env: dict[str, str]) -> float:
    """Seconds `command` ran; it must succeed."""
    start_s = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        sys.exit(f"{command[:4]} failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - start_s


def dflash(*args: str) -> list[str]:
    return [sys.executable, "-m", "dflash.cli", *args]


def rate(run: Path) -> tuple[float, float]:
    """(training tokens/s, training seconds) of a finished run."""
    summary = json.loads((run / "summary.json").read_text())
    return summary["tokens_per_s"], summary["train_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--target", default=None)
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--work-dir", type=Path, default=None)
    args = parser.parse_args()
    target = args.target or tool_path("model.sh")
    python = args.vllm_python or tool_path("venv.sh")
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="dflash-streamed-vs-files-"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    data = ["--target", target, "--data", args.data, "--seq-len", str(args.seq_len)]
    data += ["--batch-size", str(args.batch_size), "--packing", "docs", "--seed", "0"]
    data += ["--drafter-layers", "2", "--precision", "fp32"]
    train = ["--steps", str(args.steps), "--eval-prompts", "0", "--overwrite"]
    load_before = os.getloadavg()
    files = work / "files"
    cache = dflash("cache-hidden", "--format", "speculators", "--samples-only")
    timed([*cache, "--output", str(files), *data], env)
    extract = [python, str(SCRIPT), "--target", target, "--samples", str(files / "samples.jsonl")]
    extract_s = timed([*extract, "--output", str(files)], env)
    cached = work / "cached"
    files_wall_s = timed(
        dflash("train", *data, *train, "--hidden-cache", str(files), "--output-dir", str(cached)),
        env,
    )
    streamed = work / "streamed"
    engine = ["--target-engine", "vllm", "--vllm-python", python, "--spool-size", SPOOL_SIZE]
    streamed_wall_s = timed(
        dflash("train", *data, *train, *engine, "--output-dir", str(streamed)), env
    )
    files_rate, files_train_s = rate(cached)
    streamed_rate, streamed_train_s = rate(streamed)
    tokens = files_rate * files_train_s
    print(
        json.dumps(
            {
                "steps": args.steps,
                "seq_len": args.seq_len,
                "batch_size": args.batch_size,
                "files_tokens_per_s": round(files_rate, 1),
                "files_extract_s": round(extract_s, 1),
                "files_train_wall_s": round(files_wall_s, 1),
                "files_end_to_end_tokens_per_s": round(tokens / (extract_s + files_train_s), 1),
                "streamed_tokens_per_s": round(streamed_rate, 1),
                "streamed_train_s": round(streamed_train_s, 1),
                "streamed_wall_s": round(streamed_wall_s, 1),
                "streamed_over_files": round(streamed_rate / files_rate, 3),
                "loadavg_before": [round(x, 2) for x in load_before],
                "loadavg_after": [round(x, 2) for x in os.getloadavg()],
                "cpus": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
