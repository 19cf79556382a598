"""Greedy generation with vLLM's offline `LLM` API, with or without a DFlash drafter,
and the engine's own speculative-decoding counters. Run with the vLLM venv's python
(tools/vllm/venv.sh); it imports nothing of dflash-train's, whose torch differs.

    python generate.py REQUESTS.json RESULTS.json

REQUESTS: a list of {"target": DIR, "drafter": DIR or null, "prompts": [[ids], ...],
          "max_tokens": N, "dtype": "float32" | "bfloat16", "max_model_len": N},
          run one after another in this process (one engine at a time)
RESULTS:  a list of {"outputs": [[ids], ...], "num_drafts": N, "num_draft_tokens": N,
          "num_accepted_tokens": N, "accepted_per_position": [N, ...],
          "generate_s": seconds}
The counters are the ones vLLM exports as vllm:spec_decode_* on /metrics.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

# The KV cache vLLM reserves on a CPU (GiB): its default does not fit small machines.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def _spec_counters(metrics: list[Any]) -> dict[str, Any]:
    found: dict[str, Any] = {
        "num_drafts": 0,
        "num_draft_tokens": 0,
        "num_accepted_tokens": 0,
        "accepted_per_position": [],
    }
    for metric in metrics:
        name = metric.name.removeprefix("vllm:spec_decode_")
        if name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            found[name] += int(metric.value)
        elif name == "num_accepted_tokens_per_pos":
            found["accepted_per_position"] = [int(v) for v in metric.values]
    return found


def generate(request: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {}
    if request.get("drafter"):
        with open(os.path.join(request["drafter"], "config.json")) as f:
            block_size = int(json.load(f)["block_size"])
        kwargs["speculative_config"] = {
            "method": "dflash",
            "model": request["drafter"],
            # The block's first position is the last accepted token: B-1 drafts.
            "num_speculative_tokens": block_size - 1,
        }
    llm = LLM(
        model=request["target"],
        dtype=request.get("dtype", "float32"),
        max_model_len=int(request.get("max_model_len", 2048)),
        enforce_eager=True,
        disable_log_stats=False,
        seed=0,
        **kwargs,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=int(request["max_tokens"]))
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in request["prompts"]]
        start_s = time.perf_counter()
        done = llm.generate(prompts, params, use_tqdm=False)
        generate_s = time.perf_counter() - start_s
        result = _spec_counters(llm.get_metrics())
        result["outputs"] = [list(d.outputs[0].token_ids) for d in done]
        result["generate_s"] = generate_s
        return result
    finally:
        # Without this the engine-core and worker processes outlive the script.
        llm.llm_engine.engine_core.shutdown()


def main() -> None:
    with open(sys.argv[1]) as f:
        requests = json.load(f)
    results = [generate(request) for request in requests]
    with open(sys.argv[2], "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
