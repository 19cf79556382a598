"""The DFlash loss: position weights, the KL/CE mix, and the chunked production loss.

`position_loss` is the one body of the loss (weights exp(-(k-1)/γ) or D-PACE's, CE,
and with soft labels the KL mixed in by --kl-weight); the production loss
`chunked_dflash_loss` and the dense test oracle (dflash.objective.reference) both
call it. The loss is a sum over positions divided by one denominator (`denominator`):
the weights' sum under the decay, the number of scored blocks under D-PACE. Both parts
are sums, so micro-batches, replicas and ranks add theirs up and divide once
(dflash.train.optim.GradAccumulator, dflash.pipeline.distributed.GradAverager): how the
examples were split never changes the update.

The production loss runs the LM head, the CE, the KL and the weights over chunks of
blocks, so no [B, N, Bs, V] tensor ever exists; each chunk is recomputed in the
backward (torch.utils.checkpoint), so the extra memory is one chunk's logits and their
softmax, O(chunk × Bs × V), whatever the anchor count. Values and gradients equal the
dense loss.

Soft labels come from the target's final-norm hidden state: the frozen LM head turns
each chunk's gathered states into target logits, so logits never cross the queue.

Shapes: B batch, T sequence length, N anchors, Bs block size, D hidden, V vocabulary,
M = B*N blocks, C blocks per chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from dflash.config.settings import LossConfig
from dflash.objective.blocks import gather_target_logits
from dflash.objective.noise import ObjectiveError


def decay_weights(block_size: int, gamma: float, device: torch.device) -> Tensor:
    """[Bs]: 0 at k=0, exp(-(k-1)/gamma) for k >= 1."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def streak_weights(ce: Tensor, valid: Tensor, alpha: float, given: Tensor | None = None) -> Tensor:
    """D-PACE's position weights (arXiv 2605.18810, Eq. 7-8) from per-position CE[B, N, Bs]
    (detached).

    q_i = exp(-CE_i), q~_i = (1-alpha) q_i + alpha at the scored positions (`valid`);
    weight_j = sum over scored m >= j of prod_{i<=m} q~_i. A position whose token the
    drafter is given (the anchor; what a partial noise schedule left visible: `given`)
    is accepted for sure, q~ = 1, and is no term of the sum. Any other unscored position
    (past the row, outside the loss mask, a draft-vocabulary miss) ends the streak as it
    would in serving: its q~ is 0, so nothing after it counts.
    """
    q = torch.exp(-ce.detach().float())
    sure = torch.zeros_like(valid) if given is None else given
    q_tilde = torch.where(valid, (1 - alpha) * q + alpha, sure.float())
    q_tilde[..., 0] = 1.0  # the anchor is given, not predicted
    reach = torch.cumprod(q_tilde, dim=-1) * valid  # [B, N, Bs]: prod_{i<=m}, scored m only
    return reach.flip(-1).cumsum(-1).flip(-1)  # suffix sums over m >= j


def kl_at_temperature(logits: Tensor, target_logits: Tensor, temperature: float) -> Tensor:
    """Per-position KL(target || drafter) at temperature, scaled by T^2: fp32 logits
    [..., V] -> [...]."""
    log_p_target = F.log_softmax(target_logits / temperature, dim=-1)
    log_p_drafter = F.log_softmax(logits / temperature, dim=-1)
    kl = (log_p_target.exp() * (log_p_target - log_p_drafter)).sum(-1)
    return kl * temperature**2


def position_loss(
    logits: Tensor,
    labels: Tensor,
    valid: Tensor,
    cfg: LossConfig,
    gamma: float | None,
    target_logits: Tensor | None = None,
    given: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The loss of each block position: fp32 logits[..., Bs, V], labels/valid[..., Bs]
    -> (weights, per-position loss, CE), each [..., Bs]; the loss is
    sum(weights * per-position loss) / `denominator(weights, valid, cfg)`.

    `gamma` (None: D-PACE weights replace the decay) is LossConfig.decay_gamma of the
    block size; `target_logits` (fp32, aligned with the labels) mixes the KL in; `given`
    [..., Bs] marks the positions whose token the drafter sees (see `streak_weights`).
    """
    bs, v = logits.shape[-2:]
    ce = F.cross_entropy(logits.reshape(-1, v), labels.reshape(-1), reduction="none")
    ce = ce.view(labels.shape)  # [..., Bs]
    weights = valid.float()
    if gamma is not None:
        weights = weights * decay_weights(bs, gamma, logits.device)
    alpha = cfg.confidence_alpha
    if alpha is not None:
        weights = weights * streak_weights(ce, valid, alpha, given)
    per_pos = ce
    if target_logits is not None:
        kl = kl_at_temperature(logits, target_logits, cfg.kl_temperature)
        per_pos = cfg.kl_weight * kl + (1 - cfg.kl_weight) * ce
    return weights, per_pos, ce


def denominator(weights: Tensor, valid: Tensor, cfg: LossConfig) -> Tensor:
    """What the weighted sum is divided by (detached scalar): under D-PACE the number of
    scored blocks, as its authors do (the weights' mass is the expected accepted length:
    dividing by it would cancel the signal); else the weights' sum, a weighted mean."""
    if cfg.per_block_normalization:
        return valid.any(-1).sum().float()
    return weights.sum().detach()


@dataclass
class ChunkedLossOutput:
    """loss = weighted_sum / denominator; metrics are device tensors (no host sync).

    correct, run and ce_sum are what `block_metrics` is made of, so the metrics of
    several micro-batches can be combined exactly.
    """

    loss: Tensor  # scalar, differentiable
    weighted_sum: Tensor  # scalar sum(w * l), differentiable: gradient accumulation sums these
    denominator: Tensor  # scalar, detached: sum(w), or the scored blocks under D-PACE
    weight_sum: Tensor  # scalar sum(w), detached
    metrics: dict[str, Tensor]
    correct: Tensor  # [B, N, Bs] bool, detached
    run: Tensor  # [B, N] consecutive correct predictions from k=1
    ce_sum: Tensor  # scalar sum(ce * valid), detached


def gather_target_hidden(final_hidden: Tensor, anchors: Tensor, block_size: int) -> Tensor:
    """Target final-norm states [B, T, D] -> [B, N, Bs, D] aligned with block labels.

    Same alignment as the target logits: block position k takes position anchor+k-1.
    """
    return gather_target_logits(final_hidden, anchors, block_size)


def _chunk_terms(
    hidden: Tensor,
    target_hidden: Tensor | None,
    labels: Tensor,
    valid: Tensor,
    head: nn.Linear,
    cfg: LossConfig,
    gamma: float | None,
    given: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """One chunk: hidden[C, Bs, D] -> (sum w*l, sum w, denominator, sum ce*valid,
    correct[C, Bs], run[C]).

    `valid` holds the positions the loss learns from (within a draft vocabulary, if
    any). Runs twice (forward, then recomputed in the backward): keep it deterministic.
    """
    logits = head(hidden.to(head.weight.dtype)).float()  # [C, Bs, V]
    target_logits = None
    if target_hidden is not None:
        with torch.no_grad():
            target_logits = head(target_hidden.to(head.weight.dtype)).float()  # [C, Bs, V]
    weights, per_pos, ce = position_loss(logits, labels, valid, cfg, gamma, target_logits, given)
    with torch.no_grad():
        correct = (logits.argmax(-1) == labels) & valid  # [C, Bs]
        run = torch.cumprod(correct[:, 1:].int(), dim=-1).sum(-1)  # [C]
        ce_sum = (ce * valid).sum()
        divide_by = denominator(weights, valid, cfg)
    return (weights * per_pos).sum(), weights.sum().detach(), divide_by, ce_sum, correct, run


def chunked_dflash_loss(
    hidden: Tensor,
    lm_head: nn.Linear,
    labels: Tensor,
    valid: Tensor,
    cfg: LossConfig,
    target_hidden: Tensor | None = None,
    chunk_size: int | None = None,
    in_vocab: Tensor | None = None,
    given: Tensor | None = None,
) -> ChunkedLossOutput:
    """Weighted loss sum(w * l) / denominator from the drafter's final-normed states.

    hidden[B, N, Bs, D] (`DFlashDrafter.hidden_states`), labels/valid[B, N, Bs];
    target_hidden[B, N, Bs, D] (`gather_target_hidden`) is required with soft labels.
    With a draft vocabulary, labels are draft ids (`DFlashDrafter.draft_labels`) and
    in_vocab[B, N, Bs] marks those the head can propose: the others are left out of the
    loss (as EAGLE-3 does) but still count, as misses, in the accuracy and τ figures.
    given[B, N, Bs] marks the block positions whose clean token the drafter sees (the
    anchor, and what a partial noise schedule leaves visible): D-PACE's streaks go on
    through them (None: the anchor only).
    chunk_size: blocks per chunk, over the flattened B*N blocks (None: cfg's
    --loss-chunk-size). When all blocks fit in one chunk nothing is recomputed: that
    chunk's logits are the bound anyway. Call it outside autocast: the LM head runs in
    its own dtype, the logits, softmax and KL in fp32 whatever the hidden dtype.
    """
    chunk_size = cfg.loss_chunk_size if chunk_size is None else chunk_size
    if chunk_size < 1:
        raise ObjectiveError(f"--loss-chunk-size {chunk_size} must be >= 1")
    if cfg.use_soft_labels and target_hidden is None:
        raise ObjectiveError("--use-soft-labels needs the target's final-norm hidden states")
    b, n, bs, d = hidden.shape
    gamma = cfg.decay_gamma(bs)
    learn = valid if in_vocab is None else valid & in_vocab
    flat_h, flat_labels, flat_valid = (
        hidden.reshape(b * n, bs, d),
        labels.reshape(-1, bs),
        learn.reshape(-1, bs),
    )
    flat_t = None
    if cfg.use_soft_labels:
        if target_hidden is None:
            raise ValueError("use_soft_labels needs the target's hidden states of the blocks")
        flat_t = target_hidden.reshape(b * n, bs, -1)
    flat_given = None if given is None else given.reshape(-1, bs)
    parts = []
    for i in range(0, b * n, chunk_size):
        sl = slice(i, i + chunk_size)
        t_chunk = flat_t[sl] if flat_t is not None else None
        g_chunk = flat_given[sl] if flat_given is not None else None
        args = (flat_h[sl], t_chunk, flat_labels[sl], flat_valid[sl], lm_head, cfg, gamma, g_chunk)
        if torch.is_grad_enabled() and b * n > chunk_size:
            parts.append(checkpoint(_chunk_terms, *args, use_reentrant=False))
        else:
            parts.append(_chunk_terms(*args))
    weighted, weight_sum, divide_by, ce_sum = (
        torch.stack([p[i] for p in parts]).sum() for i in range(4)
    )
    correct = torch.cat([p[4] for p in parts]).view(b, n, bs)
    run = torch.cat([p[5] for p in parts]).view(b, n)
    loss = weighted / divide_by.clamp(min=1e-8)
    metrics = block_metrics(correct, run, valid, ce_sum, weight_sum)
    return ChunkedLossOutput(loss, weighted, divide_by, weight_sum, metrics, correct, run, ce_sum)


def block_metrics(
    correct: Tensor, run: Tensor, valid: Tensor, ce_sum: Tensor, weight_sum: Tensor
) -> dict[str, Tensor]:
    """Device tensors as dflash_loss gives them: ce, accuracy, accuracy_per_position[Bs-1]
    (k = 1 .. Bs-1), tau_proxy, weight_sum.

    correct/valid[B, N, Bs]; run[B, N] consecutive correct predictions from k=1.
    """
    count_k = valid.sum((0, 1))  # [Bs]
    count = count_k.sum().clamp(min=1)
    metrics = {"ce": ce_sum / count, "accuracy": correct.sum() / count}
    acc_k = correct.sum((0, 1)) / count_k.clamp(min=1)  # [Bs]
    metrics["accuracy_per_position"] = acc_k[1:]
    scored = valid[..., 1]  # blocks whose first prediction counts
    num_scored = scored.sum()
    tau = ((run + 1) * scored).sum() / num_scored.clamp(min=1)
    metrics["tau_proxy"] = torch.where(num_scored > 0, tau, torch.ones_like(tau))
    metrics["weight_sum"] = weight_sum
    return metrics
