"""The engine `train --eval-engine vllm` starts: refused before any work when it cannot
run, one line when it dies before serving, and its whole process group gone after.

Real processes stand in for vLLM here (a python that serves /health and forks a child,
as vLLM's engine core does); the real engine is tests/integration/test_vllm_serving.py.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path

import pytest

from dflash.run.engine import EngineError, check_vllm_command, engine_args, served_drafter

SERVER = """
import os, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer
port = int(sys.argv[sys.argv.index("--port") + 1])
child = os.fork()
if child == 0:  # an "engine core" that would outlive a parent killed alone
    open(os.environ["CHILD_PID_FILE"], "w").write(str(os.getpid()))
    time.sleep(3600)
class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has ended; it waits only for its parent to read its status.
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.split(") ", 1)[1][0] != "Z"


def test_a_command_that_is_not_on_path_is_refused_at_once():
    with pytest.raises(EngineError, match="not an executable"):
        check_vllm_command("no-such-vllm-here serve")
    with pytest.raises(EngineError, match="not a command line"):
        check_vllm_command("'unclosed")
    check_vllm_command(f"{sys.executable} -m vllm.entrypoints.openai.api_server")


def test_the_command_gets_the_target_the_drafter_and_the_port(tmp_path):
    args = engine_args("vllm serve --dtype bfloat16", "Qwen/Qwen3-8B", tmp_path, 16, 8123)
    assert args[:4] == ["vllm", "serve", "--dtype", "bfloat16"]
    assert args[args.index("--model") + 1] == "Qwen/Qwen3-8B"
    assert args[args.index("--port") + 1] == "8123"
    spec = args[args.index("--speculative-config") + 1]
    assert '"num_speculative_tokens": 15' in spec and str(tmp_path) in spec


def test_an_engine_that_exits_before_serving_is_one_line_naming_its_log(tmp_path):
    command = f"{shlex.quote(sys.executable)} -c 'print(\"no GPU here\"); raise SystemExit(3)'"
    with pytest.raises(EngineError, match=r"status 3 before serving .*no GPU here"):
        with served_drafter(command, "target", tmp_path, 8, tmp_path):
            pass


def test_the_engine_and_its_children_are_gone_after(tmp_path, monkeypatch):
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    child_file = tmp_path / "child.pid"
    monkeypatch.setenv("CHILD_PID_FILE", str(child_file))
    command = f"{shlex.quote(sys.executable)} {shlex.quote(str(script))}"
    with served_drafter(command, "target", tmp_path, 8, tmp_path) as url:
        assert url.startswith("http://127.0.0.1:")
        deadline = time.monotonic() + 10
        while not child_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int(child_file.read_text())
        assert _alive(child)
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the engine's child outlived it"
    assert (tmp_path / "vllm.log").exists()
