"""Speculative decoding with the drafter: draft, verify, accept, per-prompt stats.

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

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dflash.drafter.model import DFlashDrafter
from dflash.nn.kvcache import KVCache
from dflash.target.decoding import GenerationError, check_decoding
from dflash.target.generation import first_stop, ids_tensor, next_token, sample_from, token_probs
from dflash.target.model import TargetModel

REPEAT_NGRAM = 4
"""A generated token is inside a repeated span when the REPEAT_NGRAM tokens ending at it
already occurred earlier in the prompt or the output: a loop, which is easy to draft."""


@dataclass
class SpecStats:
    accepted_per_cycle: list[int] = field(default_factory=list)  # drafts accepted per cycle
    target_forwards: int = 0
    new_tokens: int = 0
    cycle_starts: list[int] = field(default_factory=list)  # where each cycle's tokens begin
    sequence: list[int] = field(default_factory=list)  # prompt and output, as decoded

    def repeated_positions(self) -> set[int]:
        """Positions (in `sequence`) whose REPEAT_NGRAM-gram occurred before."""
        seen: set[tuple[int, ...]] = set()
        repeated: set[int] = set()
        seq, n = self.sequence, REPEAT_NGRAM
        for end in range(n, len(seq) + 1):
            gram = tuple(seq[end - n : end])
            if gram in seen:
                repeated.add(end - 1)
            seen.add(gram)
        return repeated

    def split_by_repeats(self) -> tuple[int, int, list[int]]:
        """(accepted drafts inside repeated spans, all accepted drafts, the accepted counts
        of the cycles none of whose tokens is inside one)."""
        repeated = self.repeated_positions()
        inside = total = 0
        clean: list[int] = []
        for start, accepted in zip(self.cycle_starts, self.accepted_per_cycle, strict=False):
            hits = sum(p in repeated for p in range(start, start + accepted))
            inside, total = inside + hits, total + accepted
            if not any(p in repeated for p in range(start, start + accepted + 1)):
                clean.append(accepted)
        return inside, total, clean

    @property
    def tau(self) -> float | None:
        """Mean of (accepted + 1) over this prompt's cycles; None without a cycle."""
        cycles = self.accepted_per_cycle
        return sum(a + 1 for a in cycles) / len(cycles) if cycles else None


# --- one cycle: propose, verify ---


DRAFT_SAMPLING = ("greedy", "sample")


def _propose(
    draft_logits: Tensor,
    temperature: float,
    generator: torch.Generator | None,
    draft_sampling: str = "greedy",
) -> tuple[list[int], Tensor | None]:
    """draft_logits[Bs-1, V] -> draft tokens, and their proposal probs [Bs-1, V] when
    sampled. A greedy draft (the authors' rule and vLLM's default) has no probs."""
    if temperature == 0 or draft_sampling == "greedy":
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
    p = token_probs(target_logits, temperature).cpu()  # [Bs, V]
    if q is None:  # a greedy draft: q is one-hot, so x is accepted with probability p(x)
        for k, token in enumerate(drafts):
            if float(torch.rand((), generator=generator)) < float(p[k, token]):
                continue
            residual = p[k].clone()
            residual[token] = 0.0  # (p - q)+ for a one-hot q
            residual = residual if float(residual.sum()) > 0 else p[k]
            return k, sample_from(residual / residual.sum(), generator)
        return len(drafts), sample_from(p[len(drafts)], generator)
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
    draft_sampling: str = "greedy",
) -> tuple[list[int], SpecStats]:
    """Draft-then-verify decoding of a non-empty prompt; -> (new tokens, stats). At
    temperature > 0 the drafts are the drafter's argmax (`greedy`) or sampled from it
    (`sample`); both are lossless, their τ differ."""
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
        drafts, q = _propose(session.draft(seq), temperature, generator, draft_sampling)
        logits = session.verify(seq, drafts)
        accepted, token = _verify(logits, drafts, q, temperature, generator)
        stats.target_forwards += 1
        stats.accepted_per_cycle.append(accepted)
        added = [*drafts[:accepted], token]
        stats.cycle_starts.append(len(seq))
        seq += added
        if first_stop(added, stops) is not None:
            break
        session.commit(anchor_pos, accepted)
    new = seq[len(prompt_ids) :][:max_new_tokens]
    stop = first_stop(new, stops)
    new = new if stop is None else new[: stop + 1]
    stats.new_tokens = len(new)
    stats.sequence = list(prompt_ids) + new
    return new, stats
