"""Training tokens/s from the offline hidden-state cache vs the online target forward.

Usage: python bench/hidden_cache.py [--steps N] [--cache-dir DIR] [train flags as KEY=VALUE ...]
On the default built-in target: writes a cache of the first N batches, then times
N drafter steps fed by the target forward (online) and N fed by the cache reader,
and prints one JSON line with both rates, their ratio and the cache size per
million tokens (also with soft labels' final-norm states, which add D per token).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from train_throughput import parse_overrides

from dflash.config.devices import decide_placement
from dflash.config.settings import config_from_options
from dflash.offline.hidden_cache import open_hidden_cache, write_hidden_cache
from dflash.run.build import build_drafter, build_run
from dflash.train.step import DrafterTrainer


def _timed_steps(cfg, target, layer_ids, source, steps: int) -> float:
    """tokens/s of `steps` drafter steps whose (batch, target_out) come from `source(i)`."""
    trainer = DrafterTrainer(build_drafter(cfg, target, layer_ids, torch.device("cpu")), cfg, "cpu")
    trainer.step(*source(0))  # warm-up, not timed
    tokens, start_s = 0, time.perf_counter()
    for i in range(1, steps + 1):
        batch, out = source(i)
        tokens += trainer.step(batch, out).num_tokens
    return tokens / (time.perf_counter() - start_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="train options as KEY=VALUE")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    cfg = config_from_options(
        {"output_dir": "runs/bench-hidden-cache", **parse_overrides(args.overrides)}
    )
    run = build_run(cfg, decide_placement(cfg.pipeline), log=lambda s: None)
    target, data, layers = run.target, run.train_data, run.layer_ids
    root = args.cache_dir or Path(tempfile.mkdtemp(prefix="dflash-hidden-cache-"))
    write_start_s = time.perf_counter()
    plain = write_hidden_cache(
        target, data, root / "plain", layer_ids=layers, num_batches=args.steps + 1
    )
    write_s = time.perf_counter() - write_start_s
    soft = write_hidden_cache(target, data, root / "soft", layer_ids=layers,
                              num_batches=args.steps + 1, with_final_norm=True)  # fmt: skip
    reader = open_hidden_cache(plain, target=target, dataset=data, layer_ids=layers)
    soft_reader = open_hidden_cache(soft, target=target, dataset=data, layer_ids=layers,
                                    with_final_norm=True)  # fmt: skip

    def online(i):
        batch = data.batch(i)
        with torch.no_grad():
            out = target.capture(batch.input_ids, layers, with_logits=False, doc_ids=batch.doc_ids)
        return batch, out

    # Alternating rounds, median of each: the machine is shared, so one slow round of
    # either kind must not decide the ratio.
    rounds = [
        (_timed_steps(cfg, target, layers, online, args.steps),
         _timed_steps(cfg, target, layers, reader.get, args.steps))
        for _ in range(args.rounds)
    ]  # fmt: skip
    online_tps = statistics.median(r[0] for r in rounds)
    cached_tps = statistics.median(r[1] for r in rounds)
    tokens = (args.steps + 1) * data.batch_size * data.seq_len
    print(json.dumps({
        "online_tokens_per_s": round(online_tps), "cache_tokens_per_s": round(cached_tps),
        "cache_vs_online": round(cached_tps / online_tps, 3),
        "cache_mb_per_million_tokens": round(reader.total_bytes / tokens, 1),
        "cache_with_final_norm_mb_per_million_tokens": round(soft_reader.total_bytes / tokens, 1),
        "cache_write_tokens_per_s": round(tokens / write_s), "steps": args.steps,
        "rounds": args.rounds,
        "target": cfg.target.spec, "layers": layers, "dtype": str(target.embed_tokens.weight.dtype),
    }))  # fmt: skip
    if args.cache_dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
