"""Regeneration throughput: prompts of mixed length decoded in padded batches of 16 vs
one at a time, side by side in one run, and every row checked against transformers'
own greedy `generate` of that prompt alone.

Usage: python bench/regeneration.py --target DIR [--prompts 32] [--max-new-tokens 48]
  DIR: a Hugging Face chat model (e.g. SmolLM2-135M-Instruct, see docs/benchmarks.md)
Prints tokens/s of both, their ratio, and how many rows equal the reference.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash.data.chat import chat_prompt_ids  # noqa: E402
from dflash.target.generation import generate_padded  # noqa: E402
from dflash.target.load import load_target  # noqa: E402

TOPICS = ["a sorting function in Python", "the water cycle", "why the sky is blue",
          "a haiku about autumn", "three tips for sleeping well", "how a bicycle works",
          "the difference between a list and a tuple", "a short story about a robot"]  # fmt: skip


def mixed_prompts(tokenizer, count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        words = " ".join(rng.choice(["please", "briefly", "in detail", "simply"])
                         for _ in range(rng.randint(0, 12)))  # fmt: skip
        text = f"Explain {TOPICS[i % len(TOPICS)]} {words}".strip()
        prompts.append(chat_prompt_ids(tokenizer, [{"role": "user", "content": text}]))
    return prompts


def reference(target, prompt: list[int], max_new: int, stops: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=max_new, eos_token_id=stops,
                                pad_token_id=stops[0], top_k=None, top_p=None,
                                temperature=None)[0, len(prompt):].tolist()  # fmt: skip
    cut = next((i for i, t in enumerate(out) if t in stops), None)
    return out if cut is None else out[:cut]


def timed(target, prompts, batch: int, max_new: int, stops) -> tuple[float, list[list[int]]]:
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    results: list[list[int]] = [[] for _ in prompts]
    start = time.perf_counter()
    for s in range(0, len(order), batch):
        part = order[s : s + batch]
        outs = generate_padded(target, [prompts[i] for i in part], max_new_tokens=max_new,
                               stop_token_ids=stops)  # fmt: skip
        for i, new in zip(part, outs, strict=True):
            results[i] = new
    wall = time.perf_counter() - start
    return sum(len(r) for r in results) / wall, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    target = load_target(args.target, "cpu", torch.float32, log=lambda _: None)
    stops = list(target.stop_token_ids)
    prompts = mixed_prompts(target.tokenizer, args.prompts)
    lengths = sorted(len(p) for p in prompts)
    print(f"{len(prompts)} prompts of {lengths[0]}..{lengths[-1]} tokens "
          f"({len(set(lengths))} lengths), up to {args.max_new_tokens} new tokens")  # fmt: skip
    one_rate, one = timed(target, prompts, 1, args.max_new_tokens, stops)
    many_rate, many = timed(target, prompts, 16, args.max_new_tokens, stops)
    same = sum(a == b for a, b in zip(one, many, strict=True))
    ref = sum(reference(target, p, args.max_new_tokens, stops) == r
              for p, r in zip(prompts, many, strict=True))  # fmt: skip
    print(
        f"batch 1: {one_rate:,.1f} tokens/s; batch 16: {many_rate:,.1f} tokens/s; "
        f"ratio {many_rate / one_rate:.2f}x"
    )
    print(
        f"rows equal to transformers' greedy generate of the prompt alone: {ref}/{len(prompts)}"
        f" (batch 16 = batch 1 on {same}/{len(prompts)})"
    )


if __name__ == "__main__":
    main()
