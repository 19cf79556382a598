"""Documents packed into one row do not see each other: not in the target, not in
the drafter's blocks, labels or context."""

import pytest
import torch
import torch.nn.functional as F

from dflash.drafter.model import DFlashDrafter, DrafterConfig
from dflash.objective.blocks import prepare_blocks
from dflash.target.load import wrap_tiny
from dflash.target.model import TargetModel
from dflash.target.tiny import TinyLM, TinyLMConfig

SMALL_LM = TinyLMConfig(hidden_size=32, num_layers=4, num_heads=2, intermediate_size=64)
LAYERS = [1, 2]
BLOCK = 4


@pytest.fixture(scope="module")
def tiny() -> TargetModel:
    torch.manual_seed(0)
    return wrap_tiny(TinyLM(SMALL_LM))


def _hf_target(arch: str) -> TargetModel:
    import transformers

    from dflash.data.tokenizer import ByteTokenizer
    from dflash.target.geometry import geometry_from_hf_config
    from dflash.target.hf import _find_decoder_layers

    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    sizes = dict(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=3)
    heads = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    cfg = cfg_cls(**sizes, **heads, max_position_embeddings=128, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = model_cls(cfg).eval()
    layers, geometry = _find_decoder_layers(model, 3), geometry_from_hf_config(cfg)
    return TargetModel(
        model, layers, spec=f"test-{arch}", tokenizer=ByteTokenizer(), geometry=geometry
    )


def _row(first: torch.Tensor, second: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.cat([first, second])[None]  # [1, T]
    doc_ids = torch.cat([torch.zeros(len(first)), torch.ones(len(second))]).long()[None]
    return ids, doc_ids


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ["tiny", "llama", "qwen3"])
def test_target_hidden_states_of_a_document_ignore_its_neighbours(tiny, kind) -> None:
    target = tiny if kind == "tiny" else _hf_target(kind)
    doc = _tokens(12, 1)
    alone = target.capture(doc[None], LAYERS, with_logits=True)
    for other in (_tokens(9, 2), _tokens(9, 3), _tokens(20, 4)):
        ids, doc_ids = _row(other, doc)
        out = target.capture(ids, LAYERS, with_logits=True, doc_ids=doc_ids)
        mine = doc_ids[0] == 1
        assert torch.allclose(out.hidden[0, mine], alone.hidden[0], atol=1e-5)
        assert torch.allclose(out.logits[0, mine], alone.logits[0], atol=1e-5)
    # Without document ids the neighbour leaks in: the check above can fail.
    leaky = target.capture(ids, LAYERS, with_logits=False)
    assert not torch.allclose(leaky.hidden[0, mine], alone.hidden[0], atol=1e-3)


def _block_losses(target, drafter, ids, doc_ids, use_docs: bool) -> tuple[torch.Tensor, ...]:
    """Per-block weighted CE [N] and anchors [N] of the single row."""
    docs = doc_ids if use_docs else None
    hidden = target.capture(ids, LAYERS, with_logits=False, doc_ids=docs).hidden
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    gen = torch.Generator().manual_seed(0)
    opts = dict(num_anchors=12, block_size=BLOCK, mask_token_id=drafter.mask_id)
    blocks = prepare_blocks(ids, loss_mask, doc_ids=docs, generator=gen, **opts)
    logits = drafter(hidden, blocks.block_ids, blocks.anchors, blocks.keep, blocks.ctx_start)
    ce = F.cross_entropy(logits.flatten(0, 2), blocks.labels.flatten(), reduction="none")
    w = blocks.valid.flatten().float()
    per_block = (ce * w).view(-1, BLOCK).sum(-1) / w.view(-1, BLOCK).sum(-1).clamp(min=1)
    return per_block, blocks.anchors[0], blocks.valid[0]


def test_a_block_loss_ignores_the_other_documents_of_its_row(tiny) -> None:
    cfg = DrafterConfig.for_target(tiny, num_layers=1, block_size=BLOCK, target_layer_ids=LAYERS)
    torch.manual_seed(1)
    drafter = DFlashDrafter(cfg, tiny.embed_tokens, tiny.lm_head).eval()
    doc = _tokens(16, 5)
    ids_a, doc_ids = _row(_tokens(14, 6), doc)
    ids_b, _ = _row(_tokens(14, 7), doc)  # same length, other content
    with torch.no_grad():
        loss_a, anchors, valid = _block_losses(tiny, drafter, ids_a, doc_ids, True)
        loss_b, anchors_b, _ = _block_losses(tiny, drafter, ids_b, doc_ids, True)
        leaky_a, *_ = _block_losses(tiny, drafter, ids_a, doc_ids, False)
        leaky_b, *_ = _block_losses(tiny, drafter, ids_b, doc_ids, False)
    assert torch.equal(anchors, anchors_b)
    in_doc = (anchors >= 14) & valid[:, 1]
    assert in_doc.sum() >= 3
    assert torch.allclose(loss_a[in_doc], loss_b[in_doc], atol=1e-6)
    assert not torch.allclose(leaky_a[in_doc], leaky_b[in_doc], atol=1e-4)
    # No anchor of the first document labels a token of the second.
    first = anchors < 14
    positions = anchors[:, None] + torch.arange(BLOCK)
    assert not (valid[first] & (positions[first] >= 14)).any()


def test_dense_mask_limits_context_to_the_document_start() -> None:
    from dflash.drafter.attention import block_attention_mask

    anchors, keep = torch.tensor([[3, 7]]), torch.ones(1, 2, dtype=torch.bool)
    mask = block_attention_mask(anchors, keep, 8, 2, ctx_start=torch.tensor([[0, 5]]))[0, 0]
    assert mask[0, :8].tolist() == [True] * 3 + [False] * 5
    assert mask[2, :8].tolist() == [False] * 5 + [True, True, False]
