"""One row of the learning table: train a drafter, then let vLLM judge it.

Runs `dflash-train train` with the given options (its own --output-dir), then serves the
target with the saved drafter in vLLM (the engine's own spec-decode counters, as
`eval --server` reads them) on each --judge file's chat prompts, and appends one JSON
row to --results: the settings, steps, minutes of training, precision, the τ training
measured on its held-out prompts (the final evaluation, and its curve), and τ by vLLM
per judged set. The training and the judging run one after the other, nothing else
should run meanwhile (2 cores: the minutes are the budget the issue states).

Usage (the SmolLM2 recipe of docs/training.md; VLLM is the vLLM venv's python):
  python bench/learning_run.py --results runs/learning.jsonl --name dpace-b8 \
      --vllm "$VLLM -m vllm.entrypoints.openai.api_server --dtype float32 --enforce-eager \
              --max-model-len 1024" \
      --judge humaneval.jsonl --judge chat.jsonl --max-new-tokens 128 -- \
      --config recipe.yaml --hidden-cache hs --steps 1750 --position-weighting dpace \
      --output-dir runs/dpace-b8
(VLLM_CPU_KVCACHE_SPACE=4 in the environment for vLLM's CPU build.)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def train(args: list[str]) -> tuple[Path, float]:
    """`dflash-train train ARGS`; (its output folder, wall seconds)."""
    if "--output-dir" not in args:
        sys.exit("learning_run: give the training an --output-dir of its own")
    out = Path(args[args.index("--output-dir") + 1])
    start_s = time.perf_counter()
    code = subprocess.call([sys.executable, "-m", "dflash.cli", "train", *args], cwd=ROOT)
    if code != 0:
        sys.exit(f"learning_run: training exited {code}")
    return out, time.perf_counter() - start_s


def _settings(run_dir: Path, path: Path, max_new_tokens: int) -> Any:
    """What `eval` takes for one --judge: a chat file with the bench's token budget, or
    (`heldout`) the run's own OUTPUT_DIR/eval_prompts.json with the run's budget, so that
    vLLM's τ stands beside summary.json's on the very same prompts."""
    from dflash.eval.config import EvalConfig
    from dflash.eval.prompts import read_token_prompts

    if str(path) != "heldout":
        return EvalConfig(eval_data=str(path), max_new_tokens=max_new_tokens, num_prompts=None)
    record = run_dir / "eval_prompts.json"
    tokens = read_token_prompts(record) if record.is_file() else None
    if tokens is None:
        sys.exit(
            f"learning_run: {record} is missing (a run before it was written): rerun the "
            f"final evaluation with `dflash-train train --config {run_dir}/config.json "
            f"--output-dir {run_dir} --resume latest`"
        )
    budget = tokens.max_new_tokens or max_new_tokens
    return EvalConfig(eval_data=str(record), max_new_tokens=budget, num_prompts=None)


def judge(run_dir: Path, vllm: str, files: list[Path], max_new_tokens: int) -> dict[str, Any]:
    """τ by vLLM of the run's drafter on each file's chat prompts (every conversation);
    `heldout` names the run's own held-out prompts."""
    from dflash.drafter.io import read_drafter_config
    from dflash.eval.evaluate import evaluate_server
    from dflash.run.engine import served_drafter
    from dflash.target.served import ServerSettings

    drafter_dir = run_dir / "drafter"
    config = read_drafter_config(drafter_dir)
    found: dict[str, Any] = {}
    with served_drafter(vllm, config.target_spec, drafter_dir, config.block_size, run_dir) as url:
        server = ServerSettings(url, concurrency=8, retries=1)
        for path in files:
            settings = _settings(run_dir, path, max_new_tokens)
            figures = evaluate_server(server, drafter_dir, None, settings, log=print)
            found[path.name] = {
                "prompts": figures.prompts,
                "tau_pooled": figures.tau_pooled,
                "acceptance_per_position": figures.acceptance_per_position,
            }
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, required=True, help="JSONL the row goes to")
    parser.add_argument("--name", required=True, help="the row's name in the table")
    parser.add_argument("--vllm", required=True, help="command of vLLM's OpenAI server")
    parser.add_argument(
        "--judge",
        type=Path,
        action="append",
        default=[],
        help="chat JSONL, or `heldout`: the run's own held-out windows",
    )
    parser.add_argument("--run-dir", type=Path, help="judge this finished run; no training")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then train's options")
    args = parser.parse_args()
    train_args = [a for a in args.train_args if a != "--"]
    if args.run_dir is not None:
        run_dir, wall_s = args.run_dir, float("nan")
    else:
        run_dir, wall_s = train(train_args)
    from dflash.summary import Summary

    summary = Summary.from_dict(json.loads((run_dir / "summary.json").read_text()))
    config = json.loads((run_dir / "config.json").read_text())
    judged = judge(run_dir, args.vllm, args.judge, args.max_new_tokens) if args.judge else {}
    during = summary.evaluations_while_training or {}
    row = {
        "name": args.name,
        "train_args": train_args,
        "config": config,
        "steps": summary.steps,
        "train_min": round((summary.train_s or 0.0) / 60, 2),
        "wall_min": round(wall_s / 60, 2),
        "tokens_per_s": summary.tokens_per_s,
        "final_loss": summary.final_loss,
        "tau_in_training": summary.tau,
        "tau_pooled_in_training": summary.tau_pooled,
        "curve": during.get("curve"),
        "vllm": judged,
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    with args.results.open("a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
    by_vllm = ", ".join(f"{k} {v['tau_pooled']:.3f}" for k, v in judged.items())
    print(
        f"| {args.name} | {row['steps']} | {row['train_min']} min | "
        f"{row['tau_pooled_in_training']} | {by_vllm} |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
