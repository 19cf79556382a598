"""Speculative decoding with the drafter, the acceptance length tau and the speedup.

Each cycle: the drafter proposes Bs-1 tokens after the anchor (the last token the
target produced); one target forward verifies them. At temperature 0 the longest
prefix agreeing with the target's argmax is accepted plus the target's own next
token, so the output is exactly the target's greedy decoding. At temperature > 0
the standard speculative-sampling rule (accept x with prob min(1, p(x)/q(x)), else
resample from norm(max(p - q, 0))) keeps the output distributed as the target's.

With `use_cache` the target and the drafter keep KV caches, both cropped to the
accepted prefix after each cycle; without, every forward re-reads the sequence.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dflash import target as target_mod  # by module: tests swap load_target
from dflash.config import RunConfig
from dflash.data import DataReport, PackedDataset, build_datasets, heldout_prompts
from dflash.devices import resolve_device
from dflash.drafter import DFlashDrafter, load_drafter
from dflash.generation import (
    GenerationError,
    check_decoding,
    first_stop,
    generate,
    greedy_generate,
    ids_tensor,
    next_token,
    sample_from,
    token_probs,
)
from dflash.kvcache import KVCache
from dflash.prompts import read_conversations, render_prompt
from dflash.target import TargetModel

__all__ = [
    "EvalResult",
    "EvalSettings",
    "GenerationError",
    "SpecStats",
    "evaluate_tau",
    "greedy_generate",
    "speculative_generate",
]


@dataclass
class SpecStats:
    accepted_per_cycle: list[int] = field(default_factory=list)  # drafts accepted per cycle
    target_forwards: int = 0
    new_tokens: int = 0

    @property
    def tau(self) -> float | None:
        """Mean of (accepted + 1) over this prompt's cycles; None without a cycle."""
        cycles = self.accepted_per_cycle
        return sum(a + 1 for a in cycles) / len(cycles) if cycles else None


@dataclass
class EvalResult:
    tau: float  # mean over prompts of each prompt's mean (accepted + 1): the authors' figure
    tau_pooled: float  # mean over all cycles of all prompts
    acceptance_per_position: list[float]  # [Bs-1]: share of cycles accepting draft k
    tokens_per_target_forward: float
    num_cycles: int
    num_prompts: int
    new_tokens: int
    wall_s: float
    speculative_s: float  # decoding time of speculative decoding alone
    baseline_s: float | None = None  # plain decoding with the same target and cache mode
    speedup: float | None = None  # baseline_s / speculative_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --- one cycle: propose, verify ---


def _propose(
    draft_logits: Tensor, temperature: float, generator: torch.Generator | None
) -> tuple[list[int], Tensor | None]:
    """draft_logits[Bs-1, V] -> draft tokens, and their proposal probs [Bs-1, V] when sampling."""
    if temperature == 0:
        return draft_logits.argmax(-1).tolist(), None
    q = token_probs(draft_logits, temperature).cpu()
    return [sample_from(q_k, generator) for q_k in q], q


def _verify(
    target_logits: Tensor,
    drafts: list[int],
    q: Tensor | None,
    temperature: float,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """target_logits[Bs, V] at the anchor and each draft -> (drafts accepted, next token)."""
    if temperature == 0:
        choices = target_logits.argmax(-1).tolist()
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == choices[accepted]:
            accepted += 1
        return accepted, choices[accepted]
    assert q is not None
    p = token_probs(target_logits, temperature).cpu()  # [Bs, V]
    for k, token in enumerate(drafts):
        ratio = p[k, token] / q[k, token]
        if float(torch.rand((), generator=generator)) < min(1.0, float(ratio)):
            continue
        residual = (p[k] - q[k]).clamp(min=0)
        # p == q up to rounding leaves no residual mass; then p itself is the right law.
        residual = residual if float(residual.sum()) > 0 else p[k]
        return k, sample_from(residual / residual.sum(), generator)
    return len(drafts), sample_from(p[len(drafts)], generator)


class _Uncached:
    """Every forward re-reads the sequence: simple and exact, the reference path."""

    def __init__(self, target: TargetModel, drafter: DFlashDrafter) -> None:
        self.target, self.drafter = target, drafter
        self.layer_ids = drafter.config.target_layer_ids
        self.hidden = self.verified = torch.empty(0)

    def prefill(self, prompt: list[int]) -> Tensor:
        out = self.target.capture(ids_tensor(prompt, self.target.device), self.layer_ids, True)
        self.hidden = out.hidden  # [1, P, K*D]: features of every token before the anchor
        return out.logits[0, -1]

    def draft(self, seq: list[int]) -> Tensor:
        return self.drafter.draft_logits(self.hidden, seq[-1], len(seq) - 1)

    def verify(self, seq: list[int], drafts: list[int]) -> Tensor:
        out = self.target.capture(
            ids_tensor(seq + drafts, self.target.device), self.layer_ids, True
        )
        self.verified = out.hidden
        return out.logits[0, len(seq) - 1 :]  # [Bs, V]

    def commit(self, anchor_pos: int, accepted: int) -> None:
        # Features up to the last accepted draft were computed from the right tokens.
        self.hidden = self.verified[:, : anchor_pos + accepted + 1]


class _Cached:
    """Target and drafter KV caches hold exactly the positions before the anchor."""

    def __init__(self, target: TargetModel, drafter: DFlashDrafter) -> None:
        self.target, self.drafter = target, drafter
        self.layer_ids = drafter.config.target_layer_ids
        self.target_cache, self.drafter_cache = target.new_cache(), KVCache()
        self.pending = self.verified = torch.empty(0)  # features the drafter cache lacks

    def prefill(self, prompt: list[int]) -> Tensor:
        ids = ids_tensor(prompt, self.target.device)
        out = self.target.forward_cached(ids, self.target_cache, self.layer_ids)
        self.pending = out.hidden
        return out.logits[0, -1]

    def draft(self, seq: list[int]) -> Tensor:
        anchor_pos = len(seq) - 1
        return self.drafter.draft_logits_cached(
            self.pending, seq[-1], anchor_pos, self.drafter_cache
        )

    def verify(self, seq: list[int], drafts: list[int]) -> Tensor:
        ids = ids_tensor([seq[-1], *drafts], self.target.device)
        out = self.target.forward_cached(ids, self.target_cache, self.layer_ids)
        self.verified = out.hidden
        return out.logits[0]  # [Bs, V]

    def commit(self, anchor_pos: int, accepted: int) -> None:
        self.target.crop_cache(self.target_cache, anchor_pos + accepted + 1)
        self.pending = self.verified[:, : accepted + 1]


@torch.no_grad()
def speculative_generate(
    target: TargetModel,
    drafter: DFlashDrafter,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    stop_token_ids: Iterable[int] = (),
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
) -> tuple[list[int], SpecStats]:
    """Draft-then-verify decoding of a non-empty prompt; -> (new tokens, stats)."""
    check_decoding(max_new_tokens, temperature)
    if not prompt_ids:
        raise GenerationError("speculative decoding needs a non-empty prompt")
    stops = set(stop_token_ids)
    session = (_Cached if use_cache else _Uncached)(target, drafter)
    stats = SpecStats(target_forwards=1)
    seq = list(prompt_ids)
    seq.append(next_token(session.prefill(seq), temperature, generator))
    while len(seq) - len(prompt_ids) < max_new_tokens and seq[-1] not in stops:
        anchor_pos = len(seq) - 1
        drafts, q = _propose(session.draft(seq), temperature, generator)
        logits = session.verify(seq, drafts)
        accepted, token = _verify(logits, drafts, q, temperature, generator)
        stats.target_forwards += 1
        stats.accepted_per_cycle.append(accepted)
        added = [*drafts[:accepted], token]
        seq += added
        if first_stop(added, stops) is not None:
            break
        session.commit(anchor_pos, accepted)
    new = seq[len(prompt_ids) :][:max_new_tokens]
    stop = first_stop(new, stops)
    new = new if stop is None else new[: stop + 1]
    stats.new_tokens = len(new)
    return new, stats


def _summarize(all_stats: list[SpecStats], block_size: int) -> dict[str, Any]:
    accepted = [a for s in all_stats for a in s.accepted_per_cycle]
    per_prompt = [s.tau for s in all_stats if s.tau is not None]
    cycles = max(1, len(accepted))
    forwards = sum(s.target_forwards for s in all_stats)
    new_tokens = sum(s.new_tokens for s in all_stats)
    return {
        "tau": sum(per_prompt) / len(per_prompt) if per_prompt else 1.0,
        "tau_pooled": sum(a + 1 for a in accepted) / cycles if accepted else 1.0,
        "acceptance_per_position": [
            sum(a >= k for a in accepted) / cycles for k in range(1, block_size)
        ],
        "tokens_per_target_forward": new_tokens / max(1, forwards),
        "num_cycles": len(accepted),
        "new_tokens": new_tokens,
    }


def evaluate_tau(
    target: TargetModel,
    drafter: DFlashDrafter,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    stop_token_ids: Iterable[int] | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    use_cache: bool = True,
    compare_baseline: bool = False,
    timing_repeats: int = 1,
) -> EvalResult:
    """Speculative decoding over the prompts: tau (per-prompt mean and pooled), acceptance
    per block position and, with compare_baseline, the wall-clock speedup against plain
    decoding with the same target and cache mode (run prompt by prompt, interleaved).

    stop_token_ids None -> the target's stop tokens. timing_repeats > 1 decodes each
    prompt that often (both ways, interleaved) and keeps the fastest time of each: on a
    shared machine the minimum is the figure least disturbed by other work.
    """
    check_decoding(max_new_tokens, temperature)
    stops = tuple(target.stop_token_ids if stop_token_ids is None else stop_token_ids)
    start_s = time.perf_counter()
    was_training = drafter.training
    drafter.eval()
    all_stats: list[SpecStats] = []
    spec_s, base_s = 0.0, 0.0
    gen = torch.Generator().manual_seed(seed)
    opts = {"stop_token_ids": stops, "temperature": temperature, "use_cache": use_cache}
    try:
        for prompt in prompts:
            prompt_base_s, prompt_spec_s = [], []
            for repeat in range(max(1, timing_repeats) if compare_baseline else 1):
                if compare_baseline:
                    t0 = time.perf_counter()
                    generate(target, prompt, max_new_tokens, generator=gen, **opts)
                    prompt_base_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                _, stats = speculative_generate(
                    target, drafter, prompt, max_new_tokens, generator=gen, **opts
                )
                prompt_spec_s.append(time.perf_counter() - t0)
                if repeat == 0:
                    all_stats.append(stats)
            spec_s += min(prompt_spec_s)
            base_s += min(prompt_base_s, default=0.0)
    finally:
        drafter.train(was_training)
    return EvalResult(
        **_summarize(all_stats, drafter.config.block_size),
        num_prompts=len(prompts),
        wall_s=time.perf_counter() - start_s,
        speculative_s=spec_s,
        baseline_s=base_s if compare_baseline else None,
        speedup=base_s / spec_s if compare_baseline and spec_s > 0 else None,
    )


# --------------------------------------------------------------- entry points


def evaluate_run(
    target: TargetModel, drafter: DFlashDrafter, heldout: PackedDataset, run_cfg: RunConfig
) -> EvalResult | None:
    """τ and the speedup against greedy decoding of a run's drafter on its held-out
    prompts (None when --eval-prompts is 0)."""
    if run_cfg.eval_prompts == 0:
        return None
    prompts = heldout_prompts(heldout, run_cfg.eval_prompts, run_cfg.eval_prompt_tokens)
    return evaluate_tau(target, drafter, prompts, run_cfg.eval_new_tokens, compare_baseline=True)


def _float_or_none(value: float | None) -> float | None:
    return None if value is None else float(value)


def eval_figures(result: EvalResult | None) -> dict[str, Any]:
    """summary.json fields of an EvalResult (tau None when not evaluated)."""
    if result is None:
        return {"tau": None}
    return {
        "tau": float(result.tau),
        "tau_pooled": float(result.tau_pooled),
        "acceptance_per_position": [float(a) for a in result.acceptance_per_position],
        "tokens_per_target_forward": float(result.tokens_per_target_forward),
        "speedup": _float_or_none(result.speedup),
        "speculative_s": float(result.speculative_s),
        "greedy_s": _float_or_none(result.baseline_s),
    }


def format_eval(figures: dict[str, Any], where: str) -> list[str]:
    """The log lines of an evaluation: τ both ways, speedup, acceptance per position."""
    rates = " ".join(f"{r:.2f}" for r in figures["acceptance_per_position"])
    speedup = figures.get("speedup")
    against = (
        f"; speedup {speedup:.2f}x vs greedy decoding with the same KV-cached target "
        f"({figures['greedy_s']:.2f} s -> {figures['speculative_s']:.2f} s)"
        if speedup is not None
        else ""
    )
    return [
        f"eval: τ {figures['tau']:.3f} (mean of per-prompt means), pooled "
        f"{figures['tau_pooled']:.3f}, on {where}{against}",
        f"eval: acceptance per block position {rates}; tokens per target forward "
        f"{figures['tokens_per_target_forward']:.2f}",
    ]


@dataclass(frozen=True)
class EvalSettings:
    """What `dflash-train eval` decodes: prompts from chat JSONL (`eval_data`) or
    held-out windows of `data`, and how."""

    data: str = "embedded"
    eval_data: str | None = None
    num_prompts: int | None = 8  # None with eval_data: every conversation of the file
    prompt_tokens: int = 64
    max_new_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0
    timing_repeats: int = 1

    def __post_init__(self) -> None:
        check_decoding(self.max_new_tokens, self.temperature)


class _PromptSource:
    """Where `dflash-train eval` takes its prompts; chat files are read (and refused)
    before the models load, rendered once the tokenizer is known."""

    def __init__(self, settings: EvalSettings, log: Callable[[str], None]) -> None:
        self.settings = settings
        self.conversations: list[list[dict[str, str]]] | None = None
        if settings.eval_data is not None:
            report = DataReport()
            self.conversations = read_conversations(
                settings.eval_data, settings.num_prompts, report
            )
            for line in report.lines(0):
                log(line.replace("data:", "eval:", 1))

    def prompts(self, tokenizer: Any) -> tuple[list[list[int]], str]:
        """(prompts, a phrase saying where they come from)."""
        settings = self.settings
        if self.conversations is not None:
            prompts = [render_prompt(tokenizer, m) for m in self.conversations]
            return prompts, f"{len(prompts)} conversations of {settings.eval_data}"
        # The unpacked held-out stream gives the prompts: seq_len and seed do not matter.
        tokens = settings.prompt_tokens
        _, heldout = build_datasets(settings.data, tokenizer, max(tokens, 8), 1, 0)
        prompts = heldout_prompts(heldout, settings.num_prompts or 8, tokens)
        return prompts, f"{len(prompts)} held-out prompts"


def evaluate_drafter_dir(
    drafter_dir: Path,
    target_spec: str | None,
    settings: EvalSettings,
    device: str = "auto",
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """`dflash-train eval`: τ of a saved drafter, and its speedup against greedy decoding."""
    dev = resolve_device(device, "--device")
    source = _PromptSource(settings, log)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    target = target_mod.load_target(target_spec, dev, dtype, log=log) if target_spec else None
    drafter, target = load_drafter(drafter_dir, target=target, device=dev)
    prompts, where = source.prompts(target.tokenizer)
    start_s = time.perf_counter()
    result = evaluate_tau(
        target, drafter, prompts, settings.max_new_tokens, temperature=settings.temperature,
        seed=settings.seed, compare_baseline=True, timing_repeats=settings.timing_repeats,
    )  # fmt: skip
    figures = {
        **eval_figures(result),
        "prompts": len(prompts),
        "new_tokens": result.new_tokens,
        "max_new_tokens": settings.max_new_tokens,
        "temperature": settings.temperature,
        "block_size": drafter.config.block_size,
        "target": target.spec,
        "eval_s": time.perf_counter() - start_s,
    }
    for line in format_eval(figures, where):
        log(line)
    return figures
