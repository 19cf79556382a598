"""The drafter's acceptance length tau and speedup, and the eval entry points.

Decoding itself (draft, verify, accept) lives in dflash.eval.speculative; this module
runs it over prompts, times it against plain decoding and reports the figures.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypedDict

import torch

from dflash.config.devices import resolve_device
from dflash.config.settings import RunConfig
from dflash.data.chat import use_chat_template_kwargs
from dflash.data.datasets import PackedDataset, build_datasets, heldout_prompts
from dflash.data.sources import DataReport
from dflash.data.tokenizer import Tokenizer, decode_text
from dflash.drafter.io import load_drafter, read_drafter_config, saved_chat_template_kwargs
from dflash.drafter.model import DFlashDrafter
from dflash.eval.config import EvalConfig
from dflash.eval.prompts import (
    PromptError,
    TokenPrompts,
    read_conversations,
    read_token_prompts,
    render_prompt,
)
from dflash.eval.served import evaluate_served, format_served
from dflash.eval.speculative import SpecStats, speculative_generate
from dflash.log import Log, say
from dflash.summary import JSON, EvalRecord, HeldOutFigures, ServedFigures
from dflash.target import load as target_mod  # by module: tests swap load_target
from dflash.target.decoding import check_decoding
from dflash.target.generation import generate
from dflash.target.hf import load_stop_token_ids
from dflash.target.model import TargetModel
from dflash.target.served import CompletionClient, ServerSettings, TokenizerTarget


class _RepeatFigures(TypedDict):
    """EvalResult's figures of repeated spans (its fields of the same names)."""

    repeated_share: float
    tau_without_repeats: float | None


class _Figures(_RepeatFigures):
    """EvalResult's figures of the cycles of all prompts (its fields of the same names)."""

    tau: float
    tau_pooled: float
    acceptance_per_position: list[float]
    tokens_per_target_forward: float
    num_cycles: int
    new_tokens: int


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
    repeated_share: float = 0.0  # accepted drafts inside repeated spans (loops), of all
    tau_without_repeats: float | None = None  # pooled τ of the cycles outside them

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _summarize(all_stats: list[SpecStats], block_size: int) -> _Figures:
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
        **_repeat_figures(all_stats),
    }


def _repeat_figures(all_stats: list[SpecStats]) -> _RepeatFigures:
    """How much of τ comes from loops: greedy outputs that repeat themselves are easy to
    draft, and a drafter can look good on them alone."""
    inside = total = 0
    clean: list[int] = []
    for stats in all_stats:
        a, b, c = stats.split_by_repeats()
        inside, total, clean = inside + a, total + b, clean + c
    return {
        "repeated_share": inside / total if total else 0.0,
        "tau_without_repeats": sum(a + 1 for a in clean) / len(clean) if clean else None,
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
    draft_sampling: str = "greedy",
    follow_up: Callable[[int, list[int]], list[int] | None] | None = None,
) -> EvalResult:
    """Speculative decoding over the prompts: tau (per-prompt mean and pooled), acceptance
    per block position and, with compare_baseline, the wall-clock speedup against plain
    decoding with the same target and cache mode (run prompt by prompt, interleaved).

    stop_token_ids None -> the target's stop tokens. timing_repeats > 1 decodes each
    prompt that often (both ways, interleaved) and keeps the fastest time of each: on a
    shared machine the minimum is the figure least disturbed by other work.
    `follow_up(i, output)` may return the next prompt of prompt i's conversation (built
    from the target's own reply, `output`: speculative decoding is lossless), decoded
    after the others in turn.
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
    spec_opts = {**opts, "draft_sampling": draft_sampling}
    queue = deque(enumerate(prompts))
    try:
        while queue:
            index, prompt = queue.popleft()
            prompt_base_s, prompt_spec_s = [], []
            for repeat in range(max(1, timing_repeats) if compare_baseline else 1):
                if compare_baseline:
                    t0 = time.perf_counter()
                    generate(target, prompt, max_new_tokens, generator=gen, **opts)
                    prompt_base_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                output, stats = speculative_generate(
                    target, drafter, prompt, max_new_tokens, generator=gen, **spec_opts
                )
                prompt_spec_s.append(time.perf_counter() - t0)
                if repeat == 0:
                    all_stats.append(stats)
                    following = follow_up(index, output) if follow_up is not None else None
                    if following:
                        queue.append((index, following))
            spec_s += min(prompt_spec_s)
            base_s += min(prompt_base_s, default=0.0)
    finally:
        drafter.train(was_training)
    return EvalResult(
        **_summarize(all_stats, drafter.config.block_size),
        num_prompts=len(all_stats),
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


def held_out_figures(result: EvalResult) -> HeldOutFigures:
    """The figures summary.json and the eval JSON keep of an EvalResult."""
    return HeldOutFigures(
        tau=float(result.tau),
        tau_pooled=float(result.tau_pooled),
        acceptance_per_position=[float(a) for a in result.acceptance_per_position],
        tokens_per_target_forward=float(result.tokens_per_target_forward),
        speedup=_float_or_none(result.speedup),
        speculative_s=float(result.speculative_s),
        greedy_s=_float_or_none(result.baseline_s),
        repeated_share=float(result.repeated_share),
        tau_without_repeats=_float_or_none(result.tau_without_repeats),
    )


def format_eval(figures: HeldOutFigures, where: str) -> list[str]:
    """The log lines of an evaluation: τ both ways, speedup, acceptance per position."""
    rates = " ".join(f"{r:.2f}" for r in figures.acceptance_per_position)
    against = (
        f"; speedup {figures.speedup:.2f}x vs greedy decoding with the same KV-cached target "
        f"({figures.greedy_s or 0.0:.2f} s -> {figures.speculative_s:.2f} s)"
        if figures.speedup is not None
        else ""
    )
    return [
        f"eval: τ {figures.tau:.3f} (mean of per-prompt means), pooled "
        f"{figures.tau_pooled:.3f}, on {where}{against}",
        f"eval: acceptance per block position {rates}; tokens per target forward "
        f"{figures.tokens_per_target_forward:.2f}",
        *_repeat_line(figures),
    ]


def _repeat_line(figures: HeldOutFigures) -> list[str]:
    if figures.repeated_share is None:
        return []
    without = figures.tau_without_repeats
    return [
        f"eval: {figures.repeated_share:.0%} of accepted drafts fall inside repeated spans "
        f"(loops of the output, easy to draft); pooled τ without them "
        + (f"{without:.3f}" if without is not None else "n/a")
    ]


class _PromptSource:
    """Where `dflash-train eval` takes its prompts; chat files are read (and refused)
    before the models load, rendered once the tokenizer is known."""

    def __init__(self, settings: EvalConfig, log: Log) -> None:
        self.settings = settings
        self.conversations: list[list[dict[str, str]]] | None = None
        self.followups: list[list[str]] = []
        self.tokens: TokenPrompts | None = None
        if settings.eval_data is not None:
            self.tokens = read_token_prompts(settings.eval_data, settings.num_prompts)
        if self.tokens is not None:
            budget = self.tokens.max_new_tokens
            if budget is not None and budget != settings.max_new_tokens:
                log(
                    f"eval: the run measured its τ on {settings.eval_data} with "
                    f"--max-new-tokens {budget}; this evaluation uses {settings.max_new_tokens}"
                )
        elif settings.eval_data is not None:
            report = DataReport()
            self.conversations = read_conversations(
                settings.eval_data, settings.num_prompts, report, self.followups
            )
            for line in report.lines(0):
                log(line.replace("data:", "eval:", 1))

    def follow_up(
        self, tokenizer: Tokenizer
    ) -> Callable[[int, list[int]], list[int] | None] | None:
        """The next turn of conversation i once the target has answered the one before:
        the conversation so far, the reply, the next user turn."""
        if self.conversations is None or not any(self.followups):
            return None
        so_far = [list(m) for m in self.conversations]
        left = [list(f) for f in self.followups]

        def next_prompt(i: int, output: list[int]) -> list[int] | None:
            if not left[i]:
                return None
            reply = decode_text(tokenizer, output)
            so_far[i].append({"role": "assistant", "content": reply})
            so_far[i].append({"role": "user", "content": left[i].pop(0)})
            return render_prompt(tokenizer, so_far[i])

        return next_prompt

    def prompts(self, tokenizer: Tokenizer) -> tuple[list[list[int]], str]:
        """(prompts, a phrase saying where they come from)."""
        settings = self.settings
        if self.tokens is not None:
            prompts = self.tokens.prompts
            return prompts, f"the {len(prompts)} prompts (token ids) of {settings.eval_data}"
        if self.conversations is not None:
            prompts = [render_prompt(tokenizer, m) for m in self.conversations]
            return prompts, f"{len(prompts)} conversations of {settings.eval_data}"
        # The unpacked held-out stream gives the prompts: seq_len and seed do not matter.
        tokens = settings.prompt_tokens
        _, heldout = build_datasets(settings.data, tokenizer, max(tokens, 8), 1, 0)
        prompts = heldout_prompts(heldout, settings.num_prompts or 8, tokens)
        return prompts, f"{len(prompts)} held-out prompts"


# The EvalConfig fields evaluate_tau takes as keywords of the same names.
_DECODING = ("max_new_tokens", "temperature", "seed", "timing_repeats", "draft_sampling")


def evaluate_drafter_dir(
    drafter_dir: Path,
    target_spec: str | None,
    settings: EvalConfig,
    device: str = "auto",
    log: Log = say,
    chat_template_kwargs: JSON | None = None,
    dtype: str = "auto",
) -> EvalRecord:
    """`dflash-train eval`: τ of a saved drafter, and its speedup against greedy decoding.
    `chat_template_kwargs` None: the ones the drafter was trained with. `dtype` (auto:
    the target's usual one on the device) is the target's and the drafter's, as an engine
    serving both in one dtype runs them."""
    dev = resolve_device(device, "--device")
    source = _PromptSource(settings, log)
    torch_dtype = target_mod.target_dtype(dev) if dtype == "auto" else getattr(torch, dtype)
    target = target_mod.load_target(target_spec, dev, torch_dtype, log=log) if target_spec else None
    drafter, target = load_drafter(drafter_dir, target=target, device=dev, dtype=torch_dtype)
    kwargs = chat_template_kwargs
    if kwargs is None:
        kwargs = saved_chat_template_kwargs(drafter_dir)
    if kwargs:
        target.use_chat_template_kwargs(kwargs)
        log(f"chat template arguments: {json.dumps(kwargs, sort_keys=True)}")
    prompts, where = source.prompts(target.tokenizer)
    start_s = time.perf_counter()
    decoding = {name: getattr(settings, name) for name in _DECODING}
    follow_up = source.follow_up(target.tokenizer)
    result = evaluate_tau(
        target, drafter, prompts, compare_baseline=True, follow_up=follow_up, **decoding
    )
    held_out = held_out_figures(result)
    record = EvalRecord(
        held_out=held_out,
        prompts=len(prompts),
        turns=result.num_prompts,
        new_tokens=result.new_tokens,
        max_new_tokens=settings.max_new_tokens,
        temperature=settings.temperature,
        draft_sampling=settings.draft_sampling,
        block_size=drafter.config.block_size,
        target=target.spec,
        dtype=str(torch_dtype).removeprefix("torch."),
        eval_s=time.perf_counter() - start_s,
    )
    for line in format_eval(held_out, where):
        log(line)
    return record


def _served_target_spec(drafter_dir: Path | None, target_spec: str | None) -> str:
    if target_spec:
        return target_spec
    spec = read_drafter_config(drafter_dir).target_spec if drafter_dir is not None else ""
    if not spec:
        raise PromptError("eval --server: name the served target's tokenizer with --target")
    return spec


def evaluate_server(
    server: ServerSettings,
    drafter_dir: Path | None,
    target_spec: str | None,
    settings: EvalConfig,
    log: Log = say,
    chat_template_kwargs: JSON | None = None,
) -> ServedFigures:
    """`dflash-train eval --server URL`: τ as the serving engine measures it, on the
    prompts the in-process evaluation uses; only the target's tokenizer loads here."""
    if settings.temperature != 0.0:
        raise PromptError("eval --server measures greedy decoding: leave --temperature at 0")
    spec = _served_target_spec(drafter_dir, target_spec)
    source = _PromptSource(settings, log)
    tokenizer = target_mod.load_tokenizer(spec)
    kwargs = chat_template_kwargs
    if kwargs is None:
        kwargs = saved_chat_template_kwargs(drafter_dir) if drafter_dir is not None else {}
    use_chat_template_kwargs(tokenizer, kwargs)
    client = CompletionClient(server)
    client.connect(TokenizerTarget(spec, tokenizer, dict(kwargs)), log, command="eval")
    prompts, where = source.prompts(tokenizer)
    if source.follow_up(tokenizer) is not None:
        log(
            "eval: --server answers the first user turn of each conversation; later turns "
            "are not sent"
        )
    stops = load_stop_token_ids(spec, tokenizer)
    result = evaluate_served(
        client, prompts, settings.max_new_tokens, stops, concurrency=server.concurrency, log=log
    )
    figures = result.figures(
        server=server.base,
        server_model=client.model,
        prompts=len(prompts),
        max_new_tokens=settings.max_new_tokens,
        target=spec,
        block_size=result.block_size,
    )
    for line in format_served(figures, f"{server.base} on {where}"):
        log(line)
    if drafter_dir is not None:
        saved = read_drafter_config(drafter_dir).block_size
        if saved != result.block_size:
            log(
                f"eval: the server drafts {result.block_size - 1} tokens per step, the drafter "
                f"{drafter_dir} was trained with block size {saved} ({saved - 1} drafts)"
            )
    return figures
