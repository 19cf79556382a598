"""Speculative decoding vs plain greedy decoding, with and without KV caches.

Usage: python bench/eval_speedup.py [--drafter DIR] [--eval-data JSONL] [--prompts N]
                                    [--max-new-tokens N] [KEY=VALUE ...]
Without --drafter it trains the given config first (as `dflash-train` does) into
OUTPUT_DIR (default runs/bench-speedup). Prompts: chat JSONL when --eval-data is
given, else held-out windows of the training data. Prints one JSON line: τ (mean
of per-prompt means, and pooled) and the wall-clock speedup against greedy decoding
with the same target, once with KV caches and once without. Exits 1 when τ differs
between the two paths (they must accept exactly the same drafts).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from train_throughput import parse_overrides

from dflash.config.settings import config_from_options
from dflash.data.datasets import build_datasets, heldout_prompts
from dflash.drafter.io import load_drafter
from dflash.eval.evaluate import evaluate_tau
from dflash.eval.prompts import load_chat_prompts
from dflash.run.reference import train_reference


def _prompts(args: argparse.Namespace, cfg, target) -> list[list[int]]:
    if args.eval_data is not None:
        return load_chat_prompts(args.eval_data, target.tokenizer, limit=args.prompts)
    _, heldout = build_datasets(
        cfg.data.source, target.tokenizer, cfg.data.seq_len, 1, 0, cfg.data.heldout_fraction
    )
    return heldout_prompts(heldout, args.prompts, cfg.run.eval_prompt_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", type=Path, default=None, help="trained drafter directory")
    parser.add_argument("--eval-data", type=Path, default=None, help="chat JSONL prompts")
    parser.add_argument("--prompts", type=int, default=8, help="number of prompts")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="tokens per prompt")
    parser.add_argument("--repeats", type=int, default=3, help="timings per prompt (min kept)")
    parser.add_argument("overrides", nargs="*", help="train options as KEY=VALUE")
    args = parser.parse_args()
    cfg = config_from_options(
        {"output_dir": "runs/bench-speedup", **parse_overrides(args.overrides)}
    )
    drafter_dir = args.drafter
    if drafter_dir is None:
        train_reference(cfg, log=lambda s: print(s, file=sys.stderr))
        drafter_dir = Path(cfg.run.output_dir) / "drafter"
    drafter, target = load_drafter(drafter_dir, device="cpu")
    prompts = _prompts(args, cfg, target)
    figures = {}
    for name, use_cache in (("cached", True), ("uncached", False)):
        result = evaluate_tau(target, drafter, prompts, args.max_new_tokens,
                              use_cache=use_cache, compare_baseline=True,
                              timing_repeats=args.repeats)  # fmt: skip
        figures[name] = {
            "tau": round(result.tau, 4), "tau_pooled": round(result.tau_pooled, 4),
            "speedup_vs_greedy": round(result.speedup or 0.0, 3),
            "speculative_s": round(result.speculative_s, 2),
            "greedy_s": round(result.baseline_s or 0.0, 2), "new_tokens": result.new_tokens,
        }  # fmt: skip
    same = figures["cached"]["tau"] == figures["uncached"]["tau"]
    summary = {"tau_equal": same, "prompts": len(prompts), "drafter": str(drafter_dir)}
    print(json.dumps({**figures, **summary, "max_new_tokens": args.max_new_tokens}))
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
