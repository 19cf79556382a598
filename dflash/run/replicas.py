"""The model objects of each device: one target per target thread, one drafter replica
(with its trainer) per drafter thread, and the copy of target features between them.

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

from dflash.data.datasets import Batch
from dflash.drafter.model import DFlashDrafter
from dflash.offline.hidden_cache import open_hidden_cache
from dflash.offline.sample_reader import SampleCacheReader
from dflash.pipeline.distributed import sync_initial_weights
from dflash.run.lifecycle import Run
from dflash.target import load as target_load  # by module: tests swap load_target
from dflash.target.model import TargetModel, TargetOutput, frozen_parts
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


def capture_fn(
    target: TargetModel, layer_ids: list[int], with_final_hidden: bool, device: torch.device
) -> Callable[[Batch], TargetOutput]:
    """The target stage's forward: features, plus the final-norm states for soft labels
    (never logits: the drafter stage applies the frozen LM head per loss chunk)."""

    def forward(batch: Batch) -> TargetOutput:
        with torch.no_grad():
            ids = batch.input_ids.to(device, non_blocking=True)
            docs = None if batch.doc_ids is None else batch.doc_ids.to(device, non_blocking=True)
            return target.capture(
                ids, layer_ids, with_logits=False, with_final_hidden=with_final_hidden,
                doc_ids=docs,
            )  # fmt: skip

    return forward


def cache_reader(
    run: Run, last_batch_index: int | None
) -> tuple[torch.device, Callable[[Batch], TargetOutput]]:
    """The target stage of `--hidden-cache`: one thread reading the cached features,
    refused here (before any thread starts) for a cache of another run or too short."""
    soft = run.cfg.loss.use_soft_labels
    if run.samples is not None and run.samples.train_rows is not None:
        norm = run.target.final_norm() if soft else None
        samples = SampleCacheReader(run.samples, run.train_data, run.samples.train_rows, norm)
        run.cache_bytes_read = lambda: samples.bytes_read
        return torch.device("cpu"), samples.read
    reader = open_hidden_cache(run.cfg.data.hidden_cache or "", target=run.target,
                               dataset=run.train_data, layer_ids=run.layer_ids,
                               with_final_norm=soft)  # fmt: skip
    if last_batch_index is not None:
        reader.covers(last_batch_index)
        reader.verify(run.next_batch_index, last_batch_index)
    run.cache_bytes_read = lambda: reader.bytes_read
    # Soft labels come from the cached final-norm states, as online: never logits.
    return torch.device("cpu"), reader.read


def target_forwards(
    run: Run, last_batch_index: int | None = None
) -> list[tuple[torch.device, Callable[[Batch], TargetOutput]]]:
    """One target per thread: `capture` hooks the module, so threads cannot share one.
    With --hidden-cache, one reader thread instead (it reads up to `last_batch_index`)."""
    if run.cfg.data.hidden_cache is not None:
        return [cache_reader(run, last_batch_index)]
    soft = run.cfg.loss.use_soft_labels
    first = run.placement.target
    forwards = [(first, capture_fn(run.target, run.layer_ids, soft, first))]
    dtype = next(run.target.parameters()).dtype
    for device in run.placement.targets[1:]:
        target = target_load.load_target(run.cfg.target.spec, device, dtype, log=lambda _: None)
        forwards.append((device, capture_fn(target, run.layer_ids, soft, device)))
    return forwards


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
