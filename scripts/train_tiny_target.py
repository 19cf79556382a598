"""Train the built-in tiny target once and write the weights the repository ships.

    python scripts/train_tiny_target.py            # dflash/target/weights/tiny/, ~30 min on 2 cores
    python scripts/train_tiny_target.py --output DIR

`builtin:tiny` loads the shipped directory (dflash.target.tiny.SHIPPED_DIR), so a fresh
machine neither trains nor downloads it and every machine decodes with the same weights.
This script is how they were made: TinyLMConfig() and TinyRecipe() with seed 0, on the
embedded corpus' train split (the standard library of the Python that runs it), stored
in bfloat16 (loading casts to float32). Rerunning it gives close but not bit-identical
weights on another CPU or Python; commit the result together with its new SHIPPED_SHA256.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from dflash.files import sha256_file
from dflash.target.tiny import (
    SHIPPED_DIR,
    TinyLMConfig,
    TinyRecipe,
    heldout_loss,
    save_tiny_lm,
    train_tiny_lm,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=SHIPPED_DIR)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    cfg, recipe = TinyLMConfig(), TinyRecipe()
    start_s = time.perf_counter()
    model = train_tiny_lm(cfg, recipe, args.seed, lambda line: print(line, flush=True))
    train_s = time.perf_counter() - start_s
    loss = heldout_loss(model, recipe, args.seed)
    print(f"held-out loss {loss:.4f} nats/byte after {train_s:.0f} s", flush=True)
    save_tiny_lm(model, args.output, recipe, args.seed, {"heldout_loss": loss, "train_s": train_s})
    digest = sha256_file(args.output / "model.safetensors")
    print(f"wrote {args.output}; SHIPPED_SHA256 = {digest!r}", flush=True)


if __name__ == "__main__":
    main()
