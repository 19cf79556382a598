"""The DFlash training objective: anchors, blocks, labels, weights and losses.

Shapes: B batch, T sequence length, N anchors per sequence, Bs block size,
V vocabulary. Block position k (0..Bs-1) of the block anchored at a holds the
token at a+k; position 0 is the clean anchor and never counts for the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash.config import LossConfig, default_gamma
from dflash.documents import same_document_as_anchor
from dflash.errors import DFlashError

__all__ = ["LossConfig", "default_gamma"]  # the loss settings live in the config tree


class ObjectiveError(DFlashError):
    """An objective setting out of range; the message names the flag."""


@dataclass(frozen=True)
class NoiseSchedule:
    """Which non-anchor block positions are masked.

    The mask ratio goes linearly from `start_mask_ratio` to `end_mask_ratio` over
    `anneal_steps` optimizer steps; the default (1.0 throughout) masks every
    non-anchor position, the paper's choice.
    """

    start_mask_ratio: float = 1.0
    end_mask_ratio: float = 1.0
    anneal_steps: int = 0

    def __post_init__(self) -> None:
        for name in ("start_mask_ratio", "end_mask_ratio"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ObjectiveError(f"noise {name} {value} is outside [0, 1]")
        if self.anneal_steps < 0:
            raise ObjectiveError(f"noise anneal_steps {self.anneal_steps} is negative")

    @classmethod
    def parse(cls, spec: str, total_steps: int) -> NoiseSchedule:
        """`all` (every non-anchor position masked) or `linear:START:END`: the masked share
        goes from START to END over `total_steps` optimizer steps."""
        if spec == "all":
            return cls()
        parts = spec.split(":")
        if len(parts) != 3 or parts[0] != "linear":
            raise ObjectiveError(f"--noise-schedule {spec!r}: expected 'all' or 'linear:START:END'")
        try:
            start, end = float(parts[1]), float(parts[2])
        except ValueError as err:
            raise ObjectiveError(f"--noise-schedule {spec!r}: START and END are numbers") from err
        for value in (start, end):
            if not 0.0 < value <= 1.0:
                raise ObjectiveError(f"--noise-schedule {spec!r}: {value} is outside (0, 1]")
        return cls(start_mask_ratio=start, end_mask_ratio=end, anneal_steps=max(0, total_steps))

    def describe(self) -> str:
        if self.start_mask_ratio == self.end_mask_ratio == 1.0:
            return "all non-anchor masked"
        return (
            f"masked share {self.start_mask_ratio:g} -> {self.end_mask_ratio:g} "
            f"over {self.anneal_steps} steps"
        )

    def mask_ratio(self, step: int) -> float:
        if self.anneal_steps == 0 or step >= self.anneal_steps:
            return self.end_mask_ratio
        frac = step / self.anneal_steps
        return self.start_mask_ratio + frac * (self.end_mask_ratio - self.start_mask_ratio)

    def sample(
        self,
        shape: tuple[int, int, int],
        step: int,
        generator: torch.Generator | None,
        device: torch.device,
    ) -> Tensor:
        """BoolTensor[B, N, Bs]: True = masked. Position 0 (the anchor) is never masked."""
        ratio = self.mask_ratio(step)
        if ratio >= 1.0:
            masked = torch.ones(shape, dtype=torch.bool)  # draws nothing: default is RNG-free
        else:
            masked = torch.rand(shape, generator=generator) < ratio
        masked[..., 0] = False
        return masked.to(device)


@dataclass
class LossOutput:
    loss: Tensor  # scalar, differentiable
    metrics: dict[str, Tensor]  # device tensors: reading them is the caller's sync


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


def decay_weights(block_size: int, gamma: float, device: torch.device) -> Tensor:
    """[Bs]: 0 at k=0, exp(-(k-1)/gamma) for k >= 1."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def streak_weights(ce: Tensor, valid: Tensor, alpha: float) -> Tensor:
    """Streak-aware weights from per-position CE[B, N, Bs] (detached).

    q_i = exp(-CE_i), q~_i = (1-alpha) q_i + alpha over positions 1..Bs-1;
    weight_j = sum_{m>=j} prod_{i<=m} q~_i. An invalid position (past the row, outside
    the loss mask) ends the streak: its q~ is 0, so neither it nor anything after counts.
    """
    q = torch.exp(-ce.detach().float())
    q_tilde = torch.where(valid, (1 - alpha) * q + alpha, torch.zeros_like(q))
    q_tilde[..., 0] = 1.0  # the anchor is given, not predicted
    reach = torch.cumprod(q_tilde, dim=-1)  # [B, N, Bs]: prod_{i<=m}
    reach = reach * (torch.arange(ce.shape[-1], device=ce.device) >= 1)  # m ranges over k>=1
    return reach.flip(-1).cumsum(-1).flip(-1)  # suffix sums over m >= j


def _soft_label_loss(logits: Tensor, target_logits: Tensor, temperature: float) -> Tensor:
    """Per-position KL(target || drafter) at temperature, scaled by T^2 -> [B, N, Bs]."""
    log_p_target = F.log_softmax(target_logits.float() / temperature, dim=-1)
    log_p_drafter = F.log_softmax(logits.float() / temperature, dim=-1)
    kl = (log_p_target.exp() * (log_p_target - log_p_drafter)).sum(-1)
    return kl * temperature**2


def _metrics(
    logits: Tensor, labels: Tensor, valid: Tensor, ce: Tensor, weights: Tensor
) -> dict[str, Tensor]:
    """Device tensors only: a `float()` here would stall the device on every step."""
    correct = (logits.argmax(-1) == labels) & valid  # [B, N, Bs]
    num_valid = valid.sum().clamp(min=1)
    per_position = correct[..., 1:].sum((0, 1)) / valid[..., 1:].sum((0, 1)).clamp(min=1)
    # Accept proxy: consecutive correct predictions from k=1, +1 for the anchor's bonus.
    run = torch.cumprod(correct[..., 1:].int(), dim=-1).sum(-1)  # [B, N]
    scored = valid[..., 1]  # blocks whose first prediction counts
    num_scored = scored.sum()
    tau_sum = ((run + 1) * scored).sum()
    return {
        "ce": (ce * valid).sum() / num_valid,
        "accuracy": correct.sum() / num_valid,
        "accuracy_per_position": per_position,  # [Bs-1]: k = 1 .. Bs-1
        "tau_proxy": torch.where(num_scored > 0, tau_sum / num_scored.clamp(min=1), 1.0),
        "weight_sum": weights.sum(),
    }


def dflash_loss(
    logits: Tensor,
    labels: Tensor,
    valid: Tensor,
    cfg: LossConfig,
    target_logits: Tensor | None = None,
) -> LossOutput:
    """Weighted loss sum(w * l) / sum(w) over block positions.

    logits[B, N, Bs, V], labels/valid[B, N, Bs]; target_logits[B, N, Bs, V] (from
    gather_target_logits) is required when cfg.use_soft_labels.
    """
    b, n, bs, v = logits.shape
    gamma = cfg.decay_gamma(bs)
    ce = F.cross_entropy(logits.float().reshape(-1, v), labels.reshape(-1), reduction="none")
    ce = ce.reshape(b, n, bs)  # [B, N, Bs]
    weights = valid.float()
    if gamma is not None:
        weights = weights * decay_weights(bs, gamma, logits.device)
    if cfg.streak_alpha is not None:
        weights = weights * streak_weights(ce, valid, cfg.streak_alpha)
    per_pos = ce
    if cfg.use_soft_labels:
        if target_logits is None:
            raise ObjectiveError("--use-soft-labels needs target logits")
        kl = _soft_label_loss(logits, target_logits, cfg.kl_temperature)
        per_pos = cfg.kl_weight * kl + (1 - cfg.kl_weight) * ce
    loss = (weights * per_pos).sum() / weights.sum().clamp(min=1e-8)
    with torch.no_grad():
        metrics = _metrics(logits, labels, valid, ce, weights)
    return LossOutput(loss=loss, metrics=metrics)
