"""`eval --server`: the engine's counters read into τ, and what a server can do wrong.

The real engine is in tests/integration/test_vllm_serving.py. Here a small HTTP server on
loopback speaks vLLM's endpoints, for what no real engine shows on demand: traffic that
is not ours, a server that is not speculative or has no metrics, one that dies midway.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from dflash.cli import cli
from dflash.eval.served import evaluate_served, parse_spec_counters
from dflash.target.served import CompletionClient, ServerError, ServerSettings

MODEL = "/models/target"
# Lines as vLLM 0.32 writes them (two engines of one model, and a second model).
PAGE = """# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="/models/target"} 10.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="/models/target"} 5.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="/models/target"} 1.79e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="/models/target"} 105.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="/models/target"} 30.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/models/target",position="0"} 12.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="/models/target",position="0"} 2.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/models/target",position="1"} 9.0
vllm:spec_decode_num_drafts_total{engine="0",model_name="other"} 99.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="/models/target"} 3.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="/models/target"} 1.0
vllm:generation_tokens_total{engine="0",model_name="/models/target"} 77.0
"""  # noqa: E501


def test_the_counters_of_one_model_are_summed_over_engines():
    counters = parse_spec_counters(PAGE, MODEL)
    assert counters is not None
    assert (counters.drafts, counters.draft_tokens, counters.accepted) == (15, 105, 30)
    assert counters.accepted_per_position == (14, 9)
    assert (counters.requests, counters.generation_tokens) == (4, 77)
    assert parse_spec_counters("vllm:generation_tokens_total 5.0\n", MODEL) is None


class FakeEngine:
    """Counts as a speculative engine would: each completion of n tokens takes
    `cycles(n)` drafts accepting `accept` tokens each at the first positions."""

    def __init__(
        self,
        *,
        speculative: bool = True,
        metrics: bool = True,
        die_after: int | None = None,
        other_requests: int = 0,
        token_ids: list[int] | None = None,
    ) -> None:
        self.speculative, self.metrics, self.die_after = speculative, metrics, die_after
        self.token_ids = token_ids  # what /tokenize answers; None: it has no /tokenize
        self.other_requests = other_requests
        self.drafts = self.accepted = self.requests = self.tokens = 0
        self.per_position = [0, 0, 0]
        self.served = 0
        self.traceparents: list[str | None] = []  # each completion request's header
        self.lock = threading.Lock()

    def complete(self, max_tokens: int, prompt_index: int) -> int:
        accept = prompt_index % 3  # a different τ for each prompt
        with self.lock:
            tokens = max_tokens
            if self.speculative:
                cycles = -(-tokens // (accept + 1))
                self.drafts += cycles
                self.accepted += cycles * accept
                for k in range(accept):
                    self.per_position[k] += cycles
            self.requests += 1
            self.tokens += tokens
            return tokens

    def page(self) -> str:
        with self.lock:
            lines = [
                f'vllm:request_success_total{{model_name="{MODEL}"}} {self.requests}',
                f'vllm:generation_tokens_total{{model_name="{MODEL}"}} {self.tokens}',
            ]
            if self.speculative:
                lines += [
                    f'vllm:spec_decode_num_drafts_total{{model_name="{MODEL}"}} {self.drafts}',
                    f'vllm:spec_decode_num_accepted_tokens_total{{model_name="{MODEL}"}} '
                    f"{self.accepted}",
                    *(
                        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="{MODEL}",'
                        f'position="{k}"}} {v}'
                        for k, v in enumerate(self.per_position)
                    ),
                ]
            return "\n".join(lines) + "\n"


@pytest.fixture
def engine_server() -> Iterator[Any]:
    servers: list[ThreadingHTTPServer] = []

    def start(engine: FakeEngine) -> str:
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, body: str, kind: str = "application/json") -> None:
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 - the http.server hook name
                if self.path == "/v1/models":
                    self._send(200, json.dumps({"data": [{"id": MODEL, "owned_by": "vllm"}]}))
                elif self.path == "/metrics" and engine.metrics:
                    self._send(200, engine.page(), "text/plain")
                else:
                    self._send(404, "{}")

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/tokenize":
                    if engine.token_ids is None:  # the served name is compared instead
                        self._send(404, "{}")
                    else:
                        self._send(200, json.dumps({"tokens": engine.token_ids}))
                    return
                if engine.die_after is not None and engine.served >= engine.die_after:
                    self.close_connection = True
                    self.connection.close()
                    return
                engine.served += 1
                engine.traceparents.append(self.headers.get("traceparent"))
                for _ in range(engine.other_requests):
                    engine.complete(5, 0)
                tokens = engine.complete(body["max_tokens"], body["seed"])
                reply = {
                    "choices": [{"text": "x", "finish_reason": "length"}],
                    "usage": {"completion_tokens": tokens},
                }
                self._send(200, json.dumps(reply))

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _client(url: str) -> CompletionClient:
    client = CompletionClient(ServerSettings(url, retries=1, backoff_s=0.01))
    client.model = MODEL
    return client


def test_tau_per_prompt_and_pooled_come_from_the_counters(engine_server):
    engine = FakeEngine()
    prompts = [[1, 2, 3]] * 6
    result = evaluate_served(_client(engine_server(engine)), prompts, 12, (2,), log=print)
    figures = result.figures()
    # Prompt i accepts i % 3 per cycle: τ 1, 2, 3 in turn.
    assert figures.tau == pytest.approx(2.0)
    assert figures.tau_pooled == pytest.approx(1 + engine.accepted / engine.drafts)
    assert figures.acceptance_per_position[0] == pytest.approx(
        engine.per_position[0] / engine.drafts
    )
    assert figures.other_traffic is None and figures.new_tokens == 72
    assert result.block_size == 4


def test_traffic_that_is_not_ours_is_reported(engine_server):
    lines: list[str] = []
    engine = FakeEngine(other_requests=1)
    result = evaluate_served(_client(engine_server(engine)), [[1]] * 3, 6, (), log=lines.append)
    assert result.figures().other_traffic == {"requests": 3, "generation_tokens": 15}
    assert any("not ours" in line for line in lines)


@pytest.mark.parametrize(
    ("engine", "says"),
    [
        (FakeEngine(speculative=False), "speculative-decoding counters"),
        (FakeEngine(metrics=False), "speculative-decoding counters"),
        (FakeEngine(die_after=2), "after 1 retries"),
    ],
    ids=["not-speculative", "no-metrics", "dies-midway"],
)
def test_a_server_that_cannot_measure_is_one_line(engine_server, engine, says):
    with pytest.raises(ServerError, match=says):
        evaluate_served(_client(engine_server(engine)), [[1]] * 4, 6, (), log=print)


def test_the_command_says_one_line_and_exits_2(engine_server, tmp_path):
    url = engine_server(FakeEngine(speculative=False))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    result = CliRunner().invoke(
        cli,
        [
            "eval",
            "--server",
            url,
            "--target",
            "builtin:tiny",
            "--eval-data",
            str(prompts),
            "--retries",
            "0",
        ],
    )
    assert result.exit_code == 2, result.output
    assert result.output.count("Error:") == 1 and "speculative" in result.output
    result = CliRunner().invoke(cli, ["eval", "--max-new-tokens", "4"])
    assert result.exit_code == 2 and "--drafter" in result.output


def test_a_bad_url_is_refused_before_any_work(tmp_path):
    result = CliRunner().invoke(
        cli, ["eval", "--server", "localhost:8000", "--target", "builtin:tiny"]
    )
    assert result.exit_code == 2 and "http://" in result.output


def test_a_server_of_another_tokenizer_is_refused_before_any_prompt(engine_server, tmp_path):
    engine = FakeEngine(token_ids=[5, 6, 7])
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    args = ["eval", "--server", engine_server(engine), "--target", "builtin:tiny"]
    result = CliRunner().invoke(cli, [*args, "--eval-data", str(prompts)])
    assert result.exit_code == 2, result.output
    assert "tokenizer differs" in result.output and result.output.count("Error:") == 1
    assert engine.requests == 0


def _spans(path: Path) -> list[dict[str, Any]]:
    """Every span of an OTLP-JSON lines file, its scope's name added."""
    found = []
    for line in path.read_text().splitlines():
        for resource in json.loads(line)["resourceSpans"]:
            for scope in resource["scopeSpans"]:
                found += [{**s, "scope": scope["scope"]["name"]} for s in scope["spans"]]
    return found


def test_each_completion_is_a_genai_client_span_whose_traceparent_the_server_gets(
    engine_server, tmp_path
):
    engine = FakeEngine()
    prompts = tmp_path / "p.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"hi {i}"}]} for i in range(3)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trace_file = tmp_path / "trace.jsonl"
    url = engine_server(engine)
    # A process of its own: the command installs its provider as the global one.
    done = subprocess.run(
        [sys.executable, "-m", "dflash.cli", "eval", "--server", url, "--target", "builtin:tiny"]
        + ["--eval-data", str(prompts), "--max-new-tokens", "6", "--trace-file", str(trace_file)],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "eval: tracing: shutdown" in done.stderr and "failed 0" in done.stderr
    spans = _spans(trace_file)
    (root,) = [s for s in spans if s["name"] == "dflash.eval"]
    clients = [s for s in spans if s["name"] == f"text_completion {MODEL}"]
    assert len(clients) == 3 == len(engine.traceparents)
    for span in clients:
        assert span["kind"] == 3  # SPAN_KIND_CLIENT
        assert span["traceId"] == root["traceId"] and span["parentSpanId"] == root["spanId"]
        attrs = {a["key"]: next(iter(a["value"].values())) for a in span["attributes"]}
        assert attrs["gen_ai.operation.name"] == "text_completion"
        assert attrs["gen_ai.provider.name"] == "vllm"
        assert attrs["gen_ai.request.model"] == MODEL
        assert attrs["gen_ai.request.max_tokens"] == "6"  # OTLP JSON: int64 as a string
        assert attrs["gen_ai.usage.output_tokens"] == "6"
        assert attrs["server.address"] == "127.0.0.1"
    # What the server got is each client span's own context, as W3C traceparent: sampled,
    # and (SDK 1.42 and later, W3C Trace Context level 2) saying its trace id is random.
    from opentelemetry.trace import TraceFlags

    flags = f"{TraceFlags.SAMPLED | getattr(TraceFlags, 'RANDOM_TRACE_ID', 0):02x}"
    sent = {f"00-{s['traceId']}-{s['spanId']}-{flags}" for s in clients}
    assert set(engine.traceparents) == sent


def test_a_server_error_marks_the_client_span(engine_server):
    """Through the SDK in this process (no global provider is touched)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from dflash.target import served

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    client = _client(engine_server(FakeEngine(die_after=0)))
    kept, served._tracer = served._tracer, provider.get_tracer("test")
    try:
        with pytest.raises(ServerError):
            client.complete([1], max_tokens=4, temperature=0.0, seed=0, stop_token_ids=())
    finally:
        served._tracer = kept
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code.name == "ERROR"
    assert span.attributes is not None and span.attributes["error.type"] == "ServerError"
