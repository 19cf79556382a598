"""Documents inside packed rows: positions, starts and the attention they allow.

A packed row holds several documents side by side; `doc_ids[B, T]` numbers them
within the row (non-decreasing along T). Nothing in one document may see another:
the target attends block-diagonally with positions restarting at 0 per document,
and a drafter block's context starts at its anchor's document start.
"""

from __future__ import annotations

import torch
from torch import Tensor


def document_starts(doc_ids: Tensor) -> Tensor:
    """doc_ids[B, T] -> start[B, T]: index of the first token of each token's document."""
    b, t = doc_ids.shape
    index = torch.arange(t, device=doc_ids.device).expand(b, t)  # [B, T]
    is_start = torch.ones_like(doc_ids, dtype=torch.bool)
    is_start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return torch.where(is_start, index, torch.zeros_like(index)).cummax(dim=1).values


def document_positions(doc_ids: Tensor) -> Tensor:
    """doc_ids[B, T] -> positions[B, T] restarting at 0 at every document start."""
    index = torch.arange(doc_ids.shape[1], device=doc_ids.device)
    return index - document_starts(doc_ids)


def document_causal_mask(doc_ids: Tensor) -> Tensor:
    """doc_ids[B, T] -> BoolTensor[B, 1, T, T]: causal and within one document (True = attend)."""
    t = doc_ids.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=doc_ids.device).tril()  # [T, T]
    same = doc_ids[:, :, None] == doc_ids[:, None, :]  # [B, T, T]
    return (same & causal)[:, None]


def anchor_context_start(anchors: Tensor, doc_ids: Tensor) -> Tensor:
    """anchors[B, N], doc_ids[B, T] -> ctx_start[B, N]: where each anchor's document
    begins; a block may see context positions in [ctx_start, anchor)."""
    return document_starts(doc_ids).gather(1, anchors.clamp(0, doc_ids.shape[1] - 1))


def same_document_as_anchor(anchors: Tensor, doc_ids: Tensor, block_size: int) -> Tensor:
    """BoolTensor[B, N, Bs]: block position anchor+k lies in the row and in the
    anchor's document."""
    b, n = anchors.shape
    t = doc_ids.shape[1]
    positions = anchors[:, :, None] + torch.arange(block_size, device=anchors.device)
    in_row = positions < t
    flat = positions.clamp(max=t - 1).reshape(b, n * block_size)
    docs = doc_ids.gather(1, flat).reshape(b, n, block_size)  # [B, N, Bs]
    return in_row & (docs == docs[:, :, :1])
