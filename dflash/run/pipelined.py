"""Training with the producer-consumer pipeline (docs/design.md §3): `run_training`, the
command's entry point, and `run_pipeline`, the same run without telemetry.

The stage threads and queues live in dflash.pipeline; dflash.run.wiring builds the run
and plugs it into the stages, dflash.run.bookkeeping records each step (metrics,
progress, checkpoints) and dflash.run.outcome ends the run: a failed stage, a stop
signal (dflash.signals) or the finish.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import IO

import tracing
from dflash import names
from dflash.config.settings import TrainConfig
from dflash.errors import DFlashError
from dflash.log import Log, say
from dflash.observe.observer import Observer, shared_run_id, start_observer
from dflash.observe.trackers import Reporting, start_reporting
from dflash.pipeline.distributed import destroy_distributed
from dflash.pipeline.queues import PipelineError
from dflash.run.folder import earlier_run
from dflash.run.outcome import end_training, log_failure
from dflash.run.start import RankSetup, start_run
from dflash.run.wiring import share_cpu_cores, wire_run
from dflash.signals import Interrupted, SignalStop, TrainingInterrupted
from dflash.summary import JSON

__all__ = ["DEFAULT_STALL_TIMEOUT_S", "PipelineError", "TrainingInterrupted", "run_pipeline"]

# A stage that spends this long in one phase (not waiting on a queue) fails the run.
DEFAULT_STALL_TIMEOUT_S = 600.0


def run_training(cfg: TrainConfig, log: Log = say) -> JSON:
    """`dflash-train train`: tracing set up from cfg.telemetry, then `run_pipeline`.

    Under torchrun the process group starts first: every rank's telemetry carries
    rank 0's run id."""
    start = start_run(cfg)
    info = start.info
    try:
        output_dir = Path(cfg.run.output_dir)
        run_id = shared_run_id(info.world_size)
        reporting = start_reporting(cfg.telemetry.report_to, run_id, log, info.is_main)
        observer = start_observer(
            cfg.telemetry,
            info.rank,
            info.world_size,
            run_id=run_id,
            output_dir=output_dir,
            # The resource says where this rank ran: its devices, the config's hash.
            local_rank=info.local_rank,
            devices=start.placement.drafters,
            log=log,
            config=cfg.to_dict(),
            exporters=reporting.span_exporters(),
        )
    except BaseException:
        destroy_distributed()
        raise
    try:
        return run_pipeline(cfg, log=log, start=start, observer=observer, reporting=reporting)
    except Interrupted:
        # Stopped in the start-up, before the run's files: the cumulative table, and in a
        # folder that holds no earlier run the start-up's stats.json (and timeline); one
        # that does stays as it was.
        if info.is_main and not earlier_run(output_dir):
            observer.folder_written = True
        raise
    except DFlashError as exc:
        log_failure(exc)
        if not observer.folder_written:  # refused before training: one line
            observer.close(lambda _: None, table=False)
        raise
    except Exception as exc:  # a stage that failed (PipelineError), a diverged run, ...
        log_failure(exc)
        raise
    finally:
        observer.close(log)  # no-op after a normal finish
        reporting.close(log)  # the run's files to the trackers, bounded: after the summary
        start.end()  # the folder's lock: after the last file the run writes


def run_pipeline(
    cfg: TrainConfig,
    log: Log = say,
    *,
    start: RankSetup | None = None,
    observer: Observer | None = None,
    progress_stream: IO[str] | None = None,
    stall_timeout_s: float | None = DEFAULT_STALL_TIMEOUT_S,
    reporting: Reporting | None = None,
) -> JSON:
    """Train `cfg` with the pipeline; the summary dict.

    Under torchrun every rank calls this; rank 0 alone writes config.json,
    checkpoints, metrics.jsonl, the drafter and summary.json (other ranks return a
    short dict). `start` (dflash.run.start.start_run) is made here unless the
    caller made it; `observer` (dflash.observe) prints interval tables while it runs;
    `reporting` (dflash.observe.trackers, --report-to) gets each metrics.jsonl line.
    Raises PipelineError (one line; the traceback goes to OUTPUT_DIR/pipeline-error.log)
    when a stage fails, and TrainingInterrupted (a SystemExit, code 130 or 143) after
    a stop signal (dflash.signals), once the checkpoint and the summary are written.
    """
    started_s = time.perf_counter()
    own_start = start is None
    start = start_run(cfg) if start is None else start
    info, placement = start.info, start.placement
    share_cpu_cores(placement, info.local_world_size)
    stuck: list[str] = []
    try:
        with tracing.phase(names.RUN_STARTUP, level="step"):  # a trace of its own
            wired = wire_run(cfg, log, start, observer, progress_stream, reporting)
        if observer is not None:
            devices = (*placement.targets, *placement.drafters)
            stream = wired.progress.line_stream()
            features = wired.run.features
            observer.attach(
                wired.pipe.snapshot,
                devices,
                wired.book.flops,
                stream,
                features.bytes_counter(),
                features.skipped_counter(),
                features.spool_depth(),
            )
        train_start_s, cpu_start_s = time.perf_counter(), time.process_time()
        with SignalStop(wired.pipe.group.stop) as signals:
            try:
                stuck.extend(wired.pipe.run(stall_timeout_s))
            finally:
                wired.progress.close()
                if not stuck:  # a target thread still reading keeps its engine
                    wired.run.features.stop()  # a streaming engine ends with training
        train_s = time.perf_counter() - train_start_s
        # CPU seconds of the whole process (every thread) while training: the cost of
        # tracing shows here even where wall-clock throughput is too noisy to show it.
        wired.train_cpu_s = time.process_time() - cpu_start_s
        return end_training(wired, info, observer, log, train_s, started_s, signals.signum, stuck)
    finally:
        if not stuck:  # a thread stuck in a collective would hang the teardown
            destroy_distributed()
        if own_start:
            start.end()
