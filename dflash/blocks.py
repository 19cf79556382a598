"""The drafter's inputs for one batch: anchors, blocks, labels and context starts.

One function so every loop (reference, pipeline, cache reader) builds blocks the
same way; with document-packed rows nothing crosses a document end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dflash.documents import anchor_context_start
from dflash.objective import NoiseSchedule, block_inputs, select_anchors


@dataclass
class BlockInputs:
    anchors: Tensor  # [B, N] long
    keep: Tensor  # [B, N] bool
    block_ids: Tensor  # [B, N, Bs] long
    labels: Tensor  # [B, N, Bs] long
    valid: Tensor  # [B, N, Bs] bool
    ctx_start: Tensor | None  # [B, N] long: first context position a block sees; None = 0

    def rows(self, rows: slice) -> BlockInputs:
        """The blocks of a micro-batch of rows."""
        ctx = None if self.ctx_start is None else self.ctx_start[rows]
        return BlockInputs(
            self.anchors[rows], self.keep[rows], self.block_ids[rows], self.labels[rows],
            self.valid[rows], ctx,
        )  # fmt: skip

    def to(self, device: torch.device | str) -> BlockInputs:
        """The same inputs on `device` (asynchronous copies where the memory allows)."""

        def move(t: Tensor) -> Tensor:
            return t.to(device, non_blocking=True)

        ctx = None if self.ctx_start is None else move(self.ctx_start)
        return BlockInputs(
            move(self.anchors), move(self.keep), move(self.block_ids), move(self.labels),
            move(self.valid), ctx,
        )  # fmt: skip


def prepare_blocks(
    input_ids: Tensor,
    loss_mask: Tensor,
    *,
    doc_ids: Tensor | None,
    num_anchors: int,
    block_size: int,
    mask_token_id: int,
    noise: NoiseSchedule | None = None,
    step: int = 0,
    generator: torch.Generator | None = None,
) -> BlockInputs:
    """Anchors, blocks and labels of a batch; doc_ids[B, T] (None = one document a
    row) keeps every anchor, block position and context inside the anchor's document."""
    anchors, keep = select_anchors(loss_mask, num_anchors, generator, doc_ids=doc_ids)
    block_ids, labels, valid = block_inputs(
        input_ids, loss_mask, anchors, keep, block_size, mask_token_id, noise, step, generator,
        doc_ids=doc_ids,
    )  # fmt: skip
    ctx_start = None if doc_ids is None else anchor_context_start(anchors, doc_ids)
    return BlockInputs(anchors, keep, block_ids, labels, valid, ctx_start)
