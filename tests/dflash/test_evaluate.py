from dataclasses import dataclass, field

import pytest
import torch

from dflash.drafter import DFlashDrafter, DrafterConfig
from dflash.evaluate import evaluate_tau, greedy_generate, speculative_generate
from dflash.objective import LossConfig, block_labels, build_blocks, dflash_loss, select_anchors
from dflash.target import TargetModel, wrap_tiny
from dflash.tiny import TinyLM, TinyLMConfig

SMALL_LM = TinyLMConfig(hidden_size=32, num_layers=6, num_heads=2, intermediate_size=64)
BS = 4
PROMPTS = [[10, 20, 30, 40, 50], [97, 98, 99], [1]]


@pytest.fixture(scope="module")
def target() -> TargetModel:
    torch.manual_seed(0)
    return wrap_tiny(TinyLM(SMALL_LM))


def make_drafter(target: TargetModel) -> DFlashDrafter:
    torch.manual_seed(1)
    cfg = DrafterConfig.for_target(target, num_layers=1, block_size=BS)
    return DFlashDrafter(cfg, target.embed_tokens, target.lm_head)


@dataclass
class OracleDrafter:
    """Proposes the target's true greedy tokens, spoiling draft index 1 every other cycle."""

    reference: list[int]
    config: DrafterConfig
    cycles: int = 0
    proposals: list[list[int]] = field(default_factory=list)

    def draft(self, hidden: torch.Tensor, anchor_token: int, anchor_pos: int) -> list[int]:
        assert hidden.shape[1] == anchor_pos  # features of every token before the anchor
        assert self.reference[anchor_pos] == anchor_token
        proposal = self.reference[anchor_pos + 1 : anchor_pos + BS]
        if self.cycles % 2:
            proposal[1] = (proposal[1] + 1) % 256
        self.cycles += 1
        return proposal


def test_acceptance_counts_follow_the_drafts(target: TargetModel) -> None:
    prompt, n = PROMPTS[0], 13
    reference = prompt + greedy_generate(target, prompt, n + BS)
    oracle = OracleDrafter(reference, make_drafter(target).config)
    tokens, stats = speculative_generate(target, oracle, prompt, n)  # type: ignore[arg-type]
    assert tokens == reference[len(prompt) : len(prompt) + n]
    # 1 token from the prefill, then cycles of 4 (all accepted) and 2 (spoiled at index 1).
    assert stats.accepted_per_cycle == [3, 1, 3, 1]
    assert stats.target_forwards == 5 and stats.new_tokens == n


def test_speculative_equals_greedy_with_an_untrained_drafter(target: TargetModel) -> None:
    drafter = make_drafter(target)
    for prompt in PROMPTS:
        tokens, stats = speculative_generate(target, drafter, prompt, 12)
        assert tokens == greedy_generate(target, prompt, 12)
        assert stats.target_forwards == 1 + len(stats.accepted_per_cycle)
    result = evaluate_tau(target, drafter, PROMPTS, 12)
    assert 1.0 <= result.tau <= BS
    assert len(result.acceptance_per_position) == BS - 1
    assert result.num_cycles > 0 and result.new_tokens == 3 * 12
    assert result.tokens_per_target_forward == pytest.approx(36 / (3 + result.num_cycles))


def _train_on_greedy_text(target: TargetModel, drafter: DFlashDrafter, steps: int) -> None:
    """A few steps on the target's own continuations: enough to accept some drafts."""
    seqs = [p + greedy_generate(target, p, 24) for p in PROMPTS[:2]]
    length = min(map(len, seqs))
    ids = torch.tensor([s[:length] for s in seqs])  # [2, T]
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    hidden = target.capture(ids, drafter.config.target_layer_ids, with_logits=False).hidden
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        anchors, keep = select_anchors(loss_mask, 16, gen)
        blocks = build_blocks(ids, anchors, BS, drafter.mask_id)
        labels, valid = block_labels(ids, loss_mask, anchors, keep, BS)
        logits = drafter(hidden, blocks, anchors, keep)
        loss = dflash_loss(logits, labels, valid, LossConfig()).loss
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.slow
def test_speculative_equals_greedy_with_a_trained_drafter(target: TargetModel) -> None:
    drafter = make_drafter(target)
    untrained = evaluate_tau(target, drafter, PROMPTS[:2], 16)
    _train_on_greedy_text(target, drafter, steps=40)
    for prompt in PROMPTS:
        tokens, _ = speculative_generate(target, drafter, prompt, 16)
        assert tokens == greedy_generate(target, prompt, 16)
    trained = evaluate_tau(target, drafter, PROMPTS[:2], 16)
    assert trained.tau > untrained.tau
    assert drafter.training  # evaluate_tau restores the mode it found
