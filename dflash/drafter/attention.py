"""Block-sparse training attention of the drafter.

Block j's queries see the context keys in [ctx_start[j], anchors[j]) and the keys of
their own block, nothing else. The dense boolean mask (`block_attention_mask`) is
the reference; two exact paths skip the masked-out keys instead of masking them:
flex attention with a block mask on CUDA, and on CPU a grouped computation where
each group of consecutive blocks attends to the context range its blocks need plus
its own block tokens, under one joint softmax.

Shapes: B batch, T context length, N blocks (anchors), Bs block size, H query
heads, Hkv key/value heads (GQA: H a multiple of Hkv), Hd head dim, Q = N*Bs.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash.errors import DFlashError

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

BACKENDS = ("auto", "dense", "grouped", "flex")
FLEX_TILE = 128  # flex attention's query/key tile
# Below this many scores per head the dense kernel beats the grouped path's launches
# (measured on CPU: 128 x 256 dense is 3x faster, 512 x 768 grouped is 3x faster).
GROUPED_MIN_SCORES = 1 << 17


class AttentionError(DFlashError):
    """Attention inputs or a backend that do not fit together."""


@dataclass(frozen=True)
class BlockLayout:
    """Where the N blocks of a row sit: anchors/keep/ctx_start[B, N], T context keys."""

    anchors: Tensor
    keep: Tensor
    context_len: int
    block_size: int
    ctx_start: Tensor | None = None  # None: every block's context starts at 0

    def starts(self) -> Tensor:
        """[B, N] first context key a block sees."""
        if self.ctx_start is None:
            return torch.zeros_like(self.anchors)
        return self.ctx_start

    def ends(self) -> Tensor:
        """[B, N] one past the last context key a block sees (== start for padded blocks)."""
        starts = self.starts()
        return torch.where(self.keep, torch.maximum(self.anchors, starts), starts)


def block_attention_mask(
    anchors: Tensor,
    keep: Tensor,
    context_len: int,
    block_size: int,
    ctx_start: Tensor | None = None,
) -> Tensor:
    """Dense reference mask: block j sees context [ctx_start[j], anchors[j]) and its block.

    anchors, keep (, ctx_start): [B, N] -> BoolTensor[B, 1, N*Bs, T+N*Bs] (True = may
    attend). A padded block (keep False) sees only itself, so no row is all False.
    """
    layout = BlockLayout(anchors, keep, context_len, block_size, ctx_start)
    b, n = anchors.shape
    ctx_pos = torch.arange(context_len, device=anchors.device)  # [T]
    starts, ends = layout.starts()[:, :, None], layout.ends()[:, :, None]
    sees_ctx = (ctx_pos >= starts) & (ctx_pos < ends)  # [B, N, T]
    sees_ctx = sees_ctx[:, :, None, :].expand(b, n, block_size, context_len)  # [B, N, Bs, T]
    block_of = torch.arange(n, device=anchors.device).repeat_interleave(block_size)  # [Q]
    same_block = block_of[:, None] == block_of[None, :]  # [Q, Q]
    ctx_part = sees_ctx.reshape(b, n * block_size, context_len)  # [B, Q, T]
    blk_part = same_block[None].expand(b, -1, -1)  # [B, Q, Q]
    return torch.cat([ctx_part, blk_part], dim=-1)[:, None]  # [B, 1, Q, T+Q]


def block_sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: BlockLayout,
    backend: str = "auto",
    max_groups: int = 16,
) -> Tensor:
    """q[B, H, Q, Hd], k/v[B, Hkv, T+Q, Hd] (context keys, then block keys) -> [B, H, Q, Hd].

    `auto` picks flex attention on CUDA (grouped if it cannot compile) and elsewhere
    the grouped path, or dense for small problems; `dense` is the masked reference.
    `max_groups` bounds the grouped path's loop: fewer groups compute more masked
    context keys, more groups launch more kernels.
    """
    _check_shapes(q, k, v, layout)
    if backend not in BACKENDS:
        raise AttentionError(f"attention backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        if q.is_cuda and _flex_state.usable:
            backend = "flex"
        else:
            small = q.shape[2] * k.shape[2] < GROUPED_MIN_SCORES
            backend = "dense" if small and not q.is_cuda else "grouped"
    if backend == "dense":
        return _dense_attention(q, k, v, layout)
    if backend == "flex":
        out = _flex_or_none(q, k, v, layout)
        if out is not None:
            return out
    return _grouped_attention(q, k, v, layout, max_groups)


def _check_shapes(q: Tensor, k: Tensor, v: Tensor, layout: BlockLayout) -> None:
    b, h, q_len, _ = q.shape
    n, bs, t = layout.anchors.shape[1], layout.block_size, layout.context_len
    if q_len != n * bs or k.shape[2] != t + q_len or k.shape != v.shape:
        raise AttentionError(
            f"attention shapes q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)} do not fit "
            f"{n} blocks of {bs} after {t} context keys"
        )
    if h % k.shape[1] or k.shape[0] != b:
        raise AttentionError(f"{h} query heads do not group over {k.shape[1]} key/value heads")


def _dense_attention(q: Tensor, k: Tensor, v: Tensor, layout: BlockLayout) -> Tensor:
    mask = block_attention_mask(
        layout.anchors, layout.keep, layout.context_len, layout.block_size, layout.ctx_start
    )
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H, Q, Hd]


# --------------------------------------------------------------------------- grouped


def _group_bounds(layout: BlockLayout, max_groups: int) -> list[tuple[int, int, int, int]]:
    """(first block, end block, first key, end key) per group of consecutive blocks.

    Anchors are sorted per row, so consecutive block indices need nearby context
    ranges; one host read of the [N] per-block bounds (the CPU path needs them to slice).
    """
    n = layout.anchors.shape[1]
    starts, ends = layout.starts(), layout.ends()
    has_ctx = ends > starts  # [B, N]
    lo = torch.where(has_ctx, starts, layout.context_len).amin(0)  # [N]
    hi = torch.where(has_ctx, ends, 0).amax(0)  # [N]
    size = math.ceil(n / max(1, max_groups))
    bounds = []
    for j0 in range(0, n, size):
        j1 = min(n, j0 + size)
        bounds.append((j0, j1, lo[j0:j1].min(), hi[j0:j1].max()))
    flat = torch.stack([torch.stack([b[2], b[3]]) for b in bounds]).tolist()
    return [(b[0], b[1], int(f[0]), int(f[1])) for b, f in zip(bounds, flat, strict=True)]


def _grouped_attention(
    q: Tensor, k: Tensor, v: Tensor, layout: BlockLayout, max_groups: int
) -> Tensor:
    """Per group of consecutive blocks: keys [context lo:hi ; the group's block tokens].

    The masked keys still computed are the context between the group's anchors and the
    other blocks of the group, a bounded share; each group runs one fused SDPA kernel.
    Groups are taken with split (its backward is one cat; a slice's is a zero-filled copy).
    """
    t, bs = layout.context_len, layout.block_size
    gqa = q.shape[1] != k.shape[1]
    k_ctx, k_blk = k.split([t, k.shape[2] - t], dim=2)
    v_ctx, v_blk = v.split([t, k.shape[2] - t], dim=2)
    bounds = _group_bounds(layout, max_groups)
    rows = [(j1 - j0) * bs for j0, j1, _, _ in bounds]
    pieces = zip(bounds, q.split(rows, 2), k_blk.split(rows, 2), v_blk.split(rows, 2), strict=True)
    starts, ends = layout.starts(), layout.ends()
    outs = []
    for (j0, j1, lo, hi), qg, kb, vb in pieces:
        hi = max(hi, lo)
        kg = torch.cat([k_ctx[:, :, lo:hi], kb], dim=2)  # [B, Hkv, L + n_g*Bs, Hd]
        vg = torch.cat([v_ctx[:, :, lo:hi], vb], dim=2)
        mask = _group_mask(starts[:, j0:j1], ends[:, j0:j1], lo, hi, bs)
        outs.append(F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, enable_gqa=gqa))
    return torch.cat(outs, dim=2)  # [B, H, Q, Hd]


def _group_mask(starts: Tensor, ends: Tensor, lo: int, hi: int, bs: int) -> Tensor:
    """starts/ends[B, n_g] -> BoolTensor[B, 1, n_g*Bs, (hi-lo) + n_g*Bs]."""
    b, ng = starts.shape
    pos = torch.arange(lo, hi, device=starts.device)  # [L]
    sees_ctx = (pos >= starts[..., None]) & (pos < ends[..., None])  # [B, n_g, L]
    sees_ctx = sees_ctx.repeat_interleave(bs, dim=1)  # [B, n_g*Bs, L]
    block_of = torch.arange(ng, device=starts.device).repeat_interleave(bs)  # [n_g*Bs]
    own = (block_of[:, None] == block_of[None, :]).expand(b, -1, -1)  # [B, n_g*Bs, n_g*Bs]
    return torch.cat([sees_ctx, own], dim=-1)[:, None]


# --------------------------------------------------------------------------- flex


class _FlexState:
    """The compiled flex attention (one per process; torch.compile keys it by shape)."""

    def __init__(self) -> None:
        self.usable = True
        self.fn: Callable[..., Any] | None = None  # Any: compile keeps no signature

    def compiled(self) -> Callable[..., Any]:  # Any: flex_attention's, compiled
        if self.fn is None:
            from torch.nn.attention.flex_attention import flex_attention

            self.fn = torch.compile(flex_attention, dynamic=False)
        return self.fn


_flex_state = _FlexState()


def _flex_or_none(q: Tensor, k: Tensor, v: Tensor, layout: BlockLayout) -> Tensor | None:
    """Flex attention (compiled on CUDA, eager elsewhere); None after a compile failure."""
    if not _flex_state.usable:
        return None
    mask = flex_block_mask(layout, q.shape[2], k.shape[2])
    gqa = q.shape[1] != k.shape[1]
    if not q.is_cuda:  # eager flex: exact but dense-speed; tests use it on CPU
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)
    try:
        return _flex_state.compiled()(q, k, v, block_mask=mask, enable_gqa=gqa)
    except Exception as err:  # noqa: BLE001 - any compile failure falls back
        _flex_state.usable = False
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        warnings.warn(
            f"flex attention does not compile here ({first}); using grouped attention",
            stacklevel=3,
        )
        return None


def _tile_masks(layout: BlockLayout, q_len: int, kv_len: int) -> tuple[Tensor, Tensor]:
    """(any, full): BoolTensor[B, Qt, Kt] of key tiles a query tile needs / sees whole."""
    tile, bs, t = FLEX_TILE, layout.block_size, layout.context_len
    dev = layout.anchors.device
    starts, ends = layout.starts(), layout.ends()  # [B, N]
    n = starts.shape[1]
    k_lo = torch.arange(0, kv_len, tile, device=dev)  # [Kt] first key of each tile
    k_hi = (k_lo + tile).clamp(max=kv_len)
    own_lo = t + torch.arange(n, device=dev) * bs  # [N]
    ctx_any = (k_lo < ends[..., None]) & (k_hi > starts[..., None])  # [B, N, Kt]
    own_any = (k_lo < own_lo[:, None] + bs) & (k_hi > own_lo[:, None])  # [N, Kt]
    ctx_full = (k_lo >= starts[..., None]) & (k_hi <= ends[..., None])
    own_full = (k_lo >= own_lo[:, None]) & (k_hi <= own_lo[:, None] + bs)
    block_any = ctx_any | own_any  # [B, N, Kt]
    block_full = ctx_full | own_full
    # Each query row belongs to one block; a query tile spans the rows' blocks.
    rows = torch.arange(q_len, device=dev)
    q_tiles = math.ceil(q_len / tile)
    row_any = block_any[:, rows // bs]  # [B, Q, Kt]
    row_full = block_full[:, rows // bs]
    pad = q_tiles * tile - q_len
    row_any = F.pad(row_any, (0, 0, 0, pad), value=False)
    row_full = F.pad(row_full, (0, 0, 0, pad), value=True)
    b, kt = row_any.shape[0], k_lo.shape[0]
    tile_any = row_any.reshape(b, q_tiles, tile, kt).any(2)
    tile_full = row_full.reshape(b, q_tiles, tile, kt).all(2)
    return tile_any, tile_full & tile_any


def _as_indices(tiles: Tensor) -> tuple[Tensor, Tensor]:
    """BoolTensor[B, Qt, Kt] -> (counts[B, 1, Qt], indices[B, 1, Qt, Kt]) in flex's layout."""
    counts = tiles.sum(-1, dtype=torch.int32)
    order = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts[:, None], order[:, None]


def flex_block_mask(layout: BlockLayout, q_len: int, kv_len: int) -> BlockMask:
    """The flex BlockMask of `layout`, built from tile bounds (never a [Q, T+Q] grid)."""
    from torch.nn.attention.flex_attention import BlockMask

    bs, t = layout.block_size, layout.context_len
    starts, ends = layout.starts(), layout.ends()

    def mask_mod(b: Tensor, _h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        blk = q_idx // bs
        in_ctx = (kv_idx >= starts[b, blk]) & (kv_idx < ends[b, blk])
        return in_ctx | ((kv_idx >= t) & ((kv_idx - t) // bs == blk))

    tile_any, tile_full = _tile_masks(layout, q_len, kv_len)
    partial = _as_indices(tile_any & ~tile_full)  # (counts, indices) of the tiles mask_mod decides
    full = _as_indices(tile_full)  # and of the tiles whose every query sees every key
    return BlockMask.from_kv_blocks(
        *partial, *full, BLOCK_SIZE=FLEX_TILE, mask_mod=mask_mod, seq_lengths=(q_len, kv_len)
    )
