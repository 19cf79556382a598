"""τ of drafters trained on the corpus vs on the target's own continuations.

Usage: python bench/regen_vs_corpus.py [--eval-prompts N] [--only NAME,...]
       [train flags as KEY=VALUE ...]
On the built-in target, trains one drafter per data set for the same steps (the
default config unless overridden) and prints one JSON line with every τ on the same
held-out prompts of the embedded corpus:
  corpus        `--data embedded-corpus`: the standard library source as it is
  windows       the windows the regeneration recipe cuts (prefix + continuation),
                with the corpus' own continuation
  regenerated   `--data embedded` (the default): the same prefixes continued by the
                target's greedy decoding (dflash.offline.regenerate.EMBEDDED_RECIPE, cached)
OUTPUT_DIR (default runs/bench-regen) keeps the window file and the drafters.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from train_throughput import parse_overrides

from dflash.config.settings import config_from_options
from dflash.data.corpus import EMBEDDED, EMBEDDED_CORPUS, embedded_corpus
from dflash.data.datasets import build_datasets, heldout_prompts
from dflash.data.tokenizer import encode_texts
from dflash.drafter.io import load_drafter
from dflash.eval.evaluate import evaluate_tau
from dflash.offline.config import RegenerateConfig
from dflash.offline.regenerate import EMBEDDED_RECIPE, window_starts
from dflash.run.reference import train_reference
from dflash.target.load import load_target


def train_drafter(options: dict[str, Any]) -> tuple[Path, float]:
    """Train with the reference loop; (the saved drafter directory, seconds)."""
    cfg = config_from_options(options)
    start_s = time.perf_counter()
    train_reference(cfg, log=lambda s: print(s, file=sys.stderr), progress_stream=sys.stderr)
    return Path(cfg.run.output_dir) / "drafter", time.perf_counter() - start_s


def write_corpus_windows(tokenizer: Any, settings: RegenerateConfig, path: Path) -> int:
    """The same windows regeneration uses, with the corpus' own continuation."""
    width = settings.prefix_tokens + settings.max_new_tokens
    lines = []
    for text in embedded_corpus("train", settings.heldout_fraction):
        (ids,) = encode_texts(tokenizer, [text])
        for s in window_starts(len(ids), settings):
            lines.append(json.dumps({"text": tokenizer.decode(ids[s : s + width].tolist())}))
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eval-prompts", type=int, default=32)
    parser.add_argument("--only", default="corpus,windows,regenerated")
    parser.add_argument("overrides", nargs="*", help="train options as KEY=VALUE")
    args = parser.parse_args()
    base = {"output_dir": "runs/bench-regen", **parse_overrides(args.overrides)}
    root = Path(base["output_dir"])
    root.mkdir(parents=True, exist_ok=True)
    target = load_target("builtin:tiny", log=lambda s: print(s, file=sys.stderr))
    windows = write_corpus_windows(target.tokenizer, EMBEDDED_RECIPE, root / "windows.jsonl")
    sources = {"corpus": EMBEDDED_CORPUS, "windows": str(root / "windows.jsonl"),
               "regenerated": EMBEDDED}  # fmt: skip
    _, heldout = build_datasets(EMBEDDED_CORPUS, target.tokenizer, 128, 1, 0)
    prompts = heldout_prompts(heldout, args.eval_prompts, 64)
    taus, train_s = {}, {}
    for name in args.only.split(","):
        options = {**base, "data": sources[name], "eval_prompts": 0,
                   "output_dir": str(root / f"drafter-{name}")}  # fmt: skip
        drafter_dir, seconds = train_drafter(options)
        drafter, _ = load_drafter(drafter_dir, target=target)
        train_s[name] = round(seconds, 1)  # the regenerated run includes a first regeneration
        taus[name] = round(evaluate_tau(target, drafter, prompts, 64).tau, 3)
    print(json.dumps({
        "tau": taus, "train_s": train_s, "windows": windows, "prompts": len(prompts),
        "recipe": {k: getattr(EMBEDDED_RECIPE, k) for k in
                   ("prefix_tokens", "max_new_tokens", "windows_per_document")},
        "overrides": args.overrides,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
