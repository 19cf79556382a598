"""τ of a trained drafter vs an untrained one (same config and seed) on the same prompts.

Usage: python bench/tau_trained_vs_untrained.py [--drafter DIR] [KEY=VALUE ...]
Without --drafter it trains the default config first (as `dflash-train` does) into
OUTPUT_DIR (default runs/bench-tau). Prints one JSON line with both τ and their ratio;
exits 1 when the ratio is below 1.5 (the issue's bar).
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
from dflash.run.build import build_drafter
from dflash.run.reference import train_reference
from dflash.run.target_features import resolve_layer_ids

BAR = 1.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", type=Path, default=None, help="trained drafter directory")
    parser.add_argument("overrides", nargs="*", help="train options as KEY=VALUE")
    args = parser.parse_args()
    options = {"output_dir": "runs/bench-tau", **parse_overrides(args.overrides)}
    cfg = config_from_options(options)
    drafter_dir = args.drafter
    if drafter_dir is None:
        train_reference(cfg, log=lambda s: print(s, file=sys.stderr))
        drafter_dir = Path(cfg.run.output_dir) / "drafter"
    trained, target = load_drafter(drafter_dir, device="cpu")
    layer_ids = resolve_layer_ids(cfg, target.num_layers)
    untrained = build_drafter(cfg, target, layer_ids, target.device)
    _, heldout = build_datasets(
        cfg.data.source, target.tokenizer, cfg.data.seq_len, 1, 0, cfg.data.heldout_fraction
    )
    rc = cfg.run
    prompts = heldout_prompts(heldout, rc.eval_prompts, rc.eval_prompt_tokens)
    tau_trained = evaluate_tau(target, trained, prompts, rc.eval_new_tokens).tau
    tau_untrained = evaluate_tau(target, untrained, prompts, rc.eval_new_tokens).tau
    ratio = tau_trained / tau_untrained
    print(json.dumps({
        "tau_trained": tau_trained, "tau_untrained": tau_untrained, "ratio": ratio,
        "prompts": len(prompts), "new_tokens": rc.eval_new_tokens, "drafter": str(drafter_dir),
    }))  # fmt: skip
    sys.exit(0 if ratio >= BAR else 1)


if __name__ == "__main__":
    main()
