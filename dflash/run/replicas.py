"""The model objects of each device: the target stage's forwards
(dflash.run.target_features), one drafter replica (with its trainer) per drafter
thread, and the copy of target features between them.

Replica 0 and target 0 are the run's own objects; the others are built here on the
devices of the run's `Placement`.

With `--shard-drafter` the one replica of each rank is a copy of the run's drafter
sharded with FSDP2, with a trainer of its own. The run's drafter and trainer stay
whole: they are what rank 0 evaluates and saves (the same checkpoint and drafter/
files as a replicated run). `GatheredTrainer` refreshes them from the shards after the
optimizer steps that are read: logged steps (the evaluations), checkpoint steps and the
last one (the weights and the AdamW state).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from dflash.data.datasets import Batch
from dflash.pipeline.distributed import shard_module, sync_initial_weights
from dflash.run.build import Run, drafter_on
from dflash.run.checkpoint import (
    CheckpointError,
    full_optimizer_state,
    gather_full_state,
    load_full_optimizer_state,
)
from dflash.run.target_features import Forward
from dflash.target.model import TargetOutput, frozen_parts
from dflash.train.step import DrafterTrainer

if TYPE_CHECKING:
    from torch.optim.optimizer import StateDict


@dataclass
class Replica:
    device: torch.device
    drafter: nn.Module
    trainer: DrafterTrainer


def build_replicas(run: Run) -> list[Replica]:
    """Replica 0 is the run's own drafter and trainer; the others start as its copies.
    Sharded: the rank's one replica is a sharded copy (`sharded_replica`)."""
    if run.cfg.pipeline.shard_drafter:
        return [sharded_replica(run)]
    replicas = [Replica(run.placement.drafter, run.drafter, run.trainer)]
    for device in run.placement.drafters[1:]:
        drafter = drafter_on(run.drafter.config, frozen_parts(run.target, device), device)
        replicas.append(Replica(device, drafter, DrafterTrainer(drafter, run.cfg, device)))
    sync_initial_weights([r.drafter for r in replicas])
    for replica in replicas[1:]:  # same optimizer state, schedule and step (resume included)
        replica.trainer.load_state_dict(run.trainer.state_dict())
    return replicas


class GatheredTrainer(DrafterTrainer):
    """The run's whole drafter and its trainer state, as the sharded `source` trains.

    Its weights follow the shards after every step an evaluation or a save may read
    (`after_optimizer_step`, a collective every rank runs at the same step); its
    `state_dict` is the source's (schedule, step, guard) with the whole AdamW state,
    in the replicated trainer's form, and refuses a step whose state was not gathered
    (a save after a signal between checkpoints) rather than write stale moments.
    """

    def __init__(self, drafter: nn.Module, source: DrafterTrainer, main: bool) -> None:
        super().__init__(drafter, source.cfg, source.device)
        self.source, self.main = source, main
        self.guard = source.guard  # one non-finite count: the source's
        self.state_step = source.step_count  # the step the AdamW state was gathered after

    def _due(self, step: int) -> tuple[bool, bool]:
        """(the weights, the AdamW state) are read after `step`."""
        run = self.cfg.run
        state = run.checkpoint_due(step) or step >= run.steps
        return state or step % run.log_every == 0, state

    def after_optimizer_step(self, *_: object) -> None:
        """The source optimizer's post-step hook (step_count counts this step next)."""
        step = self.source.step_count + 1
        weights, state = self._due(step)
        if not weights:
            return
        model, optim = gather_full_state(
            self.source.drafter, self.source.optimizer if state else None
        )
        if self.main:
            self.drafter.load_state_dict(model)
            if optim is not None:
                load_full_optimizer_state(self.drafter, self.optimizer, optim)
        if state:
            self.state_step = step
        self.step_count = step

    def state_dict(self) -> StateDict:
        if self.state_step != self.source.step_count:
            raise CheckpointError(
                f"step {self.source.step_count}: the sharded drafter's state was last gathered "
                f"at step {self.state_step}; a checkpoint is written at --save-every steps "
                "and at the end"
            )
        state = self.source.state_dict()
        state["optimizer"] = self.optimizer.state_dict()
        return state


def sharded_replica(run: Run) -> Replica:
    """This rank's replica: a copy of the run's drafter, sharded with FSDP2 per decoder
    layer and at the root, and a trainer that starts from the run's trainer's state
    (a resumed one included); `run.trainer` becomes its `GatheredTrainer`."""
    device, whole = run.placement.drafter, run.drafter
    sync_initial_weights([whole])
    # The very modules the whole drafter shares with the target: never a second copy.
    drafter = drafter_on(whole.config, whole._shared, device)
    drafter.load_state_dict(whole.state_dict())
    drafter.attention_backend = whole.attention_backend
    # The trainer calls hidden_states (the LM head runs in the loss, outside the module).
    shard_module(drafter, list(drafter.layers), forward_methods=("hidden_states",))
    trainer = DrafterTrainer(drafter, run.cfg, device)
    state = run.trainer.state_dict()
    trainer.load_state_dict({**state, "optimizer": trainer.optimizer.state_dict()})
    if run.trainer.optimizer.state:  # a resumed run's moments (torch's calls make up
        # a step at lr 0 for an optimizer without any, counted in AdamW's bias correction)
        moments = full_optimizer_state(whole, run.trainer.optimizer)
        load_full_optimizer_state(drafter, trainer.optimizer, moments)
        run.trainer.optimizer.state.clear()  # its moments live in the shards now
    gathered = GatheredTrainer(
        whole, trainer, main=not dist.is_initialized() or dist.get_rank() == 0
    )
    trainer.optimizer.register_step_post_hook(gathered.after_optimizer_step)
    run.trainer = gathered
    return Replica(device, drafter, trainer)


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


def move_features_to(
    device: torch.device,
) -> Callable[[Batch, TargetOutput], tuple[Batch, TargetOutput]]:
    """The drafter loop's move: the batch stays on the host (the step moves it after
    drawing its anchors there), the features go to `device`."""
    return lambda batch, target_out: (batch, move_target_out(target_out, device))
