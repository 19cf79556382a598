"""τ of drafters trained on the corpus vs on the target's own continuations.

Usage: python bench/regen_vs_corpus.py [--windows-per-document N] [--prefix-tokens N]
       [--new-tokens N] [--eval-prompts N] [train flags as KEY=VALUE ...]
On the built-in target: cuts every held-in embedded document into windows of
prefix + continuation, writes (a) the windows as the corpus has them and (b) the
same prefixes continued by the target's greedy decoding, trains one drafter on each
for the same steps, and prints one JSON line with both τ on the same held-out
prompts of the embedded corpus. OUTPUT_DIR (default runs/bench-regen) keeps the
data (regeneration resumes) and both drafters.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from train_throughput import parse_overrides

from dflash.config import config_from_options
from dflash.data import build_datasets, embedded_corpus, encode_texts, heldout_prompts
from dflash.drafter import load_drafter
from dflash.evaluate import evaluate_tau
from dflash.regenerate import RegenerateSettings, regenerate, window_starts
from dflash.target import load_target


def train_drafter(options: dict[str, Any]) -> Path:
    """Train with the current trainer API; returns the saved drafter directory."""
    from dflash.trainer import train_reference

    cfg = config_from_options(options)
    train_reference(cfg, log=lambda s: print(s, file=sys.stderr), progress_stream=sys.stderr)
    return Path(cfg.run.output_dir) / "drafter"


def write_corpus_windows(tokenizer: Any, settings: RegenerateSettings, path: Path) -> int:
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
    parser.add_argument("--windows-per-document", type=int, default=2)
    parser.add_argument("--prefix-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--eval-prompts", type=int, default=32)
    parser.add_argument("overrides", nargs="*", help="train options as KEY=VALUE")
    args = parser.parse_args()
    base = {"output_dir": "runs/bench-regen", **parse_overrides(args.overrides)}
    root = Path(base["output_dir"])
    root.mkdir(parents=True, exist_ok=True)
    target = load_target("builtin:tiny", log=lambda s: print(s, file=sys.stderr))
    settings = RegenerateSettings(
        max_new_tokens=args.new_tokens, prefix_tokens=args.prefix_tokens,
        windows_per_document=args.windows_per_document, batch_size=64, chunk_lines=256,
    )  # fmt: skip
    num_windows = write_corpus_windows(target.tokenizer, settings, root / "corpus.jsonl")

    def progress(p: Any) -> None:
        print(f"regenerate: {p.lines_done}/{p.lines_total} {p.tokens_per_s:.0f} tok/s",
              file=sys.stderr)  # fmt: skip

    regen = regenerate(target, "embedded", root / "regen.jsonl", settings=settings,
                       progress=progress)  # fmt: skip
    taus, train_s = {}, {}
    _, heldout = build_datasets("embedded", target.tokenizer, 128, 1, 0)
    prompts = heldout_prompts(heldout, args.eval_prompts, 64)
    for name in ("corpus", "regen"):
        start_s = time.perf_counter()
        options = {**base, "data": str(root / f"{name}.jsonl"), "eval_prompts": 0,
                   "output_dir": str(root / f"drafter-{name}")}  # fmt: skip
        drafter, _ = load_drafter(train_drafter(options), target=target)
        train_s[name] = round(time.perf_counter() - start_s, 1)
        taus[name] = evaluate_tau(target, drafter, prompts, 64).tau
    print(json.dumps({
        "tau_corpus": round(taus["corpus"], 3), "tau_regenerated": round(taus["regen"], 3),
        "ratio": round(taus["regen"] / taus["corpus"], 3), "windows": num_windows,
        "regen_new_tokens": regen.new_tokens, "regen_s": round(regen.wall_s, 1),
        "train_s": train_s, "prompts": len(prompts), "overrides": args.overrides,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
