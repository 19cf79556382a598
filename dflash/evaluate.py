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
from dataclasses import asdict, dataclass, field

import torch

from dflash.drafter import DFlashDrafter
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
