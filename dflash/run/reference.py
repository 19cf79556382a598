"""The single-threaded reference loop: target.capture, then trainer.step, one batch a step.

The pipeline is tested against it (same seed, same loss curve); it shares the run's
start, build and end (dflash.run.start, dflash.run.build, dflash.run.finish) and what
each step leaves behind (dflash.run.bookkeeping) with the pipeline.
"""

from __future__ import annotations

import time
from typing import IO

from dflash.config.settings import TrainConfig
from dflash.log import Log, say
from dflash.pipeline.distributed import DistInfo
from dflash.run.bookkeeping import StepBookkeeping, step_metrics, trainer_step
from dflash.run.build import build_run
from dflash.run.finish import finish_run
from dflash.run.progress import Progress
from dflash.run.replicas import move_target_out, target_forwards
from dflash.run.start import RankSetup, log_startup, start_run
from dflash.summary import JSON
from dflash.train.step import null_phase


def train_reference(
    cfg: TrainConfig, log: Log = say, progress_stream: IO[str] | None = None
) -> JSON:
    """Trains `cfg` in this thread on the first target and drafter device; the summary."""
    started_s = time.perf_counter()
    start = start_run(cfg, DistInfo())  # one process: no rank, no group
    try:
        return _train(cfg, start, log, progress_stream, started_s)
    finally:
        start.end()


def _train(
    cfg: TrainConfig,
    start: RankSetup,
    log: Log,
    progress_stream: IO[str] | None,
    started_s: float,
) -> JSON:
    placement = start.placement
    run = build_run(cfg, placement, log)
    log_startup(run, log, f"target {placement.target}, drafter {placement.drafter}")
    last_index = run.next_batch_index + cfg.run.steps - run.step - 1
    read = target_forwards(run, last_index, all_devices=False)[0][1]
    start.begin_training(cfg, log)  # every check has passed, the cache's among them
    progress = Progress(cfg.run.steps, run.step, stream=progress_stream, log=None)
    metrics = step_metrics(run)
    if run.resumed_from is not None:
        metrics.continue_file()
    book = StepBookkeeping(run, progress, metrics)
    step = trainer_step(run.trainer, metrics)
    train_start_s = time.perf_counter()
    try:
        for i in range(cfg.run.steps - run.step):
            batch = run.train_data.batch(run.next_batch_index)
            target_out = move_target_out(read(batch), placement.drafter)
            book.after_step(0, i, batch, step(batch, target_out, null_phase))
    finally:
        progress.close()
    return finish_run(run, book.stats(time.perf_counter() - train_start_s), log, started_s)
