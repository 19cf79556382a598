"""The model objects of each device: the target stage's forwards (dflash.run.features),
one drafter replica (with its trainer) per drafter thread, and the copy of target
features between them.

Replica 0 and target 0 are the run's own objects; the others are built here on the
devices of the run's `Placement`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dflash.drafter.model import DFlashDrafter
from dflash.pipeline.distributed import sync_initial_weights
from dflash.run.build import Run
from dflash.run.features import Forward
from dflash.target.model import TargetOutput, frozen_parts
from dflash.train.step import DrafterTrainer


@dataclass
class Replica:
    device: torch.device
    drafter: nn.Module
    trainer: DrafterTrainer


def build_replicas(run: Run) -> list[Replica]:
    """Replica 0 is the run's own drafter and trainer; the others start as its copies."""
    replicas = [Replica(run.placement.drafter, run.drafter, run.trainer)]
    for device in run.placement.drafters[1:]:
        embed, head = frozen_parts(run.target, device)
        with torch.random.fork_rng(devices=[]):
            drafter = DFlashDrafter(run.drafter.config, embed, head).to(device)
        replicas.append(Replica(device, drafter, DrafterTrainer(drafter, run.cfg, device)))
    sync_initial_weights([r.drafter for r in replicas])
    for replica in replicas[1:]:  # same optimizer state, schedule and step (resume included)
        replica.trainer.load_state_dict(run.trainer.state_dict())
    return replicas


def target_forwards(
    run: Run, last_batch_index: int | None = None, all_devices: bool = True
) -> list[tuple[torch.device, Forward]]:
    """The target stage's (device, forward) per thread, from the run's feature source
    (it reads up to `last_batch_index` from a cache, refused before any thread starts)."""
    batches = (run.next_batch_index, last_batch_index)
    return run.features.forwards(
        run.target, run.layer_ids, run.train_data, run.placement, batches, all_devices
    )


def move_target_out(target_out: TargetOutput, device: torch.device) -> TargetOutput:
    """A TargetOutput's tensors (hidden, optional logits and final states) on `device`."""

    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device, non_blocking=True)

    return dataclasses.replace(
        target_out,
        hidden=target_out.hidden.to(device, non_blocking=True),
        logits=move(target_out.logits),
        final_hidden=move(target_out.final_hidden),
    )


def mover(device: torch.device) -> Callable[[Any, TargetOutput], tuple[Any, TargetOutput]]:
    """The drafter loop's move: the batch stays on the host (the step moves it after
    drawing its anchors there), the features go to `device`."""
    return lambda batch, target_out: (batch, move_target_out(target_out, device))
