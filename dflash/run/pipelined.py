"""Training with the producer-consumer pipeline (docs/design.md §3): `run_pipeline`.

The stage threads and queues live in dflash.pipeline, the model objects of each
device in dflash.run.replicas; this module plugs the run into the stages,
synchronizes drafters across ranks, checkpoints, and handles failures and signals.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
from opentelemetry.trace import Link

import tracing
from dflash import names
from dflash.config.devices import Placement
from dflash.config.settings import TrainConfig
from dflash.data.datasets import Batch
from dflash.errors import DFlashError, first_line
from dflash.log import NOT_PRINTED, Log, get_logger, say
from dflash.observe.flops import drafter_flops, linear_params, mfu, target_flops_per_token
from dflash.observe.instruments import FlopsFigures, flops_figures
from dflash.observe.observer import Observer, shared_run_id, start_observer
from dflash.observe.profile_window import ProfileWindow
from dflash.observe.report import ReportError, write_report
from dflash.observe.trackers import Reporting, start_reporting
from dflash.pipeline.distributed import (
    DistInfo,
    GradAverager,
    check_same_across_ranks,
    destroy_distributed,
    rank_batch_indices,
)
from dflash.pipeline.queues import PipelineError, StageFailure, StageGroup
from dflash.pipeline.stages import Pipeline, StepFn
from dflash.run.build import Run, build_run
from dflash.run.checkpoint import CheckpointError, SaveError
from dflash.run.finish import (
    RunStats,
    build_summary,
    complete_run,
    save_checkpoint_or_fail,
    write_summary,
)
from dflash.run.folder import METRICS_FILE, earlier_run
from dflash.run.progress import HeldLog, Progress
from dflash.run.replicas import Replica, build_replicas, mover, target_forwards
from dflash.run.start import Start, log_startup, start_run
from dflash.signals import Interrupted, SignalStop, TrainingInterrupted
from dflash.target.model import TargetOutput
from dflash.train.step import PhaseFn, StepResult
from dflash.train.step_metrics import StageRates, StepMetrics, span_attributes

__all__ = ["DEFAULT_STALL_TIMEOUT_S", "PipelineError", "TrainingInterrupted", "run_pipeline"]

logger = get_logger("run")
# A stage that spends this long in one phase (not waiting on a queue) fails the run.
DEFAULT_STALL_TIMEOUT_S = 600.0


def run_flops(run: Run) -> FlopsFigures:
    """FLOPs per trained token of the run's target forward (none where the features are
    read from disk) and drafter step, counting the configured anchors per row (an upper
    bound where rows have fewer valid anchors)."""
    cfg, target, drafter = run.cfg, run.target, run.drafter
    rows, seq_len, config = cfg.data.batch_size, cfg.data.seq_len, drafter.config
    per_target = 0.0
    if run.features.runs_target:
        weights = linear_params(target.model)
        if not cfg.loss.use_soft_labels and isinstance(target.lm_head, torch.nn.Linear):
            weights -= target.lm_head.weight.numel()  # hidden states only: no logits
        geo = target.geometry
        per_target = target_flops_per_token(
            weights, geo.num_layers, geo.num_heads, geo.head_dim, seq_len
        )
    step = drafter_flops(
        layer_weights=linear_params(drafter.layers),
        fusion_weights=linear_params(drafter.fc),
        lm_head_weights=drafter.lm_head.weight.numel(),
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        head_dim=config.head_dim,
        seq_len=seq_len,
        block_size=config.block_size,
    )
    block_tokens = rows * cfg.loss.num_anchors * config.block_size
    per_drafter = step.per_step(block_tokens, rows * seq_len) / (rows * seq_len)
    placement = run.placement
    return flops_figures(per_target, per_drafter, placement.targets, placement.drafters)


class _StepBook:
    """Losses per step; replica 0 advances the run, reports progress and checkpoints."""

    def __init__(
        self,
        run: Run,
        progress: Progress,
        info: DistInfo,
        num_replicas: int,
        metrics: StepMetrics,
        averager: GradAverager,
        observer: Observer | None = None,
    ):
        self.run, self.progress, self.info, self.metrics = run, progress, info, metrics
        self.averager, self.observer = averager, observer
        self.reporting: Reporting | None = None  # --report-to (rank 0)
        self.rates: StageRates | None = None  # set once the pipeline exists
        self.flops = run_flops(run)
        self.start_step, self.start_index = run.step, run.next_batch_index
        self.batches_per_step = info.world_size * num_replicas
        self.losses: dict[int, list[torch.Tensor]] = {}  # device tensors, read at the end
        self.last_step: Link | None = None  # replica 0's last drafter.step span
        self.tokens = 0  # over all ranks: every rank trains batches of the same size
        self._lock = threading.Lock()
        self._started_s = time.perf_counter()

    def on_step(self, replica: int, step: int, batch: Batch, result: StepResult) -> None:
        with self._lock:
            self.losses.setdefault(step, []).append(result.loss)
            self.tokens += batch.num_tokens * self.info.world_size
        if replica != 0:
            return
        if result.link is not None:
            self.last_step = result.link
        run, figures = self.run, result.figures
        run.step = self.start_step + step + 1
        run.next_batch_index = self.start_index + (step + 1) * self.batches_per_step
        self.averager.after_step(may_read=figures is not None)
        if step == 0 and self.observer is not None:
            self.observer.first_step_done()
        if figures is not None:
            evals, train_s = run.evals, time.perf_counter() - self._started_s
            if self.info.is_main and evals is not None:  # other ranks wait in the next sync
                figures.update(evals.on_logged_step(run.step, train_s, self.step_links()))
        self.progress.update(run.step, batch.num_tokens * self.batches_per_step, figures)
        if figures is not None:
            self._log_step(figures, result.context)
            run.trainer.check_figures(figures)  # a diverged run stops before it saves
        if self.info.is_main and run.cfg.run.checkpoint_due(run.step):
            # replica 0's weights cannot move while it is here
            attributes = {names.STEP: run.step}
            links = self.step_links()
            phase = tracing.phase(
                names.CHECKPOINT_SAVE, level="step", attributes=attributes, links=links
            )
            with phase:
                save_checkpoint_or_fail(run)

    def step_links(self) -> list[Link]:
        """A link to the last step's drafter.step span (none before the first step, or
        without spans): checkpoint and eval spans, in traces of their own, point at the
        weights they saved or measured."""
        return [] if self.last_step is None else [self.last_step]

    def _log_step(self, figures: dict[str, Any], context: Any = None) -> None:
        """A logged step: metrics.jsonl (rank 0), the metrics signal and the step's event
        (every rank; `context`: its drafter.step span's, so the event names its trace)."""
        if self.rates is not None:
            figures.update(self.rates.figures())
        rates = figures.get("tokens_per_s", {})
        flops = self.flops
        drafter_rate = rates.get("drafter", 0.0)
        drafter_mfu = mfu(flops.drafter_per_token, drafter_rate, flops.drafter_peak_tflops)
        if drafter_mfu is not None:
            figures["mfu"] = drafter_mfu
        if self.observer is not None:
            self.observer.record_step(figures, mfu=drafter_mfu, context=context)
        if self.info.is_main:
            self.metrics.write(figures)
            if self.reporting is not None:
                self.reporting.log_step(figures)

    def mean_losses(self) -> list[float]:
        with self._lock:
            return [sum(float(x) for x in v) / len(v) for _, v in sorted(self.losses.items())]


@dataclass
class _Setup:
    run: Run
    pipe: Pipeline
    book: _StepBook
    progress: Progress
    placement: Placement
    train_cpu_s: float = 0.0


def run_training(cfg: TrainConfig, log: Log = say) -> dict[str, Any]:
    """`dflash-train train`: tracing set up from cfg.telemetry, then `run_pipeline`.

    Under torchrun the process group starts first: every rank's telemetry carries
    rank 0's run id."""
    start = start_run(cfg)
    info = start.info
    try:
        output_dir = Path(cfg.run.output_dir)
        run_info = {"run_id": shared_run_id(info.world_size), "output_dir": output_dir}
        # The resource says where this rank ran: its devices, the config's hash.
        where = {"local_rank": info.local_rank, "devices": start.placement.drafters}
        reporting = start_reporting(cfg.telemetry.report_to, run_info["run_id"], log, info.is_main)
        observer = start_observer(
            cfg.telemetry,
            info.rank,
            info.world_size,
            **run_info,
            **where,
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
        _log_failure(exc)
        if not observer.folder_written:  # refused before training: one line
            observer.close(lambda _: None, table=False)
        raise
    except Exception as exc:  # a stage that failed (PipelineError), a diverged run, ...
        _log_failure(exc)
        raise
    finally:
        observer.close(log)  # no-op after a normal finish
        reporting.close(log)  # the run's files to the trackers, bounded: after the summary
        start.end()  # the folder's lock: after the last file the run writes


def _log_failure(exc: BaseException) -> None:
    """The line the command ends with, as an ERROR record for telemetry (the command line
    prints it): while the logs still export, with the exception's type and stack trace
    (the phase it passed through has its own record, tied to that phase's span)."""
    if getattr(exc, "_dflash_logged", False):  # _finish logged it while the logs exported
        return
    logger.error("Error: %s", first_line(exc), exc_info=exc, extra=NOT_PRINTED)
    with contextlib.suppress(AttributeError):  # an exception type with __slots__
        # (mypy ignore below) a mark on the exception, not a declared field
        exc._dflash_logged = True  # type: ignore[attr-defined]


def run_pipeline(
    cfg: TrainConfig,
    log: Log = say,
    *,
    start: Start | None = None,
    observer: Observer | None = None,
    progress_stream: IO[str] | None = None,
    stall_timeout_s: float | None = DEFAULT_STALL_TIMEOUT_S,
    reporting: Reporting | None = None,
) -> dict[str, Any]:
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
    _share_cpu_cores(placement, info.local_world_size)
    stuck: list[str] = []
    try:
        with tracing.phase(names.RUN_STARTUP, level="step"):  # a trace of its own
            setup = _setup(cfg, log, start, observer, progress_stream, reporting)
        if observer is not None:
            devices = (*placement.targets, *placement.drafters)
            stream = setup.progress.line_stream()
            features = setup.run.features
            observer.attach(
                setup.pipe.snapshot,
                devices,
                setup.book.flops,
                stream,
                features.bytes_counter(),
                features.skipped_counter(),
            )
        train_start_s, cpu_start_s = time.perf_counter(), time.process_time()
        with SignalStop(setup.pipe.group.stop) as signals:
            try:
                stuck.extend(setup.pipe.run(stall_timeout_s))
            finally:
                setup.progress.close()
                if not stuck:  # a target thread still reading keeps its engine
                    setup.run.features.stop()  # a streaming engine ends with training
        train_s = time.perf_counter() - train_start_s
        # CPU seconds of the whole process (every thread) while training: the cost of
        # tracing shows here even where wall-clock throughput is too noisy to show it.
        setup.train_cpu_s = time.process_time() - cpu_start_s
        return _finish(setup, info, observer, log, train_s, started_s, signals.signum, stuck)
    finally:
        if not stuck:  # a thread stuck in a collective would hang the teardown
            destroy_distributed()
        if own_start:
            start.end()


def _share_cpu_cores(placement: Placement, local_world_size: int) -> None:
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


def _setup(
    cfg: TrainConfig,
    log: Log,
    start: Start,
    observer: Observer | None,
    progress_stream: IO[str] | None,
    reporting: Reporting | None = None,
) -> _Setup:
    info, placement = start.info, start.placement
    quiet = log if info.is_main else (lambda _: None)
    held = HeldLog(quiet)  # what start-up says, once every check below has passed
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
    metrics_file = Path(cfg.run.output_dir) / METRICS_FILE
    metrics = StepMetrics(
        cfg.run.log_every, run.step, cfg.run.steps, metrics_file, cfg.run.eval_every
    )
    book = _StepBook(run, progress, info, len(replicas), metrics, averager, observer)
    window = observer.profile if observer is not None else None
    indices = rank_batch_indices(
        cfg.run.steps - run.step, info.rank, info.world_size, len(replicas), run.next_batch_index
    )
    forwards = target_forwards(run, indices[-1] if indices else 0)
    steps = [
        (r.device, _step_fn(r, i, metrics, window), mover(r.device)) for i, r in enumerate(replicas)
    ]
    pipe = Pipeline.build(
        make_batch=run.train_data.batch,
        indices=indices,
        forwards=forwards,
        target_phase=run.features.target_phase,
        steps=steps,
        on_step=book.on_step,
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
        reporting.begin(cfg.to_dict(), Path(cfg.run.output_dir), run.step, progress.write)
    if observer is not None:
        observer.folder_written = True  # stats.json and the timeline may go there now
    if info.is_main and run.resumed_from is not None:
        metrics.continue_file()
    return _Setup(run, pipe, book, progress, placement)


def _stage_tokens(pipe: Pipeline, world_size: int) -> Callable[[], tuple[float, dict[str, int]]]:
    def read() -> tuple[float, dict[str, int]]:
        snap = pipe.snapshot()
        tokens = {
            "target": snap.target_tokens * world_size,
            "drafter": snap.drafter_tokens * world_size,
        }
        return snap.elapsed_s, tokens

    return read


def _step_fn(
    replica: Replica, index: int, metrics: StepMetrics, window: ProfileWindow | None = None
) -> StepFn:
    """The trainer's step; on logged steps replica 0 reads the figures, inside the
    drafter.step span (after its last phase), and puts them on that span. Replica 0's
    thread also runs the --torch-profile `window` (dflash.observe.profile_window.ProfileWindow)."""
    trainer = replica.trainer

    def step(batch: Batch, target_out: TargetOutput, phase: PhaseFn) -> StepResult:
        if index == 0 and window is not None:
            window.before_step(trainer.step_count)
            path = window.path_for(trainer.step_count)
            span = tracing.current_phase()
            if path is not None and span is not None:
                span.set_attribute(names.PROFILE_FILE, path)
        result = trainer.step(batch, target_out, phase=phase)
        span = tracing.current_phase()  # drafter.step: the trainer's phases have ended
        if index == 0 and span is not None and span.span is not None:
            number = span.attributes.get(names.STEP, trainer.step_count - 1)
            result.link = Link(span.span.get_span_context(), {names.STEP: number})
        if index == 0 and metrics.due(trainer.step_count):
            result.figures = metrics.read(trainer.step_count, result)
            span = tracing.current_phase()
            if span is not None:
                result.context = span.context
                for key, value in span_attributes(result.figures).items():
                    span.set_attribute(key, value)
        return result

    return step


def _pipeline_figures(setup: _Setup, world_size: int) -> dict[str, Any]:
    snap = setup.pipe.snapshot()
    return {
        "target_devices": [str(d) for d in setup.placement.targets],
        "drafter_devices": [str(d) for d in setup.placement.drafters],
        "world_size": world_size,
        "target_tokens_per_s": snap.target_tokens_per_s * world_size,
        "drafter_tokens_per_s": snap.drafter_tokens_per_s * world_size,
        "queue_depth_mean": {name: mean for name, (_, mean, _) in snap.queue_depths.items()},
        "train_cpu_s": setup.train_cpu_s,
    }


def _finish(
    setup: _Setup,
    info: DistInfo,
    observer: Observer | None,
    log: Log,
    train_s: float,
    started_s: float,
    signum: int | None,
    stuck: list[str],
) -> dict[str, Any]:
    run, failure = setup.run, setup.pipe.group.failure
    figures = _pipeline_figures(setup, info.world_size)  # now: before evaluation
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
            _log_failure(error)
            close()
            raise
    if stuck:
        log(f"warning: threads still running after the stop: {', '.join(stuck)}")
    stats = RunStats(setup.book.mean_losses(), setup.book.tokens, train_s)
    if signum is not None:
        name = signal.Signals(signum).name
        saved = _checkpoint_after_signal(run, info, name, stuck, log)
        extra = _extra(figures, close())
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
        links = setup.book.step_links()  # the final save and evaluation: of the last step
        evaluation = complete_run(run, lambda n: tracing.phase(n, level="step", links=links), log)
    except Interrupted as exc:  # during the final save or evaluation: record what is known
        stopped_in = exc.describe()
        extra = _extra(figures, close())
        summary = build_summary(run, stats, started_s, interrupted=stopped_in, extra=extra)
        write_summary(run, summary, log)
        _write_report(run.output_dir, log)
        raise
    extra = _extra(figures, close())
    summary = build_summary(run, stats, started_s, evaluation=evaluation, extra=extra)
    write_summary(run, summary, log)
    _write_report(run.output_dir, log)
    return summary


def _extra(figures: dict[str, Any], telemetry: dict[str, Any] | None) -> dict[str, Any]:
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
