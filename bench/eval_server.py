"""`eval --server` (τ from vLLM's own counters) against in-process `eval`, side by side:
the same drafter, target and prompts; prints both τ, their ratio and the wall-time ratio.

    python bench/eval_server.py --drafter DIR --target HF_DIR --eval-data PROMPTS.jsonl
        [--max-new-tokens 64] [--concurrency 1]

vLLM's CPU build comes from tools/vllm/venv.sh. The server starts first (its start-up is
not counted: a user evaluates against a server that runs), then each evaluation runs
alone. The in-process wall time includes its greedy baseline, as `eval` always measures
the speedup; its speculative decoding alone is printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(drafter: Path, target: str, log: Path) -> tuple[subprocess.Popen, str]:
    python = subprocess.run(
        ["bash", str(ROOT / "tools/vllm/venv.sh")], capture_output=True, text=True, check=True
    ).stdout.split()[-1]
    block = json.loads((drafter / "config.json").read_text())["block_size"]
    spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": block - 1}
    port = _port()
    args = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        target,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",
        "--enforce-eager",
        "--speculative-config",
        json.dumps(spec),
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    proc = subprocess.Popen(
        args, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return proc, url
        except OSError:
            if proc.poll() is not None:
                sys.exit(f"vLLM exited: see {log}")
            time.sleep(1)
    sys.exit(f"vLLM did not serve in 600 s: see {log}")


def evaluate(args: list[str], out: Path) -> tuple[dict, float]:
    start_s = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "dflash.cli", "eval", *args, "--json", str(out)],
        check=True,
        stderr=subprocess.DEVNULL,
    )
    return json.loads(out.read_text()), time.perf_counter() - start_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", type=Path, required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--eval-data", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=1)
    opts = parser.parse_args()
    common = [
        "--target",
        opts.target,
        "--eval-data",
        opts.eval_data,
        "--max-new-tokens",
        str(opts.max_new_tokens),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        proc, url = start_server(opts.drafter, opts.target, work / "vllm.log")
        try:
            served, served_s = evaluate(
                ["--server", url, "--concurrency", str(opts.concurrency), *common],
                work / "served.json",
            )
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
        ours, ours_s = evaluate(["--drafter", str(opts.drafter), *common], work / "ours.json")
    print(
        f"τ pooled: server {served['tau_pooled']:.4f}, in process {ours['tau_pooled']:.4f} "
        f"(ratio {served['tau_pooled'] / ours['tau_pooled']:.4f})"
    )
    if served.get("tau") is not None:
        print(f"τ per-prompt mean: server {served['tau']:.4f}, in process {ours['tau']:.4f}")
    for who, figures in (("server", served), ("in process", ours)):
        rates = [round(a, 4) for a in figures["acceptance_per_position"]]
        print(f"acceptance per position, {who}: {rates}")
    print(
        f"wall: eval --server {served_s:.1f} s, in-process eval {ours_s:.1f} s "
        f"({ours_s / served_s:.1f}x); in-process speculative decoding alone "
        f"{ours['speculative_s']:.1f} s ({ours['speculative_s'] / served_s:.1f}x)"
    )


if __name__ == "__main__":
    main()
