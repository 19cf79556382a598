"""What a run's sizes are checked against before any model loads: the target's stated
positions (--seq-len), the drafter device's memory (the step's estimate from
dflash.run.estimate), the draft vocabulary, the target layers and --shard-drafter's
ranks. A target known only through the hub is checked once it loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dflash.config.devices import decide_placement
from dflash.config.settings import TrainConfig
from dflash.drafter.vocab import check_draft_vocab_size
from dflash.errors import first_line
from dflash.pipeline.distributed import dist_info_from_env
from dflash.run import estimate  # by module: tests swap estimate.device_memory_bytes
from dflash.run.estimate import GIB, EstimateError, estimate_step, shape_for_config
from dflash.target.geometry import TargetError, TargetGeometry, geometry_from_hf_config
from dflash.target.model import choose_target_layers
from dflash.target.synthetic import KNOWN_SHAPES
from dflash.target.tiny import TinyLMConfig


def local_limits(spec: str) -> tuple[TargetGeometry, int | None] | None:
    """(geometry, stated position limit) of a target known without weights or network:
    builtin:tiny, a local directory's config.json, a published shape; else None."""
    if spec.startswith("builtin:"):
        return TinyLMConfig().geometry(), None  # plain rope: no stated limit
    path = Path(spec).expanduser() / "config.json"
    if path.is_file():
        try:
            raw = json.loads(path.read_text())
            text = raw.get("text_config") or raw
            limit = text.get("max_position_embeddings")
            return geometry_from_hf_config(raw), limit if isinstance(limit, int) else None
        except TargetError as err:  # a GPT-2: refused now, not once its weights loaded
            raise TargetError(f"target {spec}: {first_line(err).removeprefix('target ')}") from None
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None  # the target's own loading names what is wrong with it
    if spec in KNOWN_SHAPES:
        return KNOWN_SHAPES[spec], KNOWN_SHAPES[spec].max_position_embeddings
    return None


def _size(num_bytes: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:,.1f} {unit}"
    return f"{num_bytes:.0f} B"


def check_seq_len(cfg: TrainConfig, positions: int | None) -> None:
    """A row longer than the target's stated positions would fail deep inside its forward."""
    if positions is not None and cfg.data.seq_len > positions:
        raise EstimateError(
            f"--seq-len {cfg.data.seq_len} is invalid: target {cfg.target.spec} has "
            f"max_position_embeddings {positions}"
        )


def check_sizes_before_work(
    cfg: TrainConfig, device: torch.device | str, device_bytes: float | None = None
) -> None:
    """Before any model loads: --seq-len within the target's positions, the step's
    estimated peak memory within the drafter device's (or the host's) memory unless
    --allow-over-memory, then the target layers. A target known only through the hub is
    checked once loaded."""
    check_sharding(cfg)
    known = local_limits(cfg.target.spec)
    if known is None:
        return
    geometry, positions = known
    check_seq_len(cfg, positions)
    size = cfg.drafter.draft_vocab_size
    if size is not None and size > geometry.vocab_size:
        check_draft_vocab_size(size, geometry.vocab_size, ())
    check_memory(cfg, geometry, device, device_bytes)
    if cfg.target.layer_ids is not None or cfg.data.hidden_cache is None:
        # Unset with a cache: per-sample files may name the layers themselves (online and
        # streamed runs choose them here).
        choose_target_layers(cfg.target.layer_ids, geometry.num_layers, cfg.drafter.num_layers)


def check_sharding(cfg: TrainConfig) -> None:
    """--shard-drafter needs 2+ torchrun ranks and one drafter device per rank (FSDP2
    shards one module per process; this run's replicas in threads would each need one)."""
    if not cfg.pipeline.shard_drafter:
        return
    info = dist_info_from_env()
    if info.world_size < 2:
        raise EstimateError(
            f"--shard-drafter is invalid on {info.world_size} rank (WORLD_SIZE "
            f"{info.world_size}): it shards the drafter across torchrun's ranks; start 2+ "
            "with torchrun --nproc-per-node N, or drop it"
        )
    drafters = decide_placement(cfg.pipeline, info.local_rank, info.local_world_size).drafters
    if len(drafters) > 1:
        names = ",".join(str(d) for d in drafters)
        raise EstimateError(
            f"--shard-drafter trains one drafter per rank, --drafter-devices gives this rank "
            f"{len(drafters)} ({names}): name one, or start one rank per device"
        )


def check_memory(
    cfg: TrainConfig,
    geometry: TargetGeometry,
    device: torch.device | str,
    device_bytes: float | None,
) -> None:
    """The step's estimated peak memory within the device's, unless --allow-over-memory."""
    device = torch.device(device)
    limit = device_bytes if device_bytes is not None else estimate.device_memory_bytes(device)
    step = estimate_step(shape_for_config(cfg, geometry, device.type))
    if limit is None or cfg.run.allow_over_memory or step.total_bytes <= limit:
        return
    raise EstimateError(
        f"this config needs about {_size(step.total_bytes)} on {device}, more "
        f"than its {_size(limit)}: lower --batch-size (raise --grad-accum), --seq-len, "
        "--num-anchors or --drafter-layers, set --activation-checkpointing, or pass "
        "--allow-over-memory if the estimate is wrong for this machine"
    )
