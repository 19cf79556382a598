"""Training with the producer-consumer pipeline (DESIGN.md §3): `run_pipeline`.

The stage threads and queues live in dflash.stages and dflash.queues; this module
plugs the real target and trainer into them, places devices, synchronizes drafters
across ranks, checkpoints, and handles failures and signals.
"""

from __future__ import annotations

import io
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dflash.devices import DeviceError, mover, resolve_devices, target_forwards
from dflash.distributed import (
    DistInfo,
    GradAverager,
    build_replicas,
    check_same_across_ranks,
    destroy_distributed,
    dist_info_from_env,
    init_distributed,
    rank_batch_indices,
)
from dflash.progress import format_summary
from dflash.queues import (
    NullTelemetry,
    PipelineError,
    SignalStop,
    StageGroup,
    Telemetry,
    TrainingInterrupted,
)
from dflash.stages import (
    DrafterTrainLoop,
    Pipeline,
    Prefetcher,
    StepFn,
    TargetForwardLoop,
)
from dflash.trainer import RunStats, finish_run, save_run_checkpoint, write_json_atomic

__all__ = [
    "DEFAULT_STALL_TIMEOUT_S",
    "DrafterTrainLoop",
    "NullTelemetry",
    "Pipeline",
    "PipelineError",
    "Prefetcher",
    "TargetForwardLoop",
    "Telemetry",
    "TrainingInterrupted",
    "run_pipeline",
]


# A stage that spends this long in one phase (not waiting on a queue) fails the run.
DEFAULT_STALL_TIMEOUT_S = 600.0


class _StepBook:
    """Losses per step; replica 0 advances the run, reports progress and checkpoints."""

    def __init__(
        self, run: Any, progress: Any, info: DistInfo, num_replicas: int, telemetry: Telemetry
    ):
        self.run, self.progress, self.info, self.telemetry = run, progress, info, telemetry
        self.start_step, self.start_index = run.step, run.next_batch_index
        self.batches_per_step = info.world_size * num_replicas
        self.losses: dict[int, list[float]] = {}
        self.tokens = 0  # over all ranks: every rank trains batches of the same size
        self._lock = threading.Lock()

    def on_step(self, replica: int, step: int, batch: Any, result: Any) -> None:
        with self._lock:
            self.losses.setdefault(step, []).append(result.loss)
            self.tokens += batch.num_tokens * self.info.world_size
        if replica != 0:
            return
        run = self.run
        run.step = self.start_step + step + 1
        run.next_batch_index = self.start_index + (step + 1) * self.batches_per_step
        self.progress.update(run.step, result.loss, batch.num_tokens * self.batches_per_step)
        every = run.cfg.run.save_every
        if self.info.is_main and every and run.step % every == 0 and run.step < run.cfg.run.steps:
            # replica 0's weights cannot move while it is here
            attrs = {"step": run.step}
            with self.telemetry.phase("checkpoint.save", level="step", attributes=attrs):
                save_run_checkpoint(run)

    def mean_losses(self) -> list[float]:
        with self._lock:
            return [sum(v) / len(v) for _, v in sorted(self.losses.items())]


@dataclass
class _Setup:
    run: Any  # dflash.trainer.Run
    pipe: Pipeline
    book: _StepBook
    progress: Any
    figures: Callable[[], dict[str, Any]]
    telemetry: Telemetry
    train_cpu_s: float = 0.0


def run_pipeline(
    cfg: Any,
    log: Callable[[str], None] = print,
    *,
    telemetry: Telemetry | None = None,
    progress_stream: Any = None,
    stall_timeout_s: float | None = DEFAULT_STALL_TIMEOUT_S,
    on_start: Callable[[Pipeline], None] | None = None,
) -> dict[str, Any]:
    """Train `cfg` (a dflash.config.TrainConfig) with the pipeline; the summary dict.

    Under torchrun every rank calls this; rank 0 alone writes checkpoints, the drafter
    and summary.json (other ranks return a short dict). `on_start(pipeline)` lets
    reporting code read `pipeline.counters` and the queues' depths while it runs.
    Raises PipelineError (one line; the traceback goes to OUTPUT_DIR/pipeline-error.log)
    when a stage fails, and TrainingInterrupted (a SystemExit, code 130 or 143) after
    SIGINT/SIGTERM, once the checkpoint and the summary are written.
    """
    started_s = time.perf_counter()
    info = dist_info_from_env()
    targets, drafters = resolve_devices(
        cfg.pipeline.target_devices, cfg.pipeline.drafter_devices,
        info.local_rank, info.local_world_size,
    )  # fmt: skip
    _share_cpu_cores(targets, drafters, info.local_world_size)
    init_distributed(info, drafters[0])
    stuck: list[str] = []
    try:
        setup = _setup(cfg, log, info, targets, drafters, telemetry, progress_stream)
        if on_start is not None:
            on_start(setup.pipe)
        train_start_s, cpu_start_s = time.perf_counter(), time.process_time()
        with SignalStop(setup.pipe.group.stop) as signals:
            try:
                stuck.extend(setup.pipe.run(stall_timeout_s))
            finally:
                setup.progress.close()
        train_s = time.perf_counter() - train_start_s
        # CPU seconds of the whole process (every thread) while training: the cost of
        # tracing shows here even where wall-clock throughput is too noisy to show it.
        setup.train_cpu_s = time.process_time() - cpu_start_s
        return _finish(setup, info, log, train_s, started_s, signals.signum, stuck)
    finally:
        if not stuck:  # a thread stuck in a collective would hang the teardown
            destroy_distributed()


def _share_cpu_cores(targets: list, drafters: list, local_world_size: int) -> None:
    """Splits the cores among the stage threads that compute on the CPU.

    torch gives every thread's ops all cores by default; with a target and a drafter
    thread (and maybe several ranks) on one CPU they would oversubscribe it (measured:
    ~25% fewer tokens/s on 2 cores). OMP_NUM_THREADS, when set, is the user's choice.
    """
    if "OMP_NUM_THREADS" in os.environ:
        return
    cpu_threads = sum(d.type == "cpu" for d in (*targets, *drafters)) * max(1, local_world_size)
    if cpu_threads:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cpu_threads))


def _setup(cfg, log, info, targets, drafters, telemetry, progress_stream) -> _Setup:  # fmt: skip
    from dflash.progress import Progress, format_loss_config, format_run_config
    from dflash.trainer import build_run

    quiet = log if info.is_main else (lambda _: None)
    tel = telemetry if telemetry is not None else NullTelemetry()
    run = build_run(cfg, quiet)
    if (run.target_device, run.drafter_device) != (targets[0], drafters[0]):
        placed = f"{run.target_device}/{run.drafter_device}"
        raise DeviceError(f"the run placed target/drafter on {placed}, the pipeline expects "
                          f"{targets[0]}/{drafters[0]}")  # fmt: skip
    check_same_across_ranks(len(drafters), "the number of drafter devices", drafters[0])
    check_same_across_ranks(run.step, "the step to resume from", drafters[0])
    group = StageGroup()
    replicas = build_replicas(run, drafters)
    averager = GradAverager([r.drafter for r in replicas], group.stop)
    # Cross-rank interval tables ride on the gradient all-reduce (Observer.ranks).
    averager.sideband = getattr(tel, "ranks", None)
    for i, replica in enumerate(replicas):
        replica.trainer.grad_sync = averager.hook(i) if averager.needed else None
    names = {side: ",".join(map(str, devs)) for side, devs in (("t", targets), ("d", drafters))}
    ranks = f" x {info.world_size} ranks" if info.enabled else ""
    quiet(format_loss_config(cfg))
    if hasattr(tel, "describe"):
        quiet(tel.describe())
    quiet(format_run_config(cfg, f"{cfg.target.spec} layers {run.layer_ids}",
                            f"targets {names['t']}, drafters {names['d']}{ranks}"))  # fmt: skip
    progress = Progress(cfg.run.steps, run.step, log=None,
                        stream=progress_stream if info.is_main else io.StringIO())  # fmt: skip
    book = _StepBook(run, progress, info, len(replicas), tel)
    pipe = Pipeline.build(
        make_batch=run.train_data.batch,
        indices=rank_batch_indices(cfg.run.steps - run.step, info.rank, info.world_size,
                                   len(replicas), run.next_batch_index),
        forwards=target_forwards(run, targets),
        steps=[(r.device, _step_fn(r.trainer), mover(r.device)) for r in replicas],
        on_step=book.on_step,
        batch_queue_size=cfg.pipeline.batch_queue_size,
        hs_queue_size=cfg.pipeline.hs_queue_size,
        telemetry=tel,
        span_attributes={"rank": info.rank},
        pin_memory=torch.cuda.is_available() and any(d.type == "cuda" for d in targets),
        group=group,
        first_step=run.step,
    )  # fmt: skip

    def figures() -> dict[str, Any]:
        snap, w = pipe.counters.snapshot(), info.world_size
        return {
            "target_devices": [str(d) for d in targets],
            "drafter_devices": [str(d) for d in drafters],
            "world_size": w,
            "target_tokens_per_s": snap.target_tokens_per_s * w,
            "drafter_tokens_per_s": snap.drafter_tokens_per_s * w,
            "queue_depth_mean": {name: mean for name, (_, mean, _) in snap.queue_depths.items()},
        }

    return _Setup(run, pipe, book, progress, figures, tel)


def _step_fn(trainer: Any) -> StepFn:
    return lambda batch, target_out, phase: trainer.step(batch, target_out, phase=phase)


def _finish(setup: _Setup, info: DistInfo, log: Callable[[str], None], train_s: float,
            started_s: float, signum: int | None, stuck: list[str]) -> dict[str, Any]:  # fmt: skip
    run, failure = setup.run, setup.pipe.group.failure
    figures = setup.figures()  # now: the counters' clock must not include evaluation
    figures["train_cpu_s"] = setup.train_cpu_s
    tel = setup.telemetry
    if failure is not None:
        tel.close(log, gather_ranks=False)  # the final table, before the one-line error
        log_path = _write_error_log(run.output_dir, info, failure)
        raise failure.to_error().with_log(log_path or "") from failure.error
    if stuck:
        log(f"warning: threads still running after the stop: {', '.join(stuck)}")
    stats = RunStats(setup.book.mean_losses(), setup.book.tokens, train_s)
    if signum is not None:
        summary = _after_signal(run, info, stats, started_s, signum, stuck, log)
        closed = tel.close(log, gather_ranks=False)
        if summary is not None:
            summary["pipeline"] = figures
            if closed is not None:
                summary["telemetry"] = closed
            write_json_atomic(run.output_dir / "summary.json", summary)
            log(format_summary(summary))
        raise TrainingInterrupted(signum, summary)
    if not info.is_main:
        tel.close(log, gather_ranks=True)
        return {"rank": info.rank, "steps": run.step, "pipeline": figures}
    summary = finish_run(run, stats, log, started_s, phase=lambda n: tel.phase(n, level="step"))
    summary["pipeline"] = figures
    closed = tel.close(log, gather_ranks=True)
    if closed is not None:
        summary["telemetry"] = closed
    write_json_atomic(run.output_dir / "summary.json", summary)
    return summary


def _write_error_log(run_dir: Any, info: DistInfo, failure: Any) -> str | None:
    name = f"pipeline-error-rank{info.rank}.log" if info.enabled else "pipeline-error.log"
    path = run_dir / name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{failure.to_error()}\n\n{failure.traceback_text}")
    except OSError:
        return None
    return str(path)


def _after_signal(
    run: Any,
    info: DistInfo,
    stats: RunStats,
    started_s: float,
    signum: int,
    stuck: list[str],
    log: Callable[[str], None],
) -> dict[str, Any] | None:
    """Checkpoint and summary after SIGINT/SIGTERM (rank 0 only; None elsewhere)."""
    if not info.is_main:
        return None
    name = signal.Signals(signum).name
    if any(thread.startswith("drafter") for thread in stuck):
        log(f"{name}: a drafter thread did not stop in time: no checkpoint written")
    else:
        path = save_run_checkpoint(run)
        log(f"{name}: checkpoint at step {run.step} in {path}")
    last = stats.losses[-1] if stats.losses else run.trainer.last_loss
    return {
        "steps": run.step,
        "steps_this_run": len(stats.losses),
        "tokens_per_s": stats.num_tokens / stats.train_s if stats.train_s > 0 else 0.0,
        "final_loss": float(last) if last is not None else float("nan"),
        "tau": None,
        "wall_s": time.perf_counter() - started_s,
        "train_s": stats.train_s,
        "setup_s": run.setup_s,
        "block_size": run.cfg.drafter.block_size,
        "target": run.cfg.target.spec,
        "interrupted": name,
    }
