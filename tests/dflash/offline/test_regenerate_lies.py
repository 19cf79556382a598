"""Regeneration that lies is caught: a server answering `"text": null` is one line and
never the reply "None", and a cached regeneration of the embedded default that is cut
short or changed is generated again, never read as complete."""

from __future__ import annotations

import dataclasses
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from dflash.data.tokenizer import ByteTokenizer
from dflash.offline import regenerate as regen_mod
from dflash.offline.config import RegenerateConfig
from dflash.offline.regenerate import cache_check_path, regenerate
from dflash.target.load import wrap_tiny
from dflash.target.served import CompletionClient, ServerError, ServerSettings, TokenizerTarget
from dflash.target.tiny import TinyLM, TinyLMConfig


class NullServer:
    """An OpenAI-compatible endpoint whose every completion has `"text": null`."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _send(self, body: dict) -> None:
                raw = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self) -> None:  # noqa: N802 - the http.server hook name
                self._send({"data": [{"id": "null-model"}]})

            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers["Content-Length"]))
                choice = {"text": None, "finish_reason": "stop"}
                self._send({"choices": [choice], "usage": {"completion_tokens": 3}})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_server_answering_null_text_is_one_line_and_no_reply_is_none(tmp_path) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"question {i}"}]}) + "\n"
            for i in range(40)
        )
    )
    server = NullServer()
    out = tmp_path / "answers.jsonl"
    try:
        client = CompletionClient(ServerSettings(server.url, concurrency=2, retries=0))
        client.model = "null-model"
        settings = RegenerateConfig(max_new_tokens=8, chunk_lines=4)
        target = TokenizerTarget("builtin:tiny", ByteTokenizer())
        with pytest.raises(ServerError) as caught:
            regenerate(target, str(data), out, settings=settings, server=client)
    finally:
        server.close()
    (line,) = str(caught.value).splitlines()
    assert line == (
        f'--server {server.url}: /v1/completions answered "text": null, not the text of a '
        "reply: the server is broken or not OpenAI-compatible; nothing of this reply is written"
    )
    assert "None" not in out.read_text()


@pytest.fixture
def small_embedded(tmp_path, monkeypatch):
    """The embedded default's regeneration by a small untrained tiny LM, in seconds."""
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path / "cache"))
    recipe = RegenerateConfig(
        max_new_tokens=4, prefix_tokens=16, windows_per_document=1, batch_size=256, chunk_lines=512
    )
    monkeypatch.setattr(regen_mod, "EMBEDDED_RECIPE", recipe)
    torch.manual_seed(0)
    config = TinyLMConfig(hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32)
    return wrap_tiny(TinyLM(config))


def test_a_cached_regeneration_cut_short_or_changed_is_generated_again(
    small_embedded, monkeypatch
) -> None:
    lines: list[str] = []
    path = regen_mod.embedded_regeneration(small_embedded, 0.05, lines.append)
    whole = path.read_text()
    count = whole.count("\n")
    check = json.loads(cache_check_path(path).read_text())
    assert check["lines"] == count and len(check["sha256"]) == 64
    calls = []
    real = regen_mod.regenerate

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(regen_mod, "regenerate", counted)
    assert regen_mod.embedded_regeneration(small_embedded, 0.05, lines.append) == path
    assert not calls  # whole: read as it is
    raw = path.read_bytes()
    damages = {
        f"holds {count // 2:,} of its {count:,} lines": lambda: path.write_bytes(
            b"".join(raw.splitlines(keepends=True)[: count // 2]) + b'{"text": "half a li'
        ),
        "is not the file that was written (its SHA-256 differs)": lambda: path.write_bytes(
            raw.replace(b'"text": "', b'"text": "X', 1)
        ),
        "has no record of its length and checksum": lambda: cache_check_path(path).unlink(),
    }
    for said, damage in damages.items():
        lines.clear()
        damage()
        assert regen_mod.embedded_regeneration(small_embedded, 0.05, lines.append) == path
        assert any(f"the cached regeneration {path} {said}" in line for line in lines), lines
        assert path.read_text() == whole
    assert len(calls) == len(damages)


def test_a_regeneration_from_a_copy_of_the_default_recipe_is_not_a_cache(small_embedded) -> None:
    """The check file is the cache's alone: a `regenerate --output` has its run record."""
    path = regen_mod.embedded_regeneration(small_embedded, 0.05, lambda _: None)
    direct = path.with_name("direct.jsonl")
    settings = dataclasses.replace(regen_mod.EMBEDDED_RECIPE, heldout_fraction=0.05)
    regenerate(small_embedded, "embedded", direct, settings=settings)
    assert direct.read_text() == path.read_text()
    assert not cache_check_path(direct).exists()
