"""The hub probe has one deadline: an endpoint that takes the TCP connection and never
answers (a black-holing proxy, a hung mirror) costs it seconds, not minutes. Real
sockets: one that accepts and never answers, and a real HTTP server."""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflash.target import hf
from tests.dflash.app_fixtures import write_corpus

pytest.importorskip("huggingface_hub")


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """http://127.0.0.1:PORT that completes TCP handshakes (the kernel does, for the
    listen backlog) and never sends a byte."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        server.close()


def _use_endpoint(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf, "_PROBED", {})


def test_an_endpoint_that_never_answers_is_unreachable_within_the_deadline(
    monkeypatch: pytest.MonkeyPatch, silent_endpoint: str
) -> None:
    _use_endpoint(monkeypatch, silent_endpoint)
    started = time.monotonic()
    assert hf.hub_unreachable(timeout_s=1.0) == "127.0.0.1: no answer within 1 s"
    assert time.monotonic() - started < 1.8
    started = time.monotonic()
    assert hf.hub_unreachable(timeout_s=1.0) is not None  # asked once per process
    assert time.monotonic() - started < 0.1


def test_an_endpoint_that_answers_is_reachable(monkeypatch: pytest.MonkeyPatch) -> None:
    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self) -> None:  # any status means the hub answers
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        _use_endpoint(monkeypatch, f"http://127.0.0.1:{server.server_address[1]}")
        assert hf.hub_unreachable(timeout_s=2.0) is None
    finally:
        server.shutdown()


def test_nothing_listening_is_unreachable_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    _use_endpoint(monkeypatch, f"http://127.0.0.1:{port}")
    started = time.monotonic()
    assert hf.hub_unreachable(timeout_s=3.0) == "127.0.0.1: Connection refused"
    assert time.monotonic() - started < 1.0


@pytest.mark.slow
@pytest.mark.parametrize("dry_run", [True, False])
def test_train_with_a_silent_hub_is_one_line_in_seconds(
    tmp_path: Path, silent_endpoint: str, dry_run: bool
) -> None:
    """The whole command: config, tokenizer and weights lookups share the one probe."""
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env["HF_ENDPOINT"] = silent_endpoint
    env["HF_HOME"] = str(tmp_path / "hf-home")  # an empty Hugging Face cache
    args = ["train", "--target", "no-org/no-model", "--data", str(write_corpus(tmp_path))]
    args += ["--output-dir", str(tmp_path / "run"), "--steps", "2"]
    args += ["--dry-run"] if dry_run else []
    started = time.monotonic()
    command = [sys.executable, "-m", "dflash.cli", *args]
    child = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    took_s = time.monotonic() - started
    assert child.returncode == 2, child.stderr
    assert child.stderr.strip().splitlines() == [
        line for line in child.stderr.splitlines() if line.startswith("Error:")
    ], child.stderr  # the Error: line alone
    assert "the hub cannot be reached" in child.stderr and "no answer within 3 s" in child.stderr
    assert took_s < 30, took_s  # 3 s of probing and the start-up; it was more than 120 s
    assert not (tmp_path / "run").exists()
