"""τ measured by the serving engine: `dflash-train eval --server URL`.

The prompts go to an OpenAI-compatible server that runs the target with the drafter
(vLLM's `--speculative-config`), and the acceptance comes from the engine's own
Prometheus counters on `/metrics`, read before and after:

  vllm:spec_decode_num_drafts_total                  decoding cycles that drafted
  vllm:spec_decode_num_accepted_tokens_total         draft tokens the target accepted
  vllm:spec_decode_num_accepted_tokens_per_pos_total {position="k"}: cycles accepting
                                                     draft k+1 (so k+1 drafts at least)

so τ pooled is 1 + accepted / drafts, and the acceptance at block position k is the
per-position counter over the drafts: the same figures `dflash-train eval` computes in
process. Prompts are sent one at a time by default and the counters read after each,
which also gives each prompt's own τ (the authors' mean of per-prompt means);
`concurrency` > 1 gives the pooled figures alone. The counters count every request the
server serves: the request and token counters (`vllm:request_success_total`,
`vllm:generation_tokens_total`) show traffic that was not ours, and the result says so.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

from dflash.log import Log, say
from dflash.summary import ServedFigures
from dflash.target.served import CompletionClient, ServerError

_PREFIX = "vllm:spec_decode_"
_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
# After a reply the engine may record its last step's counters a moment later.
SETTLE_S = 5.0


@dataclass(frozen=True)
class SpecCounters:
    """The engine's cumulative counters at one moment (or a difference of two)."""

    drafts: int
    draft_tokens: int
    accepted: int
    accepted_per_position: tuple[int, ...]
    requests: int
    generation_tokens: int

    def minus(self, earlier: SpecCounters) -> SpecCounters:
        per_position = tuple(
            a - b
            for a, b in zip(self.accepted_per_position, earlier.accepted_per_position, strict=True)
        )
        return SpecCounters(
            drafts=self.drafts - earlier.drafts,
            draft_tokens=self.draft_tokens - earlier.draft_tokens,
            accepted=self.accepted - earlier.accepted,
            accepted_per_position=per_position,
            requests=self.requests - earlier.requests,
            generation_tokens=self.generation_tokens - earlier.generation_tokens,
        )


def _samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample line of a Prometheus text page.

    A dozen lines of the exposition format, rather than a pinned prometheus_client for
    its parser: only counter samples are read, and comments are skipped."""
    found = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or line.startswith("#"):
            continue
        name, labels, value = match.groups()
        try:
            number = float(value)
        except ValueError:
            continue
        found.append((name, dict(_LABEL.findall(labels or "")), number))
    return found


def parse_spec_counters(text: str, model: str | None = None) -> SpecCounters | None:
    """The speculative-decoding counters of a vLLM /metrics page (summed over engines;
    only `model`'s where the page labels several), or None when it has none."""
    sums: dict[str, float] = {}
    per_position: dict[int, float] = {}
    seen = False
    for name, labels, value in _samples(text):
        if model is not None and labels.get("model_name", model) != model:
            continue
        if name.startswith(_PREFIX):
            seen = True
        if name == _PREFIX + "num_accepted_tokens_per_pos_total":
            position = int(labels.get("position", "0"))
            per_position[position] = per_position.get(position, 0.0) + value
        elif name.endswith("_total"):
            sums[name] = sums.get(name, 0.0) + value
    if not seen:
        return None
    size = max(per_position, default=-1) + 1
    return SpecCounters(
        drafts=int(sums.get(_PREFIX + "num_drafts_total", 0)),
        draft_tokens=int(sums.get(_PREFIX + "num_draft_tokens_total", 0)),
        accepted=int(sums.get(_PREFIX + "num_accepted_tokens_total", 0)),
        accepted_per_position=tuple(int(per_position.get(k, 0)) for k in range(size)),
        requests=int(sums.get("vllm:request_success_total", 0)),
        generation_tokens=int(sums.get("vllm:generation_tokens_total", 0)),
    )


class SpecMeter:
    """Reads one server's counters; one line when it has none (not speculative, not
    vLLM, or started with --disable-log-stats)."""

    def __init__(self, client: CompletionClient) -> None:
        self.client = client

    def read(self) -> SpecCounters:
        try:
            text = self.client.metrics_text()
        except ServerError as err:
            if err.status != 404:
                raise
            text = ""
        counters = parse_spec_counters(text, self.client.model or None)
        if counters is None:
            raise ServerError(
                f"--server {self.client.settings.base}: its /metrics has no vLLM "
                "speculative-decoding counters (vllm:spec_decode_*): serve the target with "
                "--speculative-config naming the drafter, and without --disable-log-stats"
            )
        return counters

    def settled(self, before: SpecCounters, requests: int, tokens: int) -> SpecCounters:
        """The counters once `requests` more requests and `tokens` more generated tokens
        are recorded (the engine records its last step after replying), or as they are
        after SETTLE_S."""
        deadline = time.monotonic() + SETTLE_S
        while True:
            now = self.read()
            done = now.minus(before)
            if done.requests >= requests and done.generation_tokens >= tokens:
                return now
            if time.monotonic() > deadline:
                return now
            time.sleep(0.05)


@dataclass
class ServedResult:
    """What the engine measured over our prompts."""

    counters: SpecCounters  # the difference over the whole evaluation
    per_prompt_tau: list[float]  # empty with concurrency > 1
    new_tokens: int  # the server's count of tokens generated for our prompts
    requests: int  # ours
    wall_s: float

    @property
    def block_size(self) -> int:
        return len(self.counters.accepted_per_position) + 1

    def figures(self, **context: Any) -> ServedFigures:  # Any: ServedFigures' field types
        """The figures, named as the in-process ones are; `context`: ServedFigures' fields
        saying where they were measured (server, server_model, prompts, ...)."""
        c = self.counters
        drafts = max(1, c.drafts)
        other_requests = max(0, c.requests - self.requests)
        other_tokens = max(0, c.generation_tokens - self.new_tokens)
        return ServedFigures(
            tau=sum(self.per_prompt_tau) / len(self.per_prompt_tau)
            if self.per_prompt_tau
            else None,
            tau_pooled=1.0 + c.accepted / drafts if c.drafts else 1.0,
            acceptance_per_position=[a / drafts for a in c.accepted_per_position],
            num_drafts=c.drafts,
            num_draft_tokens=c.draft_tokens,
            num_accepted_tokens=c.accepted,
            num_speculative_tokens=len(c.accepted_per_position),
            new_tokens=self.new_tokens,
            requests=self.requests,
            other_traffic=(
                {"requests": other_requests, "generation_tokens": other_tokens}
                if other_requests or other_tokens
                else None
            ),
            eval_s=self.wall_s,
            **context,
        )


def _tau_of(delta: SpecCounters) -> float | None:
    return 1.0 + delta.accepted / delta.drafts if delta.drafts else None


def evaluate_served(
    client: CompletionClient,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_token_ids: tuple[int, ...],
    *,
    concurrency: int = 1,
    log: Log = say,
) -> ServedResult:
    """Greedy completions of `prompts` by the server, measured by its own counters."""
    meter = SpecMeter(client)
    start_s = time.perf_counter()
    first = meter.read()
    opts = {"max_tokens": max_new_tokens, "temperature": 0.0, "stop_token_ids": stop_token_ids}
    per_prompt: list[float] = []
    new_tokens = 0
    if concurrency > 1:
        done = client.complete_all(prompts, seed=0, **opts)
        new_tokens = sum(c.tokens for c in done)
        last = meter.settled(first, len(prompts), new_tokens)
    else:
        last = first
        for index, prompt in enumerate(prompts):
            reply = client.complete(prompt, seed=index, **opts)
            new_tokens += reply.tokens
            now = meter.settled(last, 1, reply.tokens)
            tau = _tau_of(now.minus(last))
            if tau is not None:
                per_prompt.append(tau)
            last = now
    counters = last.minus(first)
    if counters.drafts == 0 and new_tokens > len(prompts):
        raise ServerError(
            f"--server {client.settings.base} generated {new_tokens} tokens without one draft: "
            "it is not speculative (serve the target with --speculative-config)"
        )
    result = ServedResult(
        counters, per_prompt, new_tokens, len(prompts), time.perf_counter() - start_s
    )
    other = result.figures().other_traffic
    if other:
        log(
            f"eval: the server served {other['requests']} requests and "
            f"{other['generation_tokens']} tokens that were not ours while it was measured; "
            "its counters, and so τ, include them"
        )
    return result


def format_served(figures: ServedFigures, where: str) -> list[str]:
    """The log lines of the engine's figures."""
    rates = " ".join(f"{r:.2f}" for r in figures.acceptance_per_position)
    tau = figures.tau
    mean = f"τ {tau:.3f} (mean of per-prompt means), pooled " if tau is not None else "τ pooled "
    return [
        f"eval (server): {mean}{figures.tau_pooled:.3f} measured by {where} over "
        f"{figures.requests} prompts ({figures.num_drafts} drafts, "
        f"{figures.new_tokens} tokens) in {figures.eval_s:.1f} s",
        f"eval (server): acceptance per block position {rates}",
    ]
