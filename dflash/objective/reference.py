"""The dense DFlash loss over whole [B, N, Bs, V] logits: the test oracle.

Training never runs it (dflash.objective.loss is the production path, which never
holds such a tensor); the tests check the chunked loss against it, as reference
trainers keep an eager loss beside their fused one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dflash.config.settings import LossConfig
from dflash.objective.loss import block_metrics, denominator, position_loss
from dflash.objective.noise import ObjectiveError


@dataclass
class LossOutput:
    loss: Tensor  # scalar, differentiable
    metrics: dict[str, Tensor]  # device tensors: reading them is the caller's sync


def dflash_loss(
    logits: Tensor,
    labels: Tensor,
    valid: Tensor,
    cfg: LossConfig,
    target_logits: Tensor | None = None,
    given: Tensor | None = None,
) -> LossOutput:
    """Weighted loss sum(w * l) / denominator over block positions (the weights' sum, or
    the scored blocks under D-PACE).

    logits[B, N, Bs, V], labels/valid[B, N, Bs]; target_logits[B, N, Bs, V] (from
    gather_target_logits) is required when cfg.use_soft_labels.
    """
    soft = None
    if cfg.use_soft_labels:
        if target_logits is None:
            raise ObjectiveError("--use-soft-labels needs target logits")
        soft = target_logits.float()
    gamma = cfg.decay_gamma(logits.shape[2])
    weights, per_pos, ce = position_loss(logits.float(), labels, valid, cfg, gamma, soft, given)
    loss = (weights * per_pos).sum() / denominator(weights, valid, cfg).clamp(min=1e-8)
    with torch.no_grad():
        correct = (logits.argmax(-1) == labels) & valid  # [B, N, Bs]
        # Accept proxy: consecutive correct predictions from k=1, +1 for the anchor's bonus.
        run = torch.cumprod(correct[..., 1:].int(), dim=-1).sum(-1)  # [B, N]
        metrics = block_metrics(correct, run, valid, (ce * valid).sum(), weights.sum())
    return LossOutput(loss=loss, metrics=metrics)
