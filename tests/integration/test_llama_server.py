"""`regenerate --server` against a real OpenAI-compatible server: llama.cpp's llama-server
(tools/llama_server/build.sh) serving SmolLM2-135M-Instruct (tools/llama_server/model.sh),
with --target the same model's tokenizer.

Without a C++ toolchain the tests skip with the reason; DFLASH_REQUIRE_LLAMA_SERVER=1
(CI) fails them instead.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import CHAT_PROMPTS as PROMPTS
from conftest import REPO_ROOT, die_with_parent, free_port

TOOLS = REPO_ROOT / "tools" / "llama_server"
HELDOUT = 0.01


def _unavailable(reason: str) -> None:
    if os.environ.get("DFLASH_REQUIRE_LLAMA_SERVER") == "1":
        why = f"{reason} (DFLASH_REQUIRE_LLAMA_SERVER=1: these tests must run)"
        pytest.fail(why, pytrace=False)
    pytest.skip(reason)


def _tool(script: str, timeout_s: float) -> list[str]:
    command, env = ["bash", str(TOOLS / script)], {**os.environ, "PYTHON": sys.executable}
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout_s, env=env, check=False
        )
    except subprocess.TimeoutExpired:
        _unavailable(f"tools/llama_server/{script} took longer than {timeout_s:.0f} s")
    if done.returncode != 0:
        _unavailable(f"tools/llama_server/{script} failed:\n{done.stderr[-2000:]}")
    return done.stdout.strip().splitlines()


@pytest.fixture(scope="module")
def model() -> tuple[Path, Path]:
    gguf, tokenizer = _tool("model.sh", 900)[-2:]
    return Path(gguf), Path(tokenizer)


@pytest.fixture(scope="module")
def server(model: tuple[Path, Path]) -> Iterator[str]:
    binary = os.environ.get("DFLASH_LLAMA_SERVER_BIN") or _tool("build.sh", 1800)[-1]
    port = free_port()
    command = [binary, "-m", str(model[0]), "--host", "127.0.0.1", "--port", str(port)]
    command += ["-np", "8", "-c", "8192", "--threads", str(os.cpu_count() or 2)]
    # OpenMP threads that spin while the suite loads the cores slow decoding tenfold.
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    pipes = dict(stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    proc = subprocess.Popen(command, **pipes, preexec_fn=die_with_parent, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as reply:
                if reply.status == 200:
                    break
        except OSError:
            if proc.poll() is not None:
                pytest.fail(f"llama-server exited: {proc.stderr.read()[-2000:]}")
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("llama-server did not become healthy in 120 s")
    yield url
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


def _held_in(data: Path) -> list[str]:
    """The prompts regeneration answers: the held-out split hashes the file's path, so a
    line may fall out of any tmp_path."""
    from dflash.data.sources import DataReport
    from dflash.offline.regenerate import read_items

    items = read_items(str(data), DataReport(), HELDOUT)
    return [item["messages"][0]["content"] for item in items]


def _prompts(path: Path, count: int = len(PROMPTS)) -> Path:
    lines = [json.dumps({"messages": [{"role": "user", "content": p}]}) for p in PROMPTS[:count]]
    path.write_text("\n".join(lines) + "\n")
    return path


def _regenerate(
    url: str, tokenizer: Path, data: Path, out: Path, *extra: str, **popen: object
) -> subprocess.Popen:
    command = [sys.executable, "-m", "dflash.cli", "regenerate", "--server", url]
    paths = ["--target", str(tokenizer), "--data", str(data), "--output", str(out)]
    settings = ["--max-new-tokens", "16", "--heldout-fraction", str(HELDOUT)]
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.Popen([*command, *paths, *settings, *extra], **pipes, **popen)  # type: ignore[call-overload]


@pytest.mark.slow
def test_regenerate_through_llama_server_answers_every_prompt(server, model, tmp_path):
    data, out = _prompts(tmp_path / "prompts.jsonl"), tmp_path / "regen.jsonl"
    proc = _regenerate(server, model[1], data, out, "--concurrency", "4", "--chunk-lines", "4")
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    assert "tokenizer equal to --target" in stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["messages"][0]["content"] for r in records] == _held_in(data)
    replies = [r["messages"][1] for r in records]
    assert all(m["role"] == "assistant" and m["content"].strip() for m in replies), replies
    # Greedy: the same server gives the same replies again, one request at a time.
    again = tmp_path / "again.jsonl"
    proc = _regenerate(server, model[1], data, again, "--concurrency", "1", "--chunk-lines", "4")
    assert proc.communicate(timeout=600)[0] is not None and proc.returncode == 0
    pairs = zip(out.read_text().splitlines(), again.read_text().splitlines(), strict=True)
    same = sum(a == b for a, b in pairs)
    assert same >= len(records) - 2, f"{same}/{len(records)} equal at concurrency 1 and 4"


@pytest.mark.slow
def test_a_killed_server_regeneration_resumes_with_every_reply_once(server, model, tmp_path):
    data, out = _prompts(tmp_path / "prompts.jsonl"), tmp_path / "regen.jsonl"
    proc = _regenerate(server, model[1], data, out, "--concurrency", "2", "--chunk-lines", "2")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and len(out.read_text().splitlines()) >= 2:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    written = len(out.read_text().splitlines())
    assert 2 <= written < len(_held_in(data)), "the kill came after the end: nothing to resume"
    proc = _regenerate(server, model[1], data, out, "--concurrency", "2", "--chunk-lines", "2")
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    assert "continued after line" in stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["messages"][0]["content"] for r in records] == _held_in(data)  # each once, in order


@pytest.mark.slow
def test_bad_servers_are_one_line(server, model, tmp_path):
    data = _prompts(tmp_path / "prompts.jsonl", 2)

    def error(*extra: str, url: str = server) -> str:
        out = tmp_path / f"o{time.monotonic_ns()}.jsonl"
        proc = _regenerate(url, model[1], data, out, *extra)
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 2, stderr[-2000:]
        lines = [s for s in stderr.splitlines() if s.startswith("Error:")]
        assert len(lines) == 1 and "Traceback" not in stderr, stderr[-2000:]
        return lines[0]

    dead = f"http://127.0.0.1:{free_port()}"
    # A refused connection is not retried: nothing listens there (issue 41 item 5).
    assert "connection refused: nothing listens there" in error("--retries", "1", url=dead)
    assert "not --server-model 'nope'" in error("--server-model", "nope")
    proc = _regenerate(server, "builtin:tiny", data, tmp_path / "tiny.jsonl")
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "whose tokenizer differs from --target builtin:tiny" in stderr
    assert "expected an http:// or https:// URL" in error(url="localhost:8000")
