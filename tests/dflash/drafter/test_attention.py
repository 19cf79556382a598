import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from dflash.drafter.attention import (
    AttentionError,
    BlockLayout,
    block_attention_mask,
    block_sparse_attention,
    flex_block_mask,
)

T, BS = 150, 8


def make_case(seed: int, b=2, n=10, h=4, hkv=2, hd=8, doc_starts=True):
    gen = torch.Generator().manual_seed(seed)
    anchors = torch.sort(torch.randint(1, T, (b, n), generator=gen), dim=1).values
    anchors[0, -1] = T - 1  # a block running past the end of the row
    keep = torch.rand(b, n, generator=gen) > 0.25
    keep[:, 0] = True
    keep[-1, -3:] = False  # padded slots, as select_anchors leaves them
    anchors = anchors.masked_fill(~keep, 0)
    ctx_start = None
    if doc_starts:
        ctx_start = torch.minimum(torch.randint(0, 60, (b, n), generator=gen), anchors)
    layout = BlockLayout(anchors, keep, T, BS, ctx_start)
    q = torch.randn(b, h, n * BS, hd, generator=gen)
    k = torch.randn(b, hkv, T + n * BS, hd, generator=gen)
    v = torch.randn(b, hkv, T + n * BS, hd, generator=gen)
    return q, k, v, layout


@pytest.mark.parametrize("backend", ["grouped", "flex"])
@pytest.mark.parametrize("doc_starts", [False, True])
@pytest.mark.parametrize("max_groups", [1, 3, 100])
def test_sparse_paths_equal_the_dense_reference(backend, doc_starts, max_groups) -> None:
    q, k, v, layout = make_case(seed=max_groups, doc_starts=doc_starts)
    ref = block_sparse_attention(q, k, v, layout, backend="dense")
    out = block_sparse_attention(q, k, v, layout, backend=backend, max_groups=max_groups)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_grouped_gradients_equal_the_dense_reference() -> None:
    q, k, v, layout = make_case(seed=7, h=2, hkv=1)
    grads = []
    for backend in ("dense", "grouped"):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        out = block_sparse_attention(*leaves, layout, backend=backend, max_groups=4)
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        grads.append([x.grad for x in leaves])
    for ref, got in zip(*grads, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_a_block_sees_nothing_of_other_blocks_or_outside_its_context() -> None:
    q, k, v, layout = make_case(seed=3, b=1, n=8, doc_starts=True)
    out = block_sparse_attention(q, k, v, layout, backend="grouped")
    j = 1
    start, end = int(layout.starts()[0, j]), int(layout.ends()[0, j])
    assert bool(layout.keep[0, j]) and 0 < start < end  # a kept block inside a document
    hidden = torch.ones(k.shape[2], dtype=torch.bool)
    hidden[start:end] = False
    hidden[T + j * BS : T + (j + 1) * BS] = False
    k2, v2 = k.clone(), v.clone()
    k2[:, :, hidden] = torch.randn_like(k2[:, :, hidden])
    v2[:, :, hidden] = 100.0
    out2 = block_sparse_attention(q, k2, v2, layout, backend="grouped")
    rows = slice(j * BS, (j + 1) * BS)
    torch.testing.assert_close(out2[:, :, rows], out[:, :, rows])
    assert not torch.allclose(out2[:, :, 2 * BS :], out[:, :, 2 * BS :])


def test_dense_mask_rows_are_never_empty_and_padded_blocks_see_only_themselves() -> None:
    _, _, _, layout = make_case(seed=1)
    mask = block_attention_mask(layout.anchors, layout.keep, T, BS, layout.ctx_start)
    assert mask.shape == (2, 1, 10 * BS, T + 10 * BS)
    assert mask.any(-1).all()
    padded_row = mask[1, 0, 9 * BS]  # block 9 of row 1 is padding
    assert not padded_row[:T].any() and padded_row[T:].sum() == BS


def test_flex_block_mask_tiles_equal_torchs_own_construction() -> None:
    _, _, _, layout = make_case(seed=5, n=40)
    q_len, kv_len = 40 * BS, T + 40 * BS
    starts, ends = layout.starts(), layout.ends()

    def mask_mod(b, _h, q_idx, kv_idx):
        blk = q_idx // BS
        own = (kv_idx >= T) & ((kv_idx - T) // BS == blk)
        return ((kv_idx >= starts[b, blk]) & (kv_idx < ends[b, blk])) | own

    ref = create_block_mask(mask_mod, 2, None, q_len, kv_len, device="cpu")
    ours = flex_block_mask(layout, q_len, kv_len)
    assert torch.equal(ours.kv_num_blocks, ref.kv_num_blocks)
    assert torch.equal(ours.full_kv_num_blocks, ref.full_kv_num_blocks)
    assert torch.equal(ours.to_dense(), ref.to_dense())


def test_bad_shapes_and_backends_are_one_line_errors() -> None:
    q, k, v, layout = make_case(seed=2)
    with pytest.raises(AttentionError, match="do not fit"):
        block_sparse_attention(q[:, :, 1:], k, v, layout)
    with pytest.raises(AttentionError, match="'sparse'"):
        block_sparse_attention(q, k, v, layout, backend="sparse")
    with pytest.raises(AttentionError, match="do not group"):
        block_sparse_attention(q[:, :3], k, v, layout)
