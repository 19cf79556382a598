"""The serving walk: greedy speculative decoding's τ from one drafter forward.

At temperature 0 the target's output does not depend on the drafter, so it can be
computed once: the target's greedy continuation of each prompt, and its hidden states.
A decoding cycle drafts from an anchor p (the last token the target produced) the block
after it, the verifier accepts the drafts that equal the target's own next tokens, and
the next anchor is p + accepted + 1. The drafts at every possible anchor come from one
no-grad forward of the drafter over the fixed rows (anchors at every continuation
position), and walking p <- p + accepted(p) + 1 from the first generated token replays
the decoding's cycles (SpecForge PR #835 measures such a walk while training). Its τ
equals `evaluate_tau`'s up to floating-point rounding between a full forward and a
cached one, at the cost of a training forward: cheap enough for every logged step.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from dflash.drafter.model import DFlashDrafter
from dflash.target.generation import greedy_generate
from dflash.target.model import TargetModel


@dataclass(frozen=True)
class WalkRow:
    """One prompt and the target's greedy continuation of it, past the decoding's end by
    a block (a verifier scores the drafts of the last cycle there too)."""

    tokens: list[int]
    prompt_len: int
    hidden: Tensor  # [1, len(tokens), K*D]: the target's features of `tokens`


@dataclass(frozen=True)
class WalkResult:
    tau: float  # mean of per-prompt means of (accepted + 1)
    tau_pooled: float
    acceptance_per_position: list[float]  # share of cycles accepting position k (1..Bs-1)


def prepare_walk(
    target: TargetModel,
    layer_ids: list[int],
    prompts: list[list[int]],
    max_new_tokens: int,
    block_size: int,
) -> list[WalkRow]:
    """The walk's rows: computed once per run (the target is frozen)."""
    rows = []
    for prompt in prompts:
        tokens = prompt + greedy_generate(target, prompt, max_new_tokens + block_size)
        ids = torch.tensor([tokens], device=target.device)
        hidden = target.capture(ids, layer_ids, with_logits=False).hidden
        rows.append(WalkRow(tokens, len(prompt), hidden))
    return rows


@torch.no_grad()
def drafts_at_every_anchor(drafter: DFlashDrafter, row: WalkRow) -> Tensor:
    """drafts[A, Bs-1] (target ids): the drafter's greedy block after each anchor
    p = prompt_len .. len(tokens)-1, all in one forward."""
    device = drafter.fc.weight.device
    bs = drafter.config.block_size
    anchors = torch.arange(row.prompt_len, len(row.tokens), device=device)[None]  # [1, A]
    blocks = torch.full((1, anchors.shape[1], bs), drafter.mask_id, device=device)
    blocks[0, :, 0] = torch.tensor(row.tokens, device=device)[anchors[0]]
    keep = torch.ones_like(anchors, dtype=torch.bool)
    logits = drafter(row.hidden.to(device), blocks, anchors, keep)[0, :, 1:]  # [A, Bs-1, V]
    return drafter.target_logits(logits.float()).argmax(-1)


def walk_cycles(
    drafts: Tensor, row: WalkRow, max_new_tokens: int, stop_token_ids: Iterable[int] = ()
) -> list[int]:
    """Drafts accepted in each cycle, as `speculative_generate` counts them."""
    stops, tokens, first = set(stop_token_ids), row.tokens, row.prompt_len
    table = drafts.tolist()
    cycles: list[int] = []
    p = first  # the target's first generated token: the first anchor
    while p + 1 - first < max_new_tokens and tokens[p] not in stops:
        wanted = tokens[p + 1 : p + 1 + len(table[p - first])]
        accepted = 0
        while accepted < len(wanted) and table[p - first][accepted] == wanted[accepted]:
            accepted += 1
        cycles.append(accepted)
        if stops.intersection(tokens[p + 1 : p + accepted + 2]):
            break
        p += accepted + 1
    return cycles


def walk_tau(
    drafter: DFlashDrafter,
    rows: list[WalkRow],
    max_new_tokens: int,
    stop_token_ids: Iterable[int] = (),
) -> WalkResult:
    """τ of greedy speculative decoding over the rows, walked (module docstring)."""
    was_training = drafter.training
    drafter.eval()
    try:
        per_row = [
            walk_cycles(drafts_at_every_anchor(drafter, row), row, max_new_tokens, stop_token_ids)
            for row in rows
        ]
    finally:
        drafter.train(was_training)
    cycles = [c for row in per_row for c in row]
    means = [sum(c + 1 for c in row) / len(row) for row in per_row if row]
    bs = drafter.config.block_size
    reached = [sum(c >= k for c in cycles) / max(len(cycles), 1) for k in range(1, bs)]
    return WalkResult(
        tau=sum(means) / len(means) if means else 1.0,
        tau_pooled=sum(c + 1 for c in cycles) / len(cycles) if cycles else 1.0,
        acceptance_per_position=reached,
    )
