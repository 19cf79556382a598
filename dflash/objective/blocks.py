"""Anchors, blocks and labels: the drafter's inputs for one batch.

Shapes: B batch, T sequence length, N anchors per sequence, Bs block size. Block
position k (0..Bs-1) of the block anchored at a holds the token at a+k; position 0 is
the clean anchor and never counts for the loss. `prepare_blocks` is the one function
every loop (reference, pipeline, cache reader) builds blocks with; with
document-packed rows nothing crosses a document end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from dflash.data.documents import anchor_context_start, same_document_as_anchor
from dflash.objective.noise import NoiseSchedule, ObjectiveError


def select_anchors(
    loss_mask: Tensor,
    num_anchors: int,
    generator: torch.Generator | None = None,
    doc_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Up to num_anchors anchors per sequence, uniformly without replacement.

    Valid anchors p have loss_mask[p] and loss_mask[p+1] (and, with doc_ids[B, T],
    p+1 in p's document; the random draws are the same either way). loss_mask[B, T] ->
    anchors[B, N] sorted ascending (kept ones first), keep[B, N]; N = min(num_anchors, T-1);
    padding slots hold position 0 with keep False.
    """
    if num_anchors < 1:
        raise ObjectiveError(f"--num-anchors {num_anchors} must be >= 1")
    b, t = loss_mask.shape
    n = max(1, min(num_anchors, t - 1))
    mask = loss_mask.bool().cpu()
    valid = torch.zeros(b, t, dtype=torch.bool)
    valid[:, :-1] = mask[:, :-1] & mask[:, 1:]
    if doc_ids is not None:
        docs = doc_ids.cpu()
        valid[:, :-1] &= docs[:, :-1] == docs[:, 1:]
    # Random keys in [0, 1) for valid positions, 2 for invalid: the n smallest keys are
    # a uniform sample of the valid positions, followed by invalid ones as padding.
    keys = torch.rand(b, t, generator=generator).masked_fill(~valid, 2.0)
    picked = keys.topk(n, dim=1, largest=False).indices  # [B, N]
    keep = valid.gather(1, picked)  # [B, N]
    # Sort kept anchors by position; padding (sort key >= t) goes last.
    sort_key = torch.where(keep, picked, picked + t)
    order = sort_key.argsort(dim=1)
    anchors = picked.gather(1, order).masked_fill(~keep.gather(1, order), 0)
    keep = keep.gather(1, order)
    return anchors.to(loss_mask.device), keep.to(loss_mask.device)


def _block_positions(anchors: Tensor, block_size: int) -> Tensor:
    """anchors[B, N] -> positions[B, N, Bs] = anchor + k."""
    return anchors[:, :, None] + torch.arange(block_size, device=anchors.device)


def _gather_tokens(input_ids: Tensor, positions: Tensor) -> Tensor:
    """input_ids[B, T], positions[B, N, Bs] (clamped into range) -> tokens[B, N, Bs]."""
    b, n, bs = positions.shape
    t = input_ids.shape[1]
    flat = positions.clamp(max=t - 1).reshape(b, n * bs)  # [B, N*Bs]
    return input_ids.gather(1, flat).reshape(b, n, bs)


def _masked_and_blocks(
    input_ids: Tensor,
    anchors: Tensor,
    block_size: int,
    mask_token_id: int,
    noise: NoiseSchedule | None,
    step: int,
    generator: torch.Generator | None,
    doc_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """-> masked[B, N, Bs] (True = the drafter sees the mask token), block_ids[B, N, Bs].

    Positions past the end of the sequence, or of the anchor's document when
    doc_ids[B, T] is given, are always masked (there is no clean token).
    """
    noise = noise or NoiseSchedule()
    positions = _block_positions(anchors, block_size)  # [B, N, Bs]
    clean = _gather_tokens(input_ids, positions)
    masked = noise.sample(tuple(positions.shape), step, generator, input_ids.device)
    masked |= positions >= input_ids.shape[1]
    if doc_ids is not None:
        masked[..., 1:] |= ~same_document_as_anchor(anchors, doc_ids, block_size)[..., 1:]
    return masked, clean.masked_fill(masked, mask_token_id)


def build_blocks(
    input_ids: Tensor,
    anchors: Tensor,
    block_size: int,
    mask_token_id: int,
    noise: NoiseSchedule | None = None,
    step: int = 0,
    generator: torch.Generator | None = None,
    doc_ids: Tensor | None = None,
) -> Tensor:
    """block_ids[B, N, Bs]: the clean anchor, then masked (or, per noise, clean) tokens."""
    return _masked_and_blocks(
        input_ids, anchors, block_size, mask_token_id, noise, step, generator, doc_ids
    )[1]


def block_inputs(
    input_ids: Tensor,
    loss_mask: Tensor,
    anchors: Tensor,
    keep: Tensor,
    block_size: int,
    mask_token_id: int,
    noise: NoiseSchedule | None = None,
    step: int = 0,
    generator: torch.Generator | None = None,
    doc_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """-> block_ids, labels, valid [B, N, Bs]; a position scores only when it was masked
    (a partial noise schedule leaves some tokens visible: predicting those is free)."""
    masked, block_ids = _masked_and_blocks(
        input_ids, anchors, block_size, mask_token_id, noise, step, generator, doc_ids
    )
    labels, valid = block_labels(
        input_ids, loss_mask, anchors, keep, block_size, masked, doc_ids=doc_ids
    )
    return block_ids, labels, valid


def block_labels(
    input_ids: Tensor,
    loss_mask: Tensor,
    anchors: Tensor,
    keep: Tensor,
    block_size: int,
    masked: Tensor | None = None,
    doc_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Unshifted labels: position k predicts the token at anchor+k.

    -> labels[B, N, Bs], valid[B, N, Bs] = keep & in_bounds & loss_mask[a+k] & k >= 1
    (& masked, when given: a partially masked block does not score its visible tokens;
    & a+k in the anchor's document, when doc_ids[B, T] is given).
    """
    t = input_ids.shape[1]
    positions = _block_positions(anchors, block_size)  # [B, N, Bs]
    labels = _gather_tokens(input_ids, positions)
    in_bounds = positions < t
    valid = keep[:, :, None] & in_bounds & _gather_tokens(loss_mask.bool(), positions)
    valid[..., 0] = False
    if masked is not None:
        valid &= masked
    if doc_ids is not None:
        valid &= same_document_as_anchor(anchors, doc_ids, block_size)
    return labels, valid


def gather_target_logits(target_logits: Tensor, anchors: Tensor, block_size: int) -> Tensor:
    """Target logits[B, T, V] -> [B, N, Bs, V] aligned with block labels.

    The target predicts token p+1 at position p, so block position k takes the
    target's logits at anchor+k-1 (position 0's entry is unused).
    """
    b, t, v = target_logits.shape
    n = anchors.shape[1]
    pos = (_block_positions(anchors, block_size) - 1).clamp(0, t - 1)  # [B, N, Bs]
    idx = pos.reshape(b, n * block_size, 1).expand(-1, -1, v)  # [B, N*Bs, V]
    return target_logits.gather(1, idx).reshape(b, n, block_size, v)


@dataclass
class BlockInputs:
    anchors: Tensor  # [B, N] long
    keep: Tensor  # [B, N] bool
    block_ids: Tensor  # [B, N, Bs] long
    labels: Tensor  # [B, N, Bs] long
    valid: Tensor  # [B, N, Bs] bool
    given: Tensor  # [B, N, Bs] bool: the drafter sees the clean token (anchor, noise-visible)
    ctx_start: Tensor | None  # [B, N] long: first context position a block sees; None = 0

    def rows(self, rows: slice) -> BlockInputs:
        """The blocks of a micro-batch of rows."""
        return self._map(lambda t: t[rows])

    def to(self, device: torch.device | str) -> BlockInputs:
        """The same inputs on `device` (asynchronous copies where the memory allows)."""
        return self._map(lambda t: t.to(device, non_blocking=True))

    def _map(self, fn: Callable[[Tensor], Tensor]) -> BlockInputs:
        """`fn` of every tensor (ctx_start first, where there is one)."""
        ctx = None if self.ctx_start is None else fn(self.ctx_start)
        return BlockInputs(
            fn(self.anchors),
            fn(self.keep),
            fn(self.block_ids),
            fn(self.labels),
            fn(self.valid),
            fn(self.given),
            ctx,
        )


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
    noising = (noise, step, generator)
    masked, block_ids = _masked_and_blocks(
        input_ids, anchors, block_size, mask_token_id, *noising, doc_ids=doc_ids
    )
    labels, valid = block_labels(
        input_ids, loss_mask, anchors, keep, block_size, masked, doc_ids=doc_ids
    )
    ctx_start = None if doc_ids is None else anchor_context_start(anchors, doc_ids)
    return BlockInputs(anchors, keep, block_ids, labels, valid, ~masked, ctx_start)
