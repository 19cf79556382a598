"""A built run wired into the pipeline's stages (docs/design.md §3): `wire_run`.

The run is built (dflash.run.build), its drafter replicated on each drafter device
(dflash.run.replicas) with their gradients averaged across devices and ranks, and the
stages (dflash.pipeline.stages) given the target's forwards, each replica's
`trainer_step` and `StepBookkeeping.after_step` (dflash.run.bookkeeping). The
start-up lines wait until every check has passed; then the run's files may be written.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO

import torch

import tracing
from dflash import names
from dflash.config.devices import Placement
from dflash.config.settings import TrainConfig
from dflash.log import Log
from dflash.observe.observer import Observer
from dflash.observe.trackers import Reporting
from dflash.pipeline.distributed import GradAverager, check_same_across_ranks, rank_batch_indices
from dflash.pipeline.queues import StageGroup
from dflash.pipeline.stages import Pipeline
from dflash.run.bookkeeping import StepBookkeeping, step_metrics, trainer_step
from dflash.run.build import Run, build_run
from dflash.run.progress import BufferedLog, Progress
from dflash.run.replicas import build_replicas, move_features_to, target_forwards
from dflash.run.start import RankSetup, log_startup
from dflash.train.step_metrics import StageRates


@dataclass
class WiredRun:
    """A run and the pipeline that trains it, with what records its steps."""

    run: Run
    pipe: Pipeline
    book: StepBookkeeping
    progress: Progress
    placement: Placement
    train_cpu_s: float = 0.0  # CPU seconds of the process while training, once trained


def wire_run(
    cfg: TrainConfig,
    log: Log,
    start: RankSetup,
    observer: Observer | None,
    progress_stream: IO[str] | None,
    reporting: Reporting | None = None,
) -> WiredRun:
    """The run built on `start`'s placement and wired into the stages, ready to train;
    its start-up lines said and config.json written (rank 0)."""
    info, placement = start.info, start.placement
    quiet = log if info.is_main else (lambda _: None)
    held = BufferedLog(quiet)  # what start-up says, once every check below has passed
    run = build_run(cfg, placement, held)
    num_drafters = len(placement.drafters)
    check_same_across_ranks(num_drafters, "the number of drafter devices", placement.drafter)
    check_same_across_ranks(run.step, "the step to resume from", placement.drafter)
    group = StageGroup()
    with tracing.phase(names.DRAFTER_BUILD):
        replicas = build_replicas(run)
    hook = observer.ranks if observer is not None else None
    averager = GradAverager([r.drafter for r in replicas], group.stop, hook)
    for i, replica in enumerate(replicas):
        replica.trainer.grad_sync = averager.hook(i) if averager.needed else None
    ranks = f" x {info.world_size} ranks" if info.enabled else ""
    telemetry_line = observer.describe() if observer is not None else None
    stream = progress_stream if info.is_main else io.StringIO()
    progress = Progress(cfg.run.steps, run.step, log=None, stream=stream)
    metrics = step_metrics(run)
    book = StepBookkeeping(
        run,
        progress,
        metrics,
        info=info,
        num_replicas=len(replicas),
        averager=averager,
        observer=observer,
    )
    window = observer.profile if observer is not None else None
    indices = rank_batch_indices(
        cfg.run.steps - run.step, info.rank, info.world_size, len(replicas), run.next_batch_index
    )
    forwards = target_forwards(run, indices[-1] if indices else 0)
    steps = []
    for i, r in enumerate(replicas):  # replica 0 reads the figures and profiles its steps
        first = i == 0
        step = trainer_step(r.trainer, metrics if first else None, window if first else None)
        steps.append((r.device, step, move_features_to(r.device)))
    pipe = Pipeline.build(
        make_batch=run.train_data.batch,
        indices=indices,
        forwards=forwards,
        target_phase=run.features.target_phase,
        steps=steps,
        on_step=book.after_step,
        batch_queue_size=cfg.pipeline.batch_queue_size,
        hs_queue_size=cfg.pipeline.hs_queue_size,
        span_attributes={names.RANK: info.rank},
        pin_memory=torch.cuda.is_available() and any(d.type == "cuda" for d in placement.targets),
        group=group,
        first_step=run.step,
        averaged=averager.needed,
    )
    book.rates = StageRates(_stage_tokens(pipe, info.world_size))
    # Every check has passed (the hidden-state cache's among them): the run's lines and
    # files now.
    held.release()
    log_startup(run, quiet, placement.describe() + ranks, telemetry_line)
    start.begin_training(cfg, quiet)
    if reporting and info.is_main:  # the trackers start once the run's files may be written
        book.reporting = reporting
        reporting.begin(cfg.to_dict(), run.output_dir, run.step, progress.write)
    if observer is not None:
        observer.folder_written = True  # stats.json and the timeline may go there now
    if info.is_main and run.resumed_from is not None:
        metrics.continue_file()
    return WiredRun(run, pipe, book, progress, placement)


def _stage_tokens(pipe: Pipeline, world_size: int) -> Callable[[], tuple[float, dict[str, int]]]:
    def read() -> tuple[float, dict[str, int]]:
        snap = pipe.snapshot()
        tokens = {
            "target": snap.target_tokens * world_size,
            "drafter": snap.drafter_tokens * world_size,
        }
        return snap.elapsed_s, tokens

    return read


def share_cpu_cores(placement: Placement, local_world_size: int) -> None:
    """Splits the cores among the stage threads that compute on the CPU.

    torch gives every thread's ops all cores by default; with a target and a drafter
    thread (and maybe several ranks) on one CPU they would oversubscribe it (measured:
    ~25% fewer tokens/s on 2 cores). OMP_NUM_THREADS, when set, is the user's choice.
    """
    if "OMP_NUM_THREADS" in os.environ:
        return
    devices = (*placement.targets, *placement.drafters)
    cpu_threads = sum(d.type == "cpu" for d in devices) * max(1, local_world_size)
    if cpu_threads:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cpu_threads))
