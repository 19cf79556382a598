"""Speculative decoding with greedy verification, and the acceptance length tau.

Each cycle: the drafter proposes Bs-1 tokens after the anchor (the last token the
target produced); one target forward verifies them; the longest agreeing prefix is
accepted plus the target's own next token. The output is therefore exactly the
target's greedy decoding. No KV cache: every target forward re-reads the sequence,
which is simple and exact, and the counts (forwards, accepted tokens) are what tau
is about.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash import target as target_mod  # by module: tests swap load_target
from dflash.config import RunConfig
from dflash.data import PackedDataset, build_datasets, heldout_prompts
from dflash.devices import resolve_device
from dflash.drafter import DFlashDrafter, load_drafter
from dflash.target import TargetModel


@dataclass
class SpecStats:
    accepted_per_cycle: list[int] = field(default_factory=list)  # drafts accepted per cycle
    target_forwards: int = 0
    new_tokens: int = 0


@dataclass
class EvalResult:
    tau: float  # mean over cycles of (accepted + 1), in [1, Bs]
    acceptance_per_position: list[float]  # [Bs-1]: share of cycles accepting draft k
    tokens_per_target_forward: float
    num_cycles: int
    num_prompts: int
    new_tokens: int
    wall_s: float

    def to_dict(self) -> dict:
        return asdict(self)


def _ids(tokens: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([tokens], dtype=torch.long, device=device)  # [1, T]


@torch.no_grad()
def greedy_generate(target: TargetModel, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The target's own greedy continuation (the reference for speculative decoding)."""
    seq = list(prompt_ids)
    for _ in range(max_new_tokens):
        logits = target.logits(_ids(seq, target.device))  # [1, T, V]
        seq.append(int(logits[0, -1].argmax()))
    return seq[len(prompt_ids) :]


@torch.no_grad()
def speculative_generate(
    target: TargetModel, drafter: DFlashDrafter, prompt_ids: list[int], max_new_tokens: int
) -> tuple[list[int], SpecStats]:
    """Draft-then-verify decoding; returns (new tokens, stats). Needs a non-empty prompt."""
    if not prompt_ids:
        raise ValueError("speculative_generate needs a non-empty prompt")
    layer_ids = drafter.config.target_layer_ids
    stats = SpecStats()
    seq = list(prompt_ids)
    out = target.capture(_ids(seq, target.device), layer_ids, with_logits=True)
    stats.target_forwards += 1
    seq.append(int(out.logits[0, -1].argmax()))
    hidden = out.hidden  # [1, len(seq)-1, K*D]: features of every token but the anchor
    while len(seq) - len(prompt_ids) < max_new_tokens:
        anchor_pos = len(seq) - 1
        drafts = drafter.draft(hidden, seq[-1], anchor_pos)
        out = target.capture(_ids(seq + drafts, target.device), layer_ids, with_logits=True)
        stats.target_forwards += 1
        verified = out.logits[0, anchor_pos:].argmax(-1).tolist()  # [Bs]: target's choices
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == verified[accepted]:
            accepted += 1
        seq += drafts[:accepted] + [verified[accepted]]
        stats.accepted_per_cycle.append(accepted)
        # Features up to the last accepted draft were computed from the right tokens.
        hidden = out.hidden[:, : len(seq) - 1]
    new = seq[len(prompt_ids) :][:max_new_tokens]
    stats.new_tokens = len(new)
    return new, stats


def evaluate_tau(
    target: TargetModel, drafter: DFlashDrafter, prompts: list[list[int]], max_new_tokens: int
) -> EvalResult:
    """Speculative decoding over the prompts; tau, per-position acceptance, tokens/forward."""
    start_s = time.perf_counter()
    was_training = drafter.training
    drafter.eval()
    accepted: list[int] = []
    forwards = new_tokens = 0
    try:
        for prompt in prompts:
            _, stats = speculative_generate(target, drafter, prompt, max_new_tokens)
            accepted += stats.accepted_per_cycle
            forwards += stats.target_forwards
            new_tokens += stats.new_tokens
    finally:
        drafter.train(was_training)
    drafts_per_block = drafter.config.block_size - 1
    cycles = max(1, len(accepted))
    per_position = [sum(a >= k for a in accepted) / cycles for k in range(1, drafts_per_block + 1)]
    return EvalResult(
        tau=sum(a + 1 for a in accepted) / cycles if accepted else 1.0,
        acceptance_per_position=per_position,
        tokens_per_target_forward=new_tokens / max(1, forwards),
        num_cycles=len(accepted),
        num_prompts=len(prompts),
        new_tokens=new_tokens,
        wall_s=time.perf_counter() - start_s,
    )


# --------------------------------------------------------------- entry points


def evaluate_run(
    target: TargetModel, drafter: DFlashDrafter, heldout: PackedDataset, run_cfg: RunConfig
) -> EvalResult | None:
    """τ of a run's drafter on its held-out prompts (None when --eval-prompts is 0)."""
    if run_cfg.eval_prompts == 0:
        return None
    prompts = heldout_prompts(heldout, run_cfg.eval_prompts, run_cfg.eval_prompt_tokens)
    return evaluate_tau(target, drafter, prompts, run_cfg.eval_new_tokens)


def eval_figures(result: EvalResult | None) -> dict[str, Any]:
    """summary.json fields of an EvalResult (tau None when not evaluated)."""
    if result is None:
        return {"tau": None}
    return {
        "tau": float(result.tau),
        "acceptance_per_position": [float(a) for a in result.acceptance_per_position],
        "tokens_per_target_forward": float(result.tokens_per_target_forward),
    }


def evaluate_drafter_dir(
    drafter_dir: Path,
    target_spec: str | None,
    data: str,
    num_prompts: int,
    new_tokens: int,
    prompt_tokens: int,
    device: str = "auto",
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """`dflash-train eval`: τ of a saved drafter on held-out prompts of `data`."""
    dev = resolve_device(device, "--device")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    target = target_mod.load_target(target_spec, dev, dtype, log=log) if target_spec else None
    drafter, target = load_drafter(drafter_dir, target=target, device=dev)
    # Prompts come from the unpacked held-out stream: seq_len and seed do not matter here.
    _, heldout = build_datasets(data, target.tokenizer, max(prompt_tokens, 8), 1, 0)
    prompts = heldout_prompts(heldout, num_prompts, prompt_tokens)
    start_s = time.perf_counter()
    result = evaluate_tau(target, drafter, prompts, new_tokens)
    figures = {
        **eval_figures(result),
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "block_size": drafter.config.block_size,
        "target": target.spec,
        "eval_s": time.perf_counter() - start_s,
    }
    rates = " ".join(f"{r:.2f}" for r in figures["acceptance_per_position"])
    log(f"eval: τ {figures['tau']:.3f} on {len(prompts)} held-out prompts; "
        f"tokens per target forward {figures['tokens_per_target_forward']:.2f}")  # fmt: skip
    log(f"eval: acceptance per block position {rates}")
    return figures
