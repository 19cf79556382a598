"""regenerate --server: tokens/s at --concurrency 8 against 1, side by side, on a real
llama-server serving SmolLM2-135M-Instruct.

Usage: python bench/regen_server.py [--prompts 32] [--max-new-tokens 64] [--rounds 2]
  the server binary: DFLASH_LLAMA_SERVER_BIN or tools/llama_server/build.sh;
  the model and its tokenizer: tools/llama_server/model.sh.
Each round runs the same prompts at concurrency 1, then 8 (the order alternates by
round); prints tokens/s of each (the server's own counts of generated tokens), their
ratio, and how many replies are the same text at both.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash.data.chat import chat_prompt_ids  # noqa: E402
from dflash.target.load import load_tokenizer  # noqa: E402
from dflash.target.served import CompletionClient, ServerSettings  # noqa: E402

TOOLS = Path(__file__).resolve().parents[1] / "tools" / "llama_server"
TOPICS = ["a sorting function in Python", "the water cycle", "why the sky is blue",
          "a haiku about autumn", "three tips for sleeping well", "how a bicycle works",
          "the difference between a list and a tuple", "a short story about a robot"]  # fmt: skip


def _tool(script: str) -> list[str]:
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(TOOLS / script)], capture_output=True, text=True,
                          env=env, check=True)  # fmt: skip
    return done.stdout.strip().splitlines()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    gguf, tokenizer_dir = _tool("model.sh")[-2:]
    binary = os.environ.get("DFLASH_LLAMA_SERVER_BIN") or _tool("build.sh")[-1]
    port = _port()
    server = subprocess.Popen([binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
                               "-np", "8", "-c", "16384", "--threads", str(os.cpu_count())],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        tokenizer = load_tokenizer(tokenizer_dir)
        prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content":
                   f"Explain {TOPICS[i % len(TOPICS)]}" + " please" * (i % 5)}])
                   for i in range(args.prompts)]  # fmt: skip
        rates: dict[int, list[float]] = {1: [], 8: []}
        texts: dict[int, list[str]] = {}
        for r in range(args.rounds):
            for concurrency in (1, 8) if r % 2 == 0 else (8, 1):
                client = CompletionClient(ServerSettings(url, concurrency=concurrency))
                client.served_models()
                start = time.perf_counter()
                done = client.complete_all(prompts, max_tokens=args.max_new_tokens,
                                           temperature=0.0, seed=0, stop_token_ids=())  # fmt: skip
                wall = time.perf_counter() - start
                rates[concurrency].append(sum(c.tokens for c in done) / wall)
                texts[concurrency] = [c.text for c in done]
        one, eight = statistics.median(rates[1]), statistics.median(rates[8])
        same = sum(a == b for a, b in zip(texts[1], texts[8], strict=True))
        print(json.dumps({"prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
                          "concurrency_1_tokens_per_s": round(one, 1),
                          "concurrency_8_tokens_per_s": round(eight, 1),
                          "ratio": round(eight / one, 2), "same_text": f"{same}/{len(prompts)}",
                          "rounds": args.rounds, "cpus": os.cpu_count()}))  # fmt: skip
    finally:
        server.terminate()
        server.wait(10)


if __name__ == "__main__":
    main()
