"""How a pipelined run ends: a stage that failed, a stop signal, or the finish.

A failed stage is one line (its traceback in OUTPUT_DIR/pipeline-error.log); a stop
signal saves a checkpoint where the run stands and writes the summary before
TrainingInterrupted; a finished run saves, evaluates and writes summary.json and
report.html (dflash.run.finish). Only rank 0 writes; every rank closes its telemetry.
"""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path

import tracing
from dflash.errors import first_line
from dflash.log import NOT_PRINTED, Log, get_logger
from dflash.observe.observer import Observer
from dflash.observe.report import ReportError, write_report
from dflash.pipeline.distributed import DistInfo
from dflash.pipeline.queues import StageFailure
from dflash.run.build import Run
from dflash.run.checkpoint import CheckpointError, SaveError
from dflash.run.finish import build_summary, complete_run, save_checkpoint_or_fail, write_summary
from dflash.run.wiring import WiredRun
from dflash.signals import Interrupted, TrainingInterrupted
from dflash.summary import JSON

logger = get_logger("run")


def log_failure(exc: BaseException) -> None:
    """The line the command ends with, as an ERROR record for telemetry (the command line
    prints it): while the logs still export, with the exception's type and stack trace
    (the phase it passed through has its own record, tied to that phase's span)."""
    if getattr(exc, "_dflash_logged", False):  # end_training logged it while logs exported
        return
    logger.error("Error: %s", first_line(exc), exc_info=exc, extra=NOT_PRINTED)
    with contextlib.suppress(AttributeError):  # an exception type with __slots__
        # (mypy ignore below) a mark on the exception, not a declared field
        exc._dflash_logged = True  # type: ignore[attr-defined]


def _pipeline_figures(wired: WiredRun, world_size: int) -> JSON:
    snap = wired.pipe.snapshot()
    return {
        "target_devices": [str(d) for d in wired.placement.targets],
        "drafter_devices": [str(d) for d in wired.placement.drafters],
        "world_size": world_size,
        "target_tokens_per_s": snap.target_tokens_per_s * world_size,
        "drafter_tokens_per_s": snap.drafter_tokens_per_s * world_size,
        "queue_depth_mean": {name: mean for name, (_, mean, _) in snap.queue_depths.items()},
        "train_cpu_s": wired.train_cpu_s,
    }


def end_training(
    wired: WiredRun,
    info: DistInfo,
    observer: Observer | None,
    log: Log,
    train_s: float,
    started_s: float,
    signum: int | None,
    stuck: list[str],
) -> JSON:
    """The end of `wired`'s training (`signum`: the stop signal that ended it; `stuck`:
    the threads still running): the summary, or the failed stage's PipelineError, or
    TrainingInterrupted once the checkpoint and the summary are written."""
    run, failure = wired.run, wired.pipe.group.failure
    figures = _pipeline_figures(wired, info.world_size)  # now: before evaluation
    close = (lambda: observer.close(log)) if observer is not None else (lambda: None)
    if failure is not None:
        log_path = _write_error_log(run.output_dir, info, failure)
        try:
            if isinstance(failure.error, SaveError):  # a full disk: its line, as at the final save
                raise failure.error
            raise failure.to_error().with_log(log_path or "") from failure.error
        except BaseException as error:
            # Its ERROR record, with the stack trace, while the logs still export; then
            # the final table, before the one-line error.
            log_failure(error)
            close()
            raise
    if stuck:
        log(f"warning: threads still running after the stop: {', '.join(stuck)}")
    stats = wired.book.stats(train_s)
    if signum is not None:
        name = signal.Signals(signum).name
        saved = _checkpoint_after_signal(run, info, name, stuck, log)
        extra = _summary_sections(figures, close())
        summary = build_summary(run, stats, started_s, interrupted=name, extra=extra)
        if saved:
            write_summary(run, summary, log)
        raise TrainingInterrupted(signum, summary if info.is_main else None)
    if observer is not None:
        observer.gather_final()  # every rank, before rank 0 spends minutes finishing
    if not info.is_main:
        close()
        return {"rank": info.rank, "steps": run.step, "pipeline": figures}
    try:
        links = wired.book.step_links()  # the final save and evaluation: of the last step
        evaluation = complete_run(run, lambda n: tracing.phase(n, level="step", links=links), log)
    except Interrupted as exc:  # during the final save or evaluation: record what is known
        stopped_in = exc.describe()
        extra = _summary_sections(figures, close())
        summary = build_summary(run, stats, started_s, interrupted=stopped_in, extra=extra)
        write_summary(run, summary, log)
        _write_report(run.output_dir, log)
        raise
    extra = _summary_sections(figures, close())
    summary = build_summary(run, stats, started_s, evaluation=evaluation, extra=extra)
    write_summary(run, summary, log)
    _write_report(run.output_dir, log)
    return summary


def _summary_sections(figures: JSON, telemetry: JSON | None) -> JSON:
    if telemetry is None:
        return {"pipeline": figures}
    telemetry = dict(telemetry)
    return {"pipeline": figures, "verdict": telemetry.pop("verdict", None), "telemetry": telemetry}


def _write_report(run_dir: Path, log: Log) -> None:
    """report.html beside summary.json; a report that cannot be made costs only itself."""
    try:
        log(f"report: {write_report(run_dir)}")
    except (ReportError, OSError) as exc:
        log(f"warning: report.html not written: {exc}")


def _write_error_log(run_dir: Path, info: DistInfo, failure: StageFailure) -> str | None:
    name = f"pipeline-error-rank{info.rank}.log" if info.enabled else "pipeline-error.log"
    path = run_dir / name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{failure.to_error()}\n\n{failure.traceback_text}")
    except OSError:
        return None
    return str(path)


def _checkpoint_after_signal(
    run: Run, info: DistInfo, name: str, stuck: list[str], log: Log
) -> bool:
    """Rank 0 saves where the run stands; True when the summary should be written."""
    if not info.is_main:
        return False
    if any(thread.startswith("drafter") for thread in stuck):
        log(f"{name}: a drafter thread did not stop in time: no checkpoint written")
    else:
        try:
            path = save_checkpoint_or_fail(run)
        except SaveError:
            raise  # a full disk: one line and exit 2, as at any save
        except CheckpointError as exc:  # a sharded drafter not gathered at this step
            log(f"{name}: no checkpoint written ({exc}); the newest checkpoint stands")
            return True
        log(f"{name}: checkpoint at step {run.step} in {path}")
    return True
