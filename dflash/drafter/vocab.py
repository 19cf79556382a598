"""A smaller draft vocabulary: which target tokens the drafter's head can propose.

The LM head is most of a drafter's FLOPs on a large vocabulary (on Qwen3's 151,936
tokens it dominates the step), while a chat corpus uses a small part of it. As in
EAGLE-3 and speculators, the drafter keeps the rows of the target's frozen head for the
N tokens most frequent among the training labels, and two mappings that serving
engines read beside its weights:

- `d2t` int64[N]: offsets, target id = draft id + d2t[draft id] (vLLM's
  `draft_id_to_target_id`, speculators' `d2t`);
- `t2d` bool[V]: whether a target id is in the draft vocabulary.

Draft ids are the kept target ids in ascending order, so both are cheap to invert.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from dflash.errors import DFlashError


class DraftVocabError(DFlashError):
    """A draft vocabulary that cannot be built (too large, too small for its must-haves)."""


@dataclass(frozen=True)
class DraftVocab:
    target_ids: Tensor  # int64[N], ascending: draft id i proposes target id target_ids[i]
    vocab_size: int  # V of the target
    coverage: float  # share of the training labels whose token is kept
    required: tuple[int, ...]  # ids kept whatever their count (mask and stop tokens)

    @property
    def size(self) -> int:
        return int(self.target_ids.numel())

    def d2t(self) -> Tensor:
        return self.target_ids - torch.arange(self.size, dtype=torch.long)

    def t2d(self) -> Tensor:
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[self.target_ids] = True
        return mask

    def describe(self) -> str:
        return (
            f"draft vocabulary: the {self.size:,} most frequent of the target's "
            f"{self.vocab_size:,} tokens (mask and stop tokens included) hold "
            f"{self.coverage:.1%} of the training labels; the rest can never be drafted"
        )


def check_draft_vocab_size(
    size: int, vocab_size: int, stop_ids: Iterable[int] = (), mask_id: int | None = None
) -> None:
    """One-line DraftVocabError naming the value when `size` cannot hold a vocabulary:
    more tokens than the target has, or fewer than the stop tokens and the mask token
    (known or not yet chosen) it must keep."""
    if size > vocab_size:
        raise DraftVocabError(
            f"--draft-vocab-size {size} is larger than the target's vocabulary of "
            f"{vocab_size} tokens (leave it unset for the whole vocabulary)"
        )
    stops = sorted(set(stop_ids) - {mask_id})
    if size < len(stops) + 1:
        raise DraftVocabError(
            f"--draft-vocab-size {size} cannot hold the {len(stops) + 1} tokens every draft "
            f"vocabulary keeps: the mask token and the stop tokens {stops}"
        )


def select_draft_vocab(
    ids: Tensor | np.ndarray,
    learnable: Tensor | np.ndarray,
    size: int,
    vocab_size: int,
    required: Iterable[int],
) -> DraftVocab:
    """The `size` target tokens most frequent among the learnable labels of ids[R, T]
    (learnable[R, T] bool), `required` ids (the mask token and stop tokens) always in.
    Ties, and the places left once every label token is in, go to the tokens most
    frequent anywhere in the rows, then to the lowest ids: the choice depends on the
    data alone."""
    must = sorted(set(int(i) for i in required))
    check_draft_vocab_size(size, vocab_size, must[1:], must[0] if must else None)
    flat = torch.as_tensor(ids).reshape(-1).long()
    keep = torch.as_tensor(learnable).reshape(-1).bool()
    labels = torch.bincount(flat[keep], minlength=vocab_size)
    anywhere = torch.bincount(flat, minlength=vocab_size)
    # One sort key: label count first, then the count anywhere; argsort is stable, so
    # equal keys keep ascending id order.
    key = labels[:vocab_size].double() * (flat.numel() + 1) + anywhere[:vocab_size].double()
    key[must] = float("inf")
    order = torch.argsort(key, descending=True, stable=True)
    kept = torch.sort(order[:size]).values
    total = int(labels.sum())
    coverage = float(labels[kept].sum()) / total if total else 1.0
    return DraftVocab(kept.long(), vocab_size, coverage, tuple(must))
