"""Memory and FLOPs of one optimizer step, estimated from the shapes alone (`--dry-run`).

Coarse by design: weights, gradients and AdamW state are exact counts; activations
use per-token element counts of the layers as written here (a few D- and I-sized
tensors kept per token and layer), so treat the figures as ±30%. The point is to say
before the first step that a config cannot fit, and which term makes it so.

`estimate_for_config` applies it to a run's config: at the start of every run (a
warning when it exceeds the device's memory) and for `--dry-run`, which reads the
target's geometry without loading its weights (`geometry_for_spec`).

Shapes: rows per micro-batch R (the target runs R * grad_accum rows at once),
sequence T, anchors N, block Bs, Q = R*N*Bs block tokens, D hidden, I FFN width,
V vocabulary, H/Hkv heads, Hd head dim.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash.config.devices import DeviceError, decide_placement
from dflash.config.settings import LossConfig, TrainConfig
from dflash.errors import DFlashError
from dflash.pipeline.distributed import dist_info_from_env
from dflash.target.geometry import TargetGeometry, geometry_from_hf_config
from dflash.target.hf import hub_unreachable
from dflash.target.synthetic import KNOWN_SHAPES
from dflash.target.tiny import TinyLMConfig

GIB = 1024**3
# fp32 intermediates per logit over a loss chunk: logits, log-softmax and its grad (CE);
# soft labels add the target's logits, both temperature softmaxes and the KL's grad.
_LOSS_COPIES = {False: 3, True: 7}
# The StepShape sizes that must be at least 1.
_COUNTS = ("drafter_layers", "block_size", "num_anchors", "seq_len", "batch_size", "grad_accum")


class EstimateError(DFlashError):
    """A shape that cannot be estimated (non-positive sizes); the message names it."""


@dataclass(frozen=True)
class StepShape:
    target: TargetGeometry
    drafter_layers: int
    block_size: int
    num_anchors: int
    seq_len: int
    batch_size: int  # rows per micro-batch
    grad_accum: int = 1
    loss_chunk_size: int | None = LossConfig.loss_chunk_size  # blocks per chunk; None: dense
    soft_labels: bool = False
    activation_checkpointing: bool = False
    attention: str = "flex"  # flex | grouped | dense
    target_bytes: int = 2  # bf16 target
    activation_bytes: int = 2  # bf16 autocast
    num_target_features: int | None = None  # K; None: drafter_layers
    document_masks: bool = False  # --packing docs: the target attends through a [T, T] mask
    draft_vocab_size: int | None = None  # rows of the drafter's head; None: the whole vocabulary
    from_cache: bool = False  # a cache or a vLLM engine: the target never runs on the device
    shard_over: int = 1  # ranks whose FSDP2 shards hold the drafter's weights, grads and AdamW

    def __post_init__(self) -> None:
        for name in _COUNTS:
            if getattr(self, name) < 1:
                raise EstimateError(f"{name} {getattr(self, name)} must be >= 1")
        if self.loss_chunk_size is not None and self.loss_chunk_size < 1:
            raise EstimateError(f"--loss-chunk-size {self.loss_chunk_size} must be >= 1")
        if self.shard_over < 1:
            raise EstimateError(f"shard_over {self.shard_over} must be >= 1")
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

    @property
    def head_vocab(self) -> int:
        return min(self.draft_vocab_size or self.target.vocab_size, self.target.vocab_size)

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
        unit, scale = ("GiB", GIB) if self.total_bytes >= GIB else ("MiB", 2**20)
        big = self.total_flops >= 1e12
        f_unit, f_scale = ("TFLOP", 1e12) if big else ("GFLOP", 1e9)
        parts = ", ".join(f"{k} {v / scale:.1f}" for k, v in self.memory_bytes.items())
        flops = ", ".join(f"{k} {v / f_scale:.1f}" for k, v in self.flops.items())
        return (
            f"estimated peak memory {self.total_bytes / scale:.1f} {unit} ({parts}); "
            f"{self.total_flops / f_scale:.1f} {f_unit} per optimizer step ({flops})"
        )

    def warning(self, device_bytes: float) -> str | None:
        """One line when the estimate exceeds a device's memory, else None."""
        if self.total_bytes <= device_bytes:
            return None
        return (
            f"warning: this config needs about {self.total_bytes / GIB:.1f} GiB per device, "
            f"more than its {device_bytes / GIB:.1f} GiB (lower --batch-size and raise "
            f"--grad-accum, lower --loss-chunk-size or --num-anchors, or set "
            f"--activation-checkpointing): {self.format()}"
        )


def _memory(s: StepShape) -> dict[str, float]:
    g, d, i = s.target, s.target.hidden_size, s.target.intermediate_size
    rows_t = s.batch_size * s.seq_len
    rows_all = rows_t * s.grad_accum  # the target runs all micro-batches' rows at once
    q, v = s.block_tokens, s.head_vocab
    queue = rows_all * (s.k * d + (d if s.soft_labels else 0)) * s.target_bytes
    if s.soft_labels and s.loss_chunk_size is None:
        queue += rows_all * g.vocab_size * s.target_bytes  # dense soft labels ship logits
    target_act: float = rows_all * (4 * d + 2 * i) * s.target_bytes
    if s.document_masks:  # one layer's [T, T] mask, and its fp32 scores off the GPU kernels
        per_row = s.seq_len * s.seq_len
        target_act += (
            rows_all / s.seq_len * per_row * (1 + (4 * g.num_heads if s.attention != "flex" else 0))
        )
    per_layer: float = q * (10 * d + 4 * i) + rows_t * 2 * g.num_kv_heads * g.head_dim
    if s.attention != "flex":  # scores and probabilities kept in fp32
        per_layer += q * g.num_heads * s.keys_per_query() * 4 / s.activation_bytes
    layers = s.drafter_layers
    if s.activation_checkpointing:
        kept = layers * q * d + per_layer  # layer inputs + one layer being recomputed
    else:
        kept = layers * per_layer
    loss_rows = q if s.loss_chunk_size is None else min(s.loss_chunk_size, s.blocks) * s.block_size
    if s.from_cache:  # the device holds the drafter's copies of the embedding and head only
        target_weights, target_act = 2.0 * g.vocab_size * d * s.target_bytes, 0.0
    else:
        target_weights = g.params() * s.target_bytes
    drafter_state = {"drafter weights+grads+AdamW": s.drafter_params() * 16.0}
    if s.shard_over > 1:  # fp32 shards; a whole fp32 copy (evaluated, saved); 2 layers gathered
        drafter_state = {
            "drafter shards (weights+grads+AdamW)": s.drafter_params() * 16.0 / s.shard_over,
            "drafter whole copy+gathered layers": (s.drafter_params() + 2 * g.layer_params()) * 4.0,
        }
    return {
        "target weights": target_weights,
        **drafter_state,
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
    head = 2 * d * s.head_vocab * q
    passes = 2 if s.loss_chunk_size is None else 3  # the chunked loss recomputes its forward
    loss = head * passes + (head * (passes - 1) if s.soft_labels else 0)
    accum = s.grad_accum
    if s.from_cache:
        target = 0  # read from disk
    return {"target": target * accum, "drafter": drafter * accum, "lm head": loss * accum}


def estimate_step(shape: StepShape) -> StepEstimate:
    """Peak memory on one device serving target and drafter, and FLOPs per optimizer step."""
    return StepEstimate(_memory(shape), _flops(shape))


def tokens_per_step(shape: StepShape) -> int:
    return shape.batch_size * shape.seq_len * shape.grad_accum


# ------------------------------------------------------------- a run's config


def target_runs(cfg: TrainConfig) -> bool:
    """Whether the target's decoder runs in this process while training, said by the
    config alone (for the estimates of a dry run, before any cache need exist): every
    source read from --hidden-cache or streamed from a vLLM engine answers False, as
    `dflash.run.features.feature_plan(cfg).runs_target` would."""
    return cfg.data.hidden_cache is None and cfg.target.engine != "vllm"


def geometry_for_spec(spec: str) -> tuple[TargetGeometry, str]:
    """A target's geometry without its weights -> (geometry, where it came from).

    builtin:tiny from its config; a local directory from its config.json; a hub id
    from the shapes dflash.target.synthetic knows (Qwen/Qwen3-8B), else from its
    config.json through transformers (downloaded where the machine has internet).
    """
    if spec.startswith("builtin:"):
        return TinyLMConfig().geometry(), f"{spec} config"
    path = Path(spec).expanduser()
    unreachable: str | None = None
    try:
        if (path / "config.json").is_file():
            raw = json.loads((path / "config.json").read_text())
            return geometry_from_hf_config(raw), str(path / "config.json")
        if spec in KNOWN_SHAPES:
            return KNOWN_SHAPES[spec], f"the published shape of {spec}"
        from transformers import AutoConfig  # deferred: an optional dependency

        unreachable = hub_unreachable()
        config = AutoConfig.from_pretrained(spec, local_files_only=unreachable is not None)
        return geometry_from_hf_config(config), spec
    except (OSError, ValueError, KeyError, ImportError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if isinstance(err, OSError) and unreachable is not None:
            reason = f"not in the Hugging Face cache, and the hub cannot be reached: {unreachable}"
        raise EstimateError(
            f"--target {spec!r}: cannot read its config for the estimate ({reason}); "
            "give a local model directory"
        ) from None


def shape_for_config(cfg: TrainConfig, geometry: TargetGeometry, device_type: str) -> StepShape:
    """The StepShape of a run's config on a device type (bf16 on cuda, fp32 elsewhere)."""
    on_gpu = device_type == "cuda"
    width = 2 if on_gpu else 4
    layer_ids = cfg.target.layer_ids
    return StepShape(
        target=geometry,
        drafter_layers=cfg.drafter.num_layers,
        block_size=cfg.drafter.block_size,
        num_anchors=cfg.loss.num_anchors,
        seq_len=cfg.data.seq_len,
        batch_size=cfg.data.batch_size,
        grad_accum=cfg.optim.grad_accum,
        loss_chunk_size=cfg.loss.loss_chunk_size,
        soft_labels=cfg.loss.use_soft_labels,
        activation_checkpointing=cfg.optim.activation_checkpointing,
        attention="flex" if on_gpu else "grouped",
        target_bytes=width,
        activation_bytes=width,
        num_target_features=len(layer_ids) if layer_ids else None,
        document_masks=cfg.data.packing == "docs",
        draft_vocab_size=cfg.drafter.draft_vocab_size,
        from_cache=not target_runs(cfg),
    )


def device_memory_bytes(device: torch.device | str) -> float | None:
    """Total memory of a torch device (CUDA: the GPU's; CPU: physical RAM), if known."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(device).total_memory)
    if device.type == "cpu" and hasattr(os, "sysconf"):
        try:
            return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        except (ValueError, OSError):
            return None
    return None


def estimate_for_config(
    cfg: TrainConfig,
    geometry: TargetGeometry,
    device: torch.device | str,
    device_bytes: float | None = None,
) -> list[str]:
    """One line: the estimate of `cfg` on `device`, or the warning (with the estimate)
    when it exceeds the device's memory (`device_bytes`, default: `device_memory_bytes`)."""
    device = torch.device(device)
    estimate = estimate_step(shape_for_config(cfg, geometry, device.type))
    precision = "bf16 autocast" if device.type == "cuda" else "fp32"
    limit = device_bytes if device_bytes is not None else device_memory_bytes(device)
    warning = None if limit is None else estimate.warning(limit)
    return [warning or f"estimate on {device} ({precision}): {estimate.format()}"]


def dry_run_lines(cfg: TrainConfig) -> list[str]:
    """`--dry-run`: the estimate for the run's first drafter device, and for a CUDA
    device when this machine has none; no weights are loaded."""
    geometry, source = geometry_for_spec(cfg.target.spec)
    try:
        device: torch.device | str = decide_placement(cfg.pipeline).drafter
    except DeviceError:  # devices of another machine: estimate for their kind
        device = cfg.pipeline.drafter_devices[0]
    accum = cfg.optim.grad_accum
    target = f"target {cfg.target.spec} (geometry from {source})"
    step = f"{cfg.data.batch_size * accum} rows x {cfg.data.seq_len} tokens per optimizer step"
    lines = [f"dry run: {target}, {step} in {accum} micro-batch(es)"]
    lines += estimate_for_config(cfg, geometry, device)
    if str(device).startswith("cpu"):
        lines += estimate_for_config(cfg, geometry, "cuda", device_bytes=math.inf)
    world_size = dist_info_from_env().world_size
    if world_size > 1 or cfg.pipeline.shard_drafter:
        ranks = max(world_size, 2)  # --shard-drafter alone: the least it runs on
        lines += per_rank_lines(cfg, geometry, device, ranks)
        if str(device).startswith("cpu"):
            lines += per_rank_lines(cfg, geometry, "cuda", ranks)
    return lines


def per_rank_lines(
    cfg: TrainConfig, geometry: TargetGeometry, device: torch.device | str, ranks: int
) -> list[str]:
    """The peak memory per rank of `ranks` ranks, the drafter replicated on each (every
    rank holds its weights, gradients and AdamW state) and sharded (--shard-drafter)."""
    kind = torch.device(device).type
    replicated = estimate_step(shape_for_config(cfg, geometry, kind))
    sharded = estimate_step(
        dataclasses.replace(shape_for_config(cfg, geometry, kind), shard_over=ranks)
    )
    gib = f"{replicated.total_bytes / GIB:.1f} GiB"
    return [
        f"per rank of {ranks} on {kind}, drafter replicated: {gib}; sharded "
        f"(--shard-drafter): {sharded.total_bytes / GIB:.1f} GiB ({sharded.format()})"
    ]
