"""A target served by an OpenAI-compatible server (vLLM, SGLang, llama.cpp's server).

A target too large for this process is served by an inference engine with tensor and
pipeline parallelism. `regenerate --server URL` and `eval --server URL` send it the
prompts this project renders (token ids, so the server sees exactly the training
tokenization) to `/v1/completions`, `--concurrency` at a time: regeneration records the
text of each reply, evaluation the engine's own speculative-decoding counters
(dflash.eval.served). The target's tokenizer (and its chat template) is all that loads
here.

Failures: the first request, the probe of the server (`GET /v1/models`), has a deadline
of its own (PROBE_S, as the hub's probe) and is not retried: a server that is not there,
refuses the connection or never answers is one line within seconds. Later, a request
that times out, loses its connection or gets 429/5xx is retried with exponential backoff
up to `retries` times; a refused connection (nothing listens any more) and another 4xx
are one line at once. The model
the server serves is checked against `--target`'s tokenizer before any prompt is sent:
by the server's `/tokenize` where it has one (vLLM, SGLang and llama.cpp do), else by
name.

Tracing: each completion is an OpenTelemetry GenAI client span (`text_completion MODEL`,
kind CLIENT, the `gen_ai.*` request, response and usage attributes of the semantic
conventions) through the global TracerProvider, and every request carries the current
context as W3C `traceparent`: a vLLM started with `--otlp-traces-endpoint` parents its
`llm_request` span on ours, so one trace holds the command and the engine. Without a
provider (nothing configured) both cost nothing.
"""

from __future__ import annotations

import heapq
import itertools
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass, field
from functools import partial
from pathlib import PurePosixPath
from typing import Any, ParamSpec, TypeVar
from urllib.parse import urlsplit

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from dflash import __version__
from dflash.config.commands import ServerConfig
from dflash.data.tokenizer import Tokenizer, encode_texts, tokenizer_fingerprint
from dflash.errors import DFlashError, first_line
from dflash.summary import JSON

PROBE = "Speculative decoding drafts 16 tokens; the target checks them all at once."
PROBE_S = 3.0
"""The deadline of the probe of a server (its first request), as the hub's (HUB_PROBE_S)."""
OPERATION = "text_completion"
"""gen_ai.operation.name of a /v1/completions request (the GenAI semantic conventions)."""
# A ProxyTracer until the application (or `dflash.observe`) sets the global provider.
_tracer = trace.get_tracer("dflash.target.served", __version__)


class ServerError(DFlashError):
    """The server cannot serve this command; one line naming the URL and why.
    `status`: the HTTP status the server answered with, if it answered."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ServerSettings:
    url: str  # the server's base URL, with or without /v1
    concurrency: int = 8
    timeout_s: float = ServerConfig.request_timeout  # per request
    retries: int = ServerConfig.retries
    model: str | None = None  # the served model to use; None: the server's only one
    backoff_s: float = 1.0  # first wait; doubles each retry

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ServerError(f"--server {self.url!r}: expected an http:// or https:// URL")
        for name, low in (("concurrency", 1), ("retries", 0)):
            if getattr(self, name) < low:
                raise ServerError(f"--{name} {getattr(self, name)} must be >= {low}")
        if not self.timeout_s > 0:
            raise ServerError(f"--request-timeout {self.timeout_s} must be > 0")

    @property
    def base(self) -> str:
        return self.url.rstrip("/").removesuffix("/v1")


@dataclass
class Completion:
    text: str
    tokens: int  # the server's count of generated tokens
    cut: bool  # ended at max_tokens, not at a stop


@dataclass
class TokenizerTarget:
    """What regeneration needs of a target it does not run: its tokenizer and name."""

    spec: str
    tokenizer: Tokenizer
    # Any: keywords of the tokenizer's chat template, passed on as they are
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


_T = TypeVar("_T")
_P = ParamSpec("_P")


class _Requests:
    """`workers` threads that send requests, the lowest priority first (a regeneration's
    chunk and wave, then arrival), so requests sent ahead never delay the chunk that is
    written next. Daemon threads: a run that stops does not wait for replies in flight."""

    def __init__(self, workers: int) -> None:
        self._workers = workers
        # Any: each entry's call has a result type of its own (submit ties the two)
        self._queue: list[tuple[tuple[int, int], int, Future[Any], Callable[[], Any]]] = []
        self._changed = threading.Condition()
        self._arrival = itertools.count()
        self._threads: list[threading.Thread] = []

    def submit(self, priority: tuple[int, int], call: Callable[[], _T]) -> Future[_T]:
        future: Future[_T] = Future()
        with self._changed:
            heapq.heappush(self._queue, (priority, next(self._arrival), future, call))
            if len(self._threads) < self._workers:
                worker = threading.Thread(target=self._work, name="server-request", daemon=True)
                self._threads.append(worker)
                worker.start()
            self._changed.notify()
        return future

    def _work(self) -> None:
        while True:
            with self._changed:
                while not self._queue:
                    self._changed.wait()
                *_, future, call = heapq.heappop(self._queue)
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while it waited
            try:
                future.set_result(call())
            except BaseException as exc:  # handed to whoever waits on it
                future.set_exception(exc)


def _in_context(
    context: otel_context.Context, call: Callable[_P, _T], *args: _P.args, **kw: _P.kwargs
) -> _T:
    token = otel_context.attach(context)
    try:
        return call(*args, **kw)
    finally:
        otel_context.detach(token)


def _response_attributes(
    reply: JSON, prompt_tokens: int, completion: Completion
) -> dict[str, AttributeValue]:
    """The GenAI response and usage attributes of a /v1/completions reply."""
    usage = reply.get("usage") or {}
    reasons = [str(c.get("finish_reason")) for c in reply.get("choices") or [] if c]
    attributes: dict[str, AttributeValue] = {
        "gen_ai.usage.input_tokens": int(usage.get("prompt_tokens") or prompt_tokens),
        "gen_ai.usage.output_tokens": completion.tokens,
        "gen_ai.response.finish_reasons": reasons,
    }
    for key, name in (("id", "gen_ai.response.id"), ("model", "gen_ai.response.model")):
        if isinstance(reply.get(key), str):
            attributes[name] = reply[key]
    return attributes


class CompletionClient:
    """Requests to one server; thread-safe (each call opens its own connection). At most
    `concurrency` completions are in flight, however many callers ask at once, so that a
    regeneration can send the next chunk's prompts while the last replies of one come."""

    def __init__(self, settings: ServerSettings, sleep: Callable[[float], None] = time.sleep):
        self.settings, self._sleep = settings, sleep
        self.model = settings.model or ""
        self.provider: str | None = None  # the models' `owned_by` (vllm, sglang, llamacpp)
        self._requests = _Requests(settings.concurrency)
        self._stopped = threading.Event()

    def stop(self) -> None:
        """Send no completion from now on: each one not yet sent raises ServerError."""
        self._stopped.set()

    # -- HTTP

    def _request(
        self,
        method: str,
        path: str,
        body: JSON | None = None,
        *,
        text: bool = False,
        probe: bool = False,
    ) -> Any:  # Any: a JSON value of the server's choosing (`text`: a str)
        """The reply parsed as JSON (`text`: as it came), retried as the module says;
        `probe`: the first request, one try within PROBE_S."""
        url = self.settings.base + path
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", "Authorization": "Bearer EMPTY"}
        propagate.inject(headers)  # the current span (a completion's) as traceparent
        wait = self.settings.backoff_s
        timeout_s = min(self.settings.timeout_s, PROBE_S) if probe else self.settings.timeout_s
        retries = 0 if probe else self.settings.retries
        for attempt in range(retries + 1):
            request = urllib.request.Request(url, data=data, headers=headers, method=method)
            try:
                with urllib.request.urlopen(request, timeout=timeout_s) as reply:
                    payload = reply.read().decode()
                    return payload if text else json.loads(payload)
            except urllib.error.HTTPError as err:
                detail = err.read().decode(errors="replace")[:200]
                why = f"HTTP {err.code}: {detail}"
                if err.code != 429 and err.code < 500:
                    raise ServerError(f"--server {url}: {why}", err.code) from None
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as err:
                reason = getattr(err, "reason", err)
                if isinstance(reason, ConnectionRefusedError):
                    raise ServerError(
                        f"--server {url}: connection refused: nothing listens there (is the "
                        "server up, at this port?)"
                    ) from None
                why = first_line(reason)
                if probe and isinstance(reason, TimeoutError):
                    raise ServerError(
                        f"--server {url}: no answer within {timeout_s:g} s: is it an "
                        "OpenAI-compatible server that has finished starting?"
                    ) from None
            except ValueError as err:
                raise ServerError(f"--server {url}: the reply is not JSON: {err}") from None
            if attempt == retries:
                after = f" (after {retries} retries)" if retries else ""
                raise ServerError(f"--server {url}: {why}{after}") from None
            self._sleep(wait)
            wait *= 2
        raise AssertionError("unreachable")

    def metrics_text(self) -> str:
        """The server's Prometheus metrics page (/metrics), as text."""
        return str(self._request("GET", "/metrics", text=True))

    # -- checks

    def served_models(self) -> list[str]:
        reply = self._request("GET", "/v1/models", probe=True)
        try:
            models = [str(m["id"]) for m in reply["data"]]
            owners = {m.get("owned_by") for m in reply["data"] if isinstance(m, dict)}
            if len(owners) == 1 and isinstance(owner := owners.pop(), str) and owner:
                self.provider = owner
            return models
        except (KeyError, TypeError):
            raise ServerError(
                f"--server {self.settings.base}: /v1/models lists no models"
            ) from None

    def connect(
        self, target: TokenizerTarget, log: Callable[[str], None], command: str = "regenerate"
    ) -> None:
        """The served model (one line when --server-model is not among them, or the
        server serves several and none is named), then its tokenizer against ours;
        `command` begins the lines it logs."""
        models = self.served_models()
        if self.settings.model:
            if self.settings.model not in models:
                raise ServerError(
                    f"--server {self.settings.base} serves {models}, not --server-model "
                    f"{self.settings.model!r}"
                )
        elif len(models) != 1:
            raise ServerError(
                f"--server {self.settings.base} serves {len(models)} models {models}: name one "
                "with --server-model"
            )
        else:
            self.model = models[0]
        ours = encode_texts(target.tokenizer, [PROBE])[0].tolist()
        theirs = self._tokenize(PROBE)
        if theirs is None:
            served, named = PurePosixPath(self.model).name, PurePosixPath(target.spec).name
            if served.lower() != named.lower():
                log(
                    f"{command}: {self.settings.base} has no /tokenize to compare tokenizers; "
                    f"it serves {self.model!r} for --target {target.spec}"
                )
            return
        if theirs != ours:
            raise ServerError(
                f"--server {self.settings.base} serves {self.model!r}, whose tokenizer differs "
                f"from --target {target.spec}'s: a probe is {theirs[:8]}... there, "
                f"{ours[:8]}... here"
            )
        log(
            f"{command}: {self.settings.base} serves {self.model!r}, tokenizer equal to "
            f"--target {target.spec}'s; {self.settings.concurrency} requests at a time"
        )

    def _tokenize(self, text: str) -> list[int] | None:
        """The server's ids of `text` without special tokens, or None without /tokenize.
        One body for both dialects: llama.cpp reads content/add_special, vLLM and SGLang
        model/prompt/add_special_tokens; each ignores the other's keys."""
        llama_cpp = {"content": text, "add_special": False}
        vllm_sglang = {"model": self.model, "prompt": text, "add_special_tokens": False}
        body = {**llama_cpp, **vllm_sglang}
        try:
            reply = self._request("POST", "/tokenize", body)
        except ServerError as err:
            if err.status in (404, 405):
                return None
            raise
        tokens = reply.get("tokens") if isinstance(reply, dict) else None
        if not isinstance(tokens, list):
            return None
        return [t["id"] if isinstance(t, dict) else int(t) for t in tokens]

    # -- completions

    def complete(
        self,
        prompt: list[int],
        *,
        max_tokens: int,
        temperature: float,
        seed: int,
        stop_token_ids: tuple[int, ...],
    ) -> Completion:
        body: JSON = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens}
        body.update(temperature=temperature, seed=seed, stream=False)
        # Plain sampling, as in-process: no top-k/top-p/min-p a server defaults to.
        body.update(top_p=1.0, top_k=0, min_p=0.0)
        if stop_token_ids:
            body["stop_token_ids"] = list(stop_token_ids)  # vLLM/SGLang; EOS ends it anyway
        if self._stopped.is_set():
            raise ServerError(f"--server {self.settings.base}: the run stopped")
        with _tracer.start_as_current_span(
            f"{OPERATION} {self.model}",
            kind=SpanKind.CLIENT,
            attributes=self._request_attributes(body),
            record_exception=False,  # a ServerError is one line, set as the status below
            set_status_on_exception=False,
        ) as span:
            try:
                completion, reply = self._completion(body)
            except ServerError as err:
                if span.is_recording():
                    span.set_attribute("error.type", str(err.status or type(err).__name__))
                    span.set_status(Status(StatusCode.ERROR, str(err)))
                raise
            if span.is_recording():
                span.set_attributes(_response_attributes(reply, len(prompt), completion))
        return completion

    def _request_attributes(self, body: JSON) -> dict[str, AttributeValue]:
        where = urlsplit(self.settings.base)
        attributes: dict[str, AttributeValue] = {
            "gen_ai.operation.name": OPERATION,
            "gen_ai.request.model": self.model,
            "gen_ai.request.max_tokens": body["max_tokens"],
            "gen_ai.request.temperature": body["temperature"],
            "gen_ai.request.top_p": body["top_p"],
            "gen_ai.request.top_k": body["top_k"],
            "gen_ai.request.seed": body["seed"],
            "server.address": where.hostname or "",
            "server.port": where.port or (443 if where.scheme == "https" else 80),
        }
        if self.provider is not None:
            attributes["gen_ai.provider.name"] = self.provider
        return attributes

    def _completion(self, body: JSON) -> tuple[Completion, JSON]:
        reply = self._request("POST", "/v1/completions", body)
        try:
            choice = reply["choices"][0]
            text, reason = choice["text"], choice.get("finish_reason")
        except (KeyError, IndexError, TypeError):
            raise ServerError(
                f"--server {self.settings.base}: /v1/completions gave no choices: "
                f"{json.dumps(reply)[:200]}"
            ) from None
        if not isinstance(text, str):  # never written as the reply "None"
            raise ServerError(
                f"--server {self.settings.base}: /v1/completions answered "
                f'"text": {json.dumps(text)[:40]}, not the text of a reply: the server is '
                "broken or not OpenAI-compatible; nothing of this reply is written"
            )
        usage = reply.get("usage") or {}
        completion = Completion(text, int(usage.get("completion_tokens") or 0), reason == "length")
        return completion, reply

    def complete_all(
        self,
        prompts: list[list[int]],
        *,
        priority: tuple[int, int] = (0, 0),
        on_queued: Callable[[], None] | None = None,
        **kwargs: Any,  # Any: `complete`'s keywords, passed on
    ) -> list[Completion]:
        """Every prompt, with at most `concurrency` in flight over all callers, those of
        the lowest `priority` first; results in prompt order. The first failure ends it at
        once, and this call's prompts not yet sent are not sent. `on_queued` is called once
        they are all queued."""
        seed = int(kwargs.pop("seed"))
        caller = otel_context.get_current()  # the workers' spans are children of the caller's
        futures = [
            self._requests.submit(
                priority, partial(_in_context, caller, self.complete, p, seed=seed + i, **kwargs)
            )
            for i, p in enumerate(prompts)
        ]
        if on_queued is not None:
            on_queued()
        try:
            wait(futures, return_when=FIRST_EXCEPTION)
            return [f.result() for f in futures]
        except BaseException:
            for future in futures:
                future.cancel()
            raise

    def identity(self, target: TokenizerTarget) -> str:
        """What a resumed regeneration must find again: the served model and tokenizer."""
        return f"server:{self.model}:{tokenizer_fingerprint(target.tokenizer)}"
