import json

import pytest
import torch

from dflash.data.tokenizer import MASK_ID
from dflash.drafter.attention import block_attention_mask
from dflash.drafter.io import load_drafter, save_drafter
from dflash.drafter.model import DFlashDrafter, DrafterConfig, DrafterError
from dflash.target.load import wrap_tiny
from dflash.target.model import TargetModel
from dflash.target.tiny import TinyLM, TinyLMConfig

SMALL_LM = TinyLMConfig(hidden_size=32, num_layers=6, num_heads=2, intermediate_size=64)
BS = 4


@pytest.fixture(scope="module")
def target() -> TargetModel:
    torch.manual_seed(0)
    return wrap_tiny(TinyLM(SMALL_LM))


def make_drafter(target: TargetModel) -> DFlashDrafter:
    cfg = DrafterConfig.for_target(target, num_layers=2, block_size=BS)
    torch.manual_seed(1)
    return DFlashDrafter(cfg, target.embed_tokens, target.lm_head)


def test_shared_embedding_and_head_are_not_drafter_parameters(target: TargetModel) -> None:
    drafter = make_drafter(target)
    names = set(dict(drafter.named_parameters()))
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert set(drafter.state_dict()) == names
    assert drafter.embed_tokens is target.embed_tokens and drafter.lm_head is target.lm_head
    assert not target.embed_tokens.weight.requires_grad
    assert drafter.fc.weight.shape == (32, 2 * 32)  # K = 2 captured layers of D = 32
    assert drafter.mask_id == MASK_ID and drafter.config.mask_token_source == "tokenizer"


def _forward_case(target: TargetModel, drafter: DFlashDrafter, ids: torch.Tensor):
    anchors = torch.tensor([[3, 9, 14]])
    keep = torch.ones(1, 3, dtype=torch.bool)
    blocks = torch.full((1, 3, BS), drafter.mask_id)
    blocks[0, :, 0] = ids[0, anchors[0]]
    hidden = target.capture(ids, drafter.config.target_layer_ids, with_logits=False).hidden
    return drafter(hidden, blocks, anchors, keep), hidden, blocks, anchors, keep


def test_mask_hides_context_at_and_after_the_anchor(target: TargetModel) -> None:
    drafter = make_drafter(target)
    torch.manual_seed(2)
    ids = torch.randint(0, 256, (1, 20))
    logits, hidden, blocks, anchors, keep = _forward_case(target, drafter, ids)
    # Token changes at/after anchor 9 (positions 9..19) reach the target features there only
    # (causal target), and block 1 must not see them; block 0 (anchor 3) neither.
    changed = ids.clone()
    changed[0, 9:] = torch.randint(0, 256, (11,))
    changed_hidden = target.capture(changed, drafter.config.target_layer_ids, False).hidden
    after = drafter(changed_hidden, blocks, anchors, keep)
    assert torch.allclose(after[0, :2], logits[0, :2], atol=1e-6)
    assert not torch.allclose(after[0, 2], logits[0, 2], atol=1e-4)  # anchor 14 sees 9..13
    # A feature strictly before the anchor does change the block.
    nudged = hidden.clone()
    nudged[0, 8] += 1.0
    assert not torch.allclose(drafter(nudged, blocks, anchors, keep)[0, 1], logits[0, 1], atol=1e-4)


def test_blocks_do_not_see_each_other(target: TargetModel) -> None:
    drafter = make_drafter(target)
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(3))
    logits, hidden, blocks, anchors, keep = _forward_case(target, drafter, ids)
    other = blocks.clone()
    other[0, 1] = torch.tensor([7, 8, 9, 10])  # rewrite block 1 entirely
    after = drafter(hidden, other, anchors, keep)
    assert torch.allclose(after[0, 0], logits[0, 0], atol=1e-6)
    assert torch.allclose(after[0, 2], logits[0, 2], atol=1e-6)
    assert not torch.allclose(after[0, 1], logits[0, 1], atol=1e-4)
    # Inside a block attention is bidirectional: the last token changes the first's logits.
    inner = blocks.clone()
    inner[0, 1, BS - 1] = 42
    assert not torch.allclose(drafter(hidden, inner, anchors, keep)[0, 1, 0], logits[0, 1, 0])


def test_overlapping_blocks_see_no_token_after_their_anchor(target: TargetModel) -> None:
    """Anchors closer than a block (3, 5, 6 with B=4: blocks 3-6, 5-8, 6-9) share
    positions. Changing every token from 6 on, which the blocks at 3 and 5 must predict,
    leaves their logits exactly as they were (the leak SpecForge #470 found in overlapping
    anchors); the block at 6, whose anchor changed, does change."""
    drafter = make_drafter(target)
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(4))
    anchors, keep = torch.tensor([[3, 5, 6]]), torch.ones(1, 3, dtype=torch.bool)

    def logits_of(tokens: torch.Tensor) -> torch.Tensor:
        blocks = torch.full((1, 3, BS), drafter.mask_id)
        blocks[0, :, 0] = tokens[0, anchors[0]]
        hidden = target.capture(tokens, drafter.config.target_layer_ids, False).hidden
        return drafter(hidden, blocks, anchors, keep)

    changed = ids.clone()
    changed[0, 6:] = (ids[0, 6:] + 1) % 256
    before, after = logits_of(ids), logits_of(changed)
    assert torch.equal(after[0, :2], before[0, :2])
    assert not torch.allclose(after[0, 2], before[0, 2], atol=1e-4)


def test_mask_shape_and_padding_rows(target: TargetModel) -> None:
    mask = block_attention_mask(torch.tensor([[2, 0]]), torch.tensor([[True, False]]), 5, 2)
    assert mask.shape == (1, 1, 4, 9)
    assert mask[0, 0, 0].tolist() == [True, True, False, False, False, True, True, False, False]
    assert mask[0, 0, 3].tolist() == [False] * 5 + [False, False, True, True]
    drafter = make_drafter(target)
    hidden = torch.randn(1, 5, 2 * 32)
    blocks = torch.full((1, 2, BS), drafter.mask_id)
    out = drafter(hidden, blocks, torch.tensor([[2, 0]]), torch.tensor([[True, False]]))
    assert torch.isfinite(out).all()


def test_draft_matches_a_single_block_forward(target: TargetModel) -> None:
    drafter = make_drafter(target)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(4))
    hidden = target.capture(ids, drafter.config.target_layer_ids, False).hidden
    proposal = drafter.draft(hidden, anchor_token=int(ids[0, 10]), anchor_pos=10)
    blocks = torch.full((1, 1, BS), drafter.mask_id)
    blocks[0, 0, 0] = ids[0, 10]
    logits = drafter(hidden, blocks, torch.tensor([[10]]), torch.ones(1, 1, dtype=torch.bool))
    assert proposal == logits[0, 0, 1:].argmax(-1).tolist()
    assert len(proposal) == BS - 1


def test_save_and_load_round_trip(target: TargetModel, tmp_path) -> None:
    drafter = make_drafter(target)
    save_drafter(drafter, tmp_path / "d")
    saved = json.loads((tmp_path / "d" / "config.json").read_text())
    assert saved["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": [1, 3]}
    meta = json.loads((tmp_path / "d" / "dflash_train.json").read_text())
    assert meta["target"] == "builtin:tiny" and meta["mask_token_source"] == "tokenizer"
    loaded, same_target = load_drafter(tmp_path / "d", target=target)
    assert same_target is target
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(5))
    before, after = (_forward_case(target, d, ids)[0] for d in (drafter, loaded))
    assert torch.equal(before, after)
    with pytest.raises(DrafterError, match="not a DFlash checkpoint"):
        load_drafter(tmp_path / "missing", target=target)


def test_training_step_reduces_loss(target: TargetModel) -> None:
    from dflash.config.settings import LossConfig
    from dflash.objective.blocks import block_labels, build_blocks, select_anchors
    from dflash.objective.reference import dflash_loss

    drafter = make_drafter(target)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(6))
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    hidden = target.capture(ids, drafter.config.target_layer_ids, False).hidden
    anchors, keep = select_anchors(loss_mask, 6, torch.Generator().manual_seed(0))
    blocks = build_blocks(ids, anchors, BS, drafter.mask_id)
    labels, valid = block_labels(ids, loss_mask, anchors, keep, BS)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        loss = dflash_loss(drafter(hidden, blocks, anchors, keep), labels, valid, LossConfig()).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.2
    assert target.embed_tokens.weight.grad is None


def test_cached_drafting_matches_the_cache_less_draft(target: TargetModel) -> None:
    from dflash.nn.kvcache import KVCache

    drafter = make_drafter(target)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(7))
    hidden = target.capture(ids, drafter.config.target_layer_ids, False).hidden
    cache = KVCache()
    for start, anchor in ((0, 6), (6, 9), (9, 15)):  # growing context, as decoding does
        token = int(ids[0, anchor])
        cached = drafter.draft_logits_cached(hidden[:, start:anchor], token, anchor, cache)
        full = drafter.draft_logits(hidden, token, anchor)
        assert torch.allclose(cached, full, atol=1e-5)
        assert cache.seq_len() == anchor  # the block's own keys/values were dropped
