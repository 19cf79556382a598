"""Training tokens/s of the default config (single-threaded reference step).

Usage: python bench/train_throughput.py [--steps N] [--warmup N] [train flags as KEY=VALUE ...]
Prints one JSON line: tokens/s of whole steps (target forward + drafter step) and of
the drafter step alone, so the target's share is visible.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dflash.config.devices import decide_placement
from dflash.config.settings import TrainConfig, config_from_options, option_default
from dflash.run.build import build_run


def parse_overrides(pairs: list[str]) -> dict[str, object]:
    """KEY=VALUE pairs typed by the default's type (steps=10, lr=1e-3, data=embedded)."""
    out: dict[str, object] = {}
    for pair in pairs:
        key, value = pair.split("=", 1)
        key = key.replace("-", "_")
        default = option_default(key)
        if isinstance(default, bool):
            out[key] = value.lower() in ("1", "true", "yes", "on")
        elif isinstance(default, (int, float)):
            out[key] = type(default)(value)
        else:
            out[key] = value
    return out


def measure(cfg: TrainConfig, steps: int, warmup: int) -> dict[str, float]:
    run = build_run(cfg, decide_placement(cfg.pipeline), log=lambda s: None)
    soft = cfg.loss.use_soft_labels
    total_s = drafter_s = 0.0
    tokens = 0
    for i in range(warmup + steps):
        start_s = time.perf_counter()
        batch = run.train_data.batch(i)
        with torch.no_grad():
            out = run.target.capture(batch.input_ids, run.layer_ids, with_logits=False,
                                    with_final_hidden=soft)  # fmt: skip
        mid_s = time.perf_counter()
        run.trainer.step(batch, out)
        end_s = time.perf_counter()
        if i >= warmup:
            total_s += end_s - start_s
            drafter_s += end_s - mid_s
            tokens += batch.num_tokens
    return {
        "tokens_per_s": tokens / total_s,
        "drafter_tokens_per_s": tokens / drafter_s,
        "target_share": 1 - drafter_s / total_s,
        "step_ms": 1000 * total_s / steps,
        "tokens_per_step": tokens / steps,
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("overrides", nargs="*", help="train options as KEY=VALUE")
    args = parser.parse_args()
    cfg = config_from_options(parse_overrides(args.overrides))
    figures = measure(cfg, args.steps, args.warmup)
    print(json.dumps({"config": args.overrides or "default", **figures}))


if __name__ == "__main__":
    main()
