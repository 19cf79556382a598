"""The single-threaded reference loop: target.capture, then trainer.step, one batch a step.

The pipeline is tested against it (same seed, same loss curve); it shares the run's
start, build and end (dflash.run.start, dflash.run.build, dflash.run.finish) and the
step metrics (dflash.train.step_metrics) with the pipeline.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import IO, Any

import torch

from dflash.config.settings import TrainConfig
from dflash.log import Log, say
from dflash.pipeline.distributed import DistInfo
from dflash.run.build import build_run
from dflash.run.finish import RunStats, finish_run, save_checkpoint_or_fail
from dflash.run.folder import METRICS_FILE
from dflash.run.progress import Progress
from dflash.run.replicas import move_target_out, target_forwards
from dflash.run.start import Start, log_startup, start_run
from dflash.train.step_metrics import StepMetrics


def train_reference(
    cfg: TrainConfig, log: Log = say, progress_stream: IO[str] | None = None
) -> dict[str, Any]:
    """Trains `cfg` in this thread on the first target and drafter device; the summary."""
    started_s = time.perf_counter()
    start = start_run(cfg, DistInfo())  # one process: no rank, no group
    try:
        return _train(cfg, start, log, progress_stream, started_s)
    finally:
        start.end()


def _train(
    cfg: TrainConfig,
    start: Start,
    log: Log,
    progress_stream: IO[str] | None,
    started_s: float,
) -> dict[str, Any]:
    placement = start.placement
    run = build_run(cfg, placement, log)
    log_startup(run, log, f"target {placement.target}, drafter {placement.drafter}")
    last_index = run.next_batch_index + cfg.run.steps - run.step - 1
    read = target_forwards(run, last_index, all_devices=False)[0][1]
    start.begin_training(cfg, log)  # every check has passed, the cache's among them
    progress = Progress(cfg.run.steps, run.step, stream=progress_stream, log=None)
    metrics_file = Path(cfg.run.output_dir) / METRICS_FILE
    metrics = StepMetrics(
        cfg.run.log_every, run.step, cfg.run.steps, metrics_file, cfg.run.eval_every
    )
    if run.resumed_from is not None:
        metrics.continue_file()
    losses: list[torch.Tensor] = []
    num_tokens, train_start_s = 0, time.perf_counter()
    try:
        while run.step < cfg.run.steps:
            batch = run.train_data.batch(run.next_batch_index)
            target_out = move_target_out(read(batch), placement.drafter)
            result = run.trainer.step(batch, target_out)
            run.step, run.next_batch_index = run.step + 1, run.next_batch_index + 1
            losses.append(result.loss)
            num_tokens += result.num_tokens
            figures = metrics.read(run.step, result) if metrics.due(run.step) else None
            train_s = time.perf_counter() - train_start_s
            if figures is not None and run.evals is not None:
                figures.update(run.evals.on_logged_step(run.step, train_s))
            if figures is not None:
                metrics.write(figures)
            progress.update(run.step, result.num_tokens, figures)
            if figures is not None:
                run.trainer.check_figures(figures)  # a diverged run stops before it saves
            if cfg.run.checkpoint_due(run.step):
                save_checkpoint_or_fail(run)
    finally:
        progress.close()
    stats = RunStats([float(x) for x in losses], num_tokens, time.perf_counter() - train_start_s)
    return finish_run(run, stats, log, started_s)
