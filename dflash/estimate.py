"""Memory and FLOPs of one optimizer step, estimated from the shapes alone (`--dry-run`).

Coarse by design: weights, gradients and AdamW state are exact counts; activations
use per-token element counts of the layers as written here (a few D- and I-sized
tensors kept per token and layer), so treat the figures as ±30%. The point is to say
before the first step that a config cannot fit, and which term makes it so.

Shapes: rows per micro-batch R, sequence T, anchors N, block Bs, Q = R*N*Bs block
tokens, D hidden, I FFN width, V vocabulary, H/Hkv heads, Hd head dim.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dflash.errors import DFlashError

GIB = 1024**3
# fp32 intermediates per logit over a loss chunk: logits, log-softmax and its grad (CE);
# soft labels add the target's logits, both temperature softmaxes and the KL's grad.
_LOSS_COPIES = {False: 3, True: 7}


class EstimateError(DFlashError):
    """A shape that cannot be estimated (non-positive sizes); the message names it."""


@dataclass(frozen=True)
class Geometry:
    """Decoder geometry shared by the target and (by default) its drafter."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    def layer_params(self) -> int:
        d, hd = self.hidden_size, self.head_dim
        attn = d * hd * (2 * self.num_heads + 2 * self.num_kv_heads)
        return attn + 3 * d * self.intermediate_size + 2 * d + 2 * hd

    def params(self) -> int:
        return self.num_layers * self.layer_params() + 2 * self.vocab_size * self.hidden_size


@dataclass(frozen=True)
class StepShape:
    target: Geometry
    drafter_layers: int
    block_size: int
    num_anchors: int
    seq_len: int
    batch_size: int  # rows per micro-batch
    grad_accum: int = 1
    loss_chunk_size: int | None = 32  # blocks per chunk; None: the dense loss
    soft_labels: bool = False
    activation_checkpointing: bool = False
    attention: str = "flex"  # flex | grouped | dense
    target_bytes: int = 2  # bf16 target
    activation_bytes: int = 2  # bf16 autocast
    num_target_features: int | None = None  # K; None: drafter_layers

    def __post_init__(self) -> None:
        for name in ("drafter_layers", "block_size", "num_anchors", "seq_len", "batch_size",
                     "grad_accum"):  # fmt: skip
            if getattr(self, name) < 1:
                raise EstimateError(f"{name} {getattr(self, name)} must be >= 1")
        if self.loss_chunk_size is not None and self.loss_chunk_size < 1:
            raise EstimateError(f"--loss-chunk-size {self.loss_chunk_size} must be >= 1")
        if self.attention not in ("flex", "grouped", "dense"):
            raise EstimateError(f"attention {self.attention!r}: choose flex, grouped or dense")

    @property
    def k(self) -> int:
        return self.num_target_features or self.drafter_layers

    @property
    def blocks(self) -> int:
        return self.batch_size * min(self.num_anchors, self.seq_len - 1)

    @property
    def block_tokens(self) -> int:
        return self.blocks * self.block_size

    def drafter_params(self) -> int:
        d = self.target.hidden_size
        return self.drafter_layers * self.target.layer_params() + self.k * d * d + 2 * d

    def keys_per_query(self) -> float:
        """Keys each block query's attention computes (dense computes the masked ones too)."""
        if self.attention == "dense":
            return self.seq_len + self.block_tokens / self.batch_size
        return self.seq_len / 2 + self.block_size


@dataclass
class StepEstimate:
    memory_bytes: dict[str, float] = field(default_factory=dict)
    flops: dict[str, float] = field(default_factory=dict)

    @property
    def total_bytes(self) -> float:
        return sum(self.memory_bytes.values())

    @property
    def total_flops(self) -> float:
        return sum(self.flops.values())

    def format(self) -> str:
        parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in self.memory_bytes.items())
        flops = ", ".join(f"{k} {v / 1e12:.1f}" for k, v in self.flops.items())
        return (
            f"estimated peak memory {self.total_bytes / GIB:.1f} GiB ({parts}); "
            f"{self.total_flops / 1e12:.1f} TFLOP per optimizer step ({flops})"
        )

    def warning(self, device_bytes: float) -> str | None:
        """One line when the estimate exceeds a device's memory, else None."""
        if self.total_bytes <= device_bytes:
            return None
        return (
            f"warning: this config needs about {self.total_bytes / GIB:.1f} GiB per device, "
            f"more than its {device_bytes / GIB:.1f} GiB: {self.format()}"
        )


def _memory(s: StepShape) -> dict[str, float]:
    g, d, i = s.target, s.target.hidden_size, s.target.intermediate_size
    rows_t = s.batch_size * s.seq_len
    q, v = s.block_tokens, g.vocab_size
    queue = rows_t * (s.k * d + (d if s.soft_labels else 0)) * s.target_bytes
    if s.soft_labels and s.loss_chunk_size is None:
        queue += rows_t * v * s.target_bytes  # dense soft labels ship logits
    target_act = rows_t * (4 * d + 2 * i) * s.target_bytes
    per_layer = q * (10 * d + 4 * i) + rows_t * 2 * g.num_kv_heads * g.head_dim
    if s.attention != "flex":  # scores and probabilities kept in fp32
        per_layer += q * g.num_heads * s.keys_per_query() * 4 / s.activation_bytes
    layers = s.drafter_layers
    if s.activation_checkpointing:
        kept = layers * q * d + per_layer  # layer inputs + one layer being recomputed
    else:
        kept = layers * per_layer
    loss_rows = q if s.loss_chunk_size is None else min(s.loss_chunk_size, s.blocks) * s.block_size
    return {
        "target weights": g.params() * s.target_bytes,
        "drafter weights+grads+AdamW": s.drafter_params() * 16.0,
        "target activations": target_act + queue,
        "drafter activations": kept * s.activation_bytes + rows_t * d * 4,
        "loss": loss_rows * v * 4.0 * _LOSS_COPIES[s.soft_labels],
    }


def _flops(s: StepShape) -> dict[str, float]:
    g, d = s.target, s.target.hidden_size
    rows_t, q = s.batch_size * s.seq_len, s.block_tokens
    attn_t = 2 * rows_t * s.seq_len * g.num_heads * g.head_dim  # causal: half of 4*T^2*H*Hd
    target = 2 * (g.params() - 2 * g.vocab_size * d) * rows_t + g.num_layers * attn_t
    fwd_bwd = 4 if s.activation_checkpointing else 3
    kv = 2 * d * 2 * g.num_kv_heads * g.head_dim * rows_t
    attn_d = 4 * q * g.num_heads * g.head_dim * s.keys_per_query()
    layers = s.drafter_layers * (2 * g.layer_params() * q + kv + attn_d)
    drafter = fwd_bwd * (layers + 2 * s.k * d * d * rows_t)
    head = 2 * d * g.vocab_size * q
    passes = 2 if s.loss_chunk_size is None else 3  # the chunked loss recomputes its forward
    loss = head * passes + (head * (passes - 1) if s.soft_labels else 0)
    accum = s.grad_accum
    return {"target": target * accum, "drafter": drafter * accum, "lm head": loss * accum}


def estimate_step(shape: StepShape) -> StepEstimate:
    """Peak memory on one device serving target and drafter, and FLOPs per optimizer step."""
    return StepEstimate(_memory(shape), _flops(shape))


def tokens_per_step(shape: StepShape) -> int:
    return shape.batch_size * shape.seq_len * shape.grad_accum


def seconds_at(shape: StepShape, flops_per_s: float) -> float:
    """Step time at a sustained rate (e.g. 0.4 * peak): a lower bound for planning."""
    return estimate_step(shape).total_flops / max(flops_per_s, math.ulp(1.0))


def shape_from_options(options: Mapping[str, Any], target: Geometry) -> StepShape:
    """A StepShape from train options by their config names (missing ones: defaults)."""
    chunk = options.get("loss_chunk_size", 32)
    return StepShape(
        target=target,
        drafter_layers=int(options.get("drafter_layers", 5)),
        block_size=int(options.get("block_size", 16)),
        num_anchors=int(options.get("num_anchors", 512)),
        seq_len=int(options.get("seq_len", 3072)),
        batch_size=int(options.get("batch_size", 1)),
        grad_accum=int(options.get("grad_accum", 1)),
        loss_chunk_size=None if chunk is None else int(chunk),
        soft_labels=bool(options.get("use_soft_labels", False)),
        activation_checkpointing=bool(options.get("activation_checkpointing", False)),
    )
