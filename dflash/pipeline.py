"""The producer-consumer training pipeline (DESIGN.md §3).

    prefetch --batch_queue--> TargetForwardLoop (one per target device)
             --hs_queue-->    DrafterTrainLoop  (one per drafter device)

The stage classes and `Pipeline` know nothing of models: the prefetcher calls a
`make_batch(index)`, a target loop a `forward(batch)`, a drafter loop a
`step(batch, target_out, phase)`. `run_pipeline` plugs the real target and
trainer in; the efficiency benchmark plugs synthetic stages of known cost into the
same classes.

Tracing: the prefetcher opens one root span per batch (`batch`) and hands its
handle along with the batch; each consumer records when it began waiting, then
opens its wait span under the batch it received with that start time. The root
ends after the drafter step. With several target threads, adjacent batches may
reach the drafters out of index order (each batch's anchors depend only on its
id, so only the order of optimizer updates changes).
"""

from __future__ import annotations

import io
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
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
    SHUTDOWN_TIMEOUT_S,
    BoundedQueue,
    NullTelemetry,
    PipelineCounters,
    PipelineError,
    SignalStop,
    SpanLike,
    StageGroup,
    StageThread,
    Stopped,
    Telemetry,
    TrainingInterrupted,
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


@dataclass
class BatchItem:
    """A batch on batch_queue, with the root span of its trace."""

    batch: Any  # dflash.data.Batch, or anything with batch_id and num_tokens
    span: SpanLike


@dataclass
class HiddenItem:
    """Target features of a batch on hs_queue."""

    batch: Any
    target_out: Any
    span: SpanLike


class _EndOfStream:
    """Queue marker: no more items; each consumer takes exactly one."""


END = _EndOfStream()

FINISH_STEP_TIMEOUT_S = 60.0  # after SIGINT/SIGTERM a drafter may finish its step


def _end_span(span: SpanLike, exc: BaseException | None = None) -> None:
    if exc is not None and not isinstance(exc, Stopped):
        span.record_exception(exc)
    span.end()


class Prefetcher(StageThread):
    """Builds the batches of `indices` in order and fills batch_queue."""

    def __init__(
        self,
        group: StageGroup,
        out_q: BoundedQueue[Any],
        make_batch: Callable[[int], Any],
        indices: Iterable[int],
        num_consumers: int,
        telemetry: Telemetry,
        span_attributes: Mapping[str, Any],
        pin_memory: bool = False,
    ):
        super().__init__("prefetch", group)
        self.out_q, self.make_batch, self.indices = out_q, make_batch, indices
        self.num_consumers, self.telemetry = num_consumers, telemetry
        self.span_attributes, self.pin_memory = dict(span_attributes), pin_memory

    def loop(self) -> None:
        for index in self.indices:
            # The root starts before the batch is built: a consumer already waiting for
            # this batch then has its wait inside the batch's trace.
            span = self.telemetry.start_span("batch", self.span_attributes, level="step")
            self.enter("data.batch")
            try:
                batch = self.make_batch(index)
                if self.pin_memory:  # lets the target thread's host-to-device copy run async
                    tensors = (t.pin_memory() for t in _tensors(batch))
                    batch = type(batch)(batch.batch_id, *tensors)
            except BaseException as exc:
                _end_span(span, exc)
                raise
            span.set_attribute("batch.id", batch.batch_id)
            span.set_attribute("tokens", batch.num_tokens)
            self.enter("batch_queue.put")
            try:
                self.out_q.put(BatchItem(batch, span))
            except BaseException as exc:
                _end_span(span, exc)
                raise
        self.enter("batch_queue.put")
        for _ in range(self.num_consumers):
            self.out_q.put(END)


def _tensors(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return batch.input_ids, batch.loss_mask


class _Countdown:
    """The last of `n` finishing producers passes end-of-stream on downstream."""

    def __init__(self, n: int):
        self._left = n
        self._lock = threading.Lock()

    def done(self) -> bool:
        with self._lock:
            self._left -= 1
            return self._left == 0


class TargetForwardLoop(StageThread):
    """batch_queue -> forward(batch) on one device -> hs_queue."""

    def __init__(
        self,
        name: str,
        group: StageGroup,
        in_q: BoundedQueue[Any],
        out_q: BoundedQueue[Any],
        forward: Callable[[Any], Any],
        device: torch.device | str,
        counters: PipelineCounters,
        telemetry: Telemetry,
        producers: _Countdown,
        num_consumers: int,
    ):
        super().__init__(name, group)
        self.in_q, self.out_q, self.forward, self.device = in_q, out_q, forward, device
        self.counters, self.telemetry = counters, telemetry
        self.producers, self.num_consumers = producers, num_consumers

    def loop(self) -> None:
        tel = self.telemetry
        while True:
            self.enter("batch_queue.wait")
            wait_start_ns = time.time_ns()
            item, depth = self.in_q.get_with_depth()
            if item is END:
                break
            self.counters.queue_depth("batch_queue", depth)
            attrs = {"queue.depth": depth, "device": str(self.device)}
            # With several target threads one may have begun waiting before the batch it
            # got existed: the span starts with its batch so it stays inside the trace.
            wait_start_ns = max(wait_start_ns, item.span.start_time_ns)
            with tel.phase("batch_queue.wait", parent=item.span, start_time_ns=wait_start_ns,
                           attributes=attrs):  # fmt: skip
                pass
            self.enter("target.forward")
            try:
                with tel.phase("target.forward", parent=item.span, device=self.device):
                    target_out = self.forward(item.batch)
                self.counters.add_target(item.batch.num_tokens)
                self.enter("hs_queue.put")
                put_start_s = time.perf_counter()
                self.out_q.put(HiddenItem(item.batch, target_out, item.span))
                # A full hs_queue blocks here: the drafter-bound half of the verdict.
                tel.record("hs_queue.put", time.perf_counter() - put_start_s)
            except BaseException as exc:
                _end_span(item.span, exc)
                raise
        if self.producers.done():
            self.enter("hs_queue.put")
            for _ in range(self.num_consumers):
                self.out_q.put(END)


StepFn = Callable[[Any, Any, Callable[[str], AbstractContextManager[Any]]], Any]


class DrafterTrainLoop(StageThread):
    """hs_queue -> step(batch, target_out, phase) on one drafter replica."""

    def __init__(
        self,
        name: str,
        group: StageGroup,
        in_q: BoundedQueue[Any],
        step: StepFn,
        device: torch.device | str,
        counters: PipelineCounters,
        telemetry: Telemetry,
        on_step: Callable[[int, Any, Any], None],
        move: Callable[[Any, Any], tuple[Any, Any]] | None = None,
        first_step: int = 0,
    ):
        super().__init__(name, group)
        self.in_q, self.step_fn, self.device = in_q, step, device
        self.counters, self.telemetry, self.on_step = counters, telemetry, on_step
        self.move, self.first_step = move, first_step
        self.steps_done = 0

    def _phase(self, name: str) -> AbstractContextManager[Any]:
        # The trainer's phases nest under drafter.step (the innermost open phase of
        # this thread); entering them here makes a failure name the exact phase.
        self.enter(name)
        return self.telemetry.phase(name, device=self.device)

    def loop(self) -> None:
        tel = self.telemetry
        while True:
            self.enter("hs_queue.wait")
            wait_start_ns = time.time_ns()
            item, depth = self.in_q.get_with_depth()
            if item is END:
                return
            self.counters.queue_depth("hs_queue", depth)
            attrs = {"queue.depth": depth, "device": str(self.device)}
            wait_start_ns = max(wait_start_ns, item.span.start_time_ns)  # inside the trace
            with tel.phase("hs_queue.wait", parent=item.span, start_time_ns=wait_start_ns,
                           attributes=attrs):  # fmt: skip
                pass
            self.enter("drafter.step")
            try:
                batch, target_out = item.batch, item.target_out
                if self.move is not None:
                    batch, target_out = self.move(batch, target_out)
                step_attrs = {"step": self.first_step + self.steps_done, "batch.id": batch.batch_id,
                              "device": str(self.device)}  # fmt: skip
                with tel.phase("drafter.step", level="step", parent=item.span,
                               attributes=step_attrs):  # fmt: skip
                    result = self.step_fn(batch, target_out, self._phase)
            except BaseException as exc:
                _end_span(item.span, exc)
                raise
            item.span.end()
            self.counters.add_drafter(batch.num_tokens)
            self.enter("drafter.bookkeeping")
            self.on_step(self.steps_done, batch, result)
            self.steps_done += 1


@dataclass
class Pipeline:
    """One prefetcher, target threads and drafter threads around two bounded queues."""

    group: StageGroup
    batch_queue: BoundedQueue[Any]
    hs_queue: BoundedQueue[Any]
    counters: PipelineCounters

    @classmethod
    def build(
        cls,
        *,
        make_batch: Callable[[int], Any],
        indices: Iterable[int],
        forwards: list[tuple[torch.device | str, Callable[[Any], Any]]],
        steps: list[tuple[torch.device | str, StepFn, Callable[[Any, Any], tuple[Any, Any]]]],
        on_step: Callable[[int, int, Any, Any], None],
        batch_queue_size: int,
        hs_queue_size: int,
        telemetry: Telemetry | None = None,
        span_attributes: Mapping[str, Any] | None = None,
        pin_memory: bool = False,
        group: StageGroup | None = None,
        first_step: int = 0,
    ) -> Pipeline:
        """Wire the stages; `on_step(replica, replica_step, batch, result)` after each step."""
        tel = telemetry if telemetry is not None else NullTelemetry()
        group, counters = group or StageGroup(), PipelineCounters()
        batch_q: BoundedQueue[Any] = BoundedQueue("batch_queue", batch_queue_size, group.stop)
        hs_q: BoundedQueue[Any] = BoundedQueue("hs_queue", hs_queue_size, group.stop)
        Prefetcher(group, batch_q, make_batch, indices, len(forwards), tel,
                   span_attributes or {}, pin_memory)  # fmt: skip
        producers = _Countdown(len(forwards))
        for i, (device, forward) in enumerate(forwards):
            TargetForwardLoop(f"target-{i}", group, batch_q, hs_q, forward, device, counters,
                              tel, producers, len(steps))  # fmt: skip
        for i, (device, step, move) in enumerate(steps):
            DrafterTrainLoop(
                f"drafter-{i}", group, hs_q, step, device, counters, tel,
                (lambda k: lambda n, b, r: on_step(k, n, b, r))(i), move, first_step,
            )  # fmt: skip
        return cls(group, batch_q, hs_q, counters)

    def run(
        self,
        stall_timeout_s: float | None = None,
        tick: Callable[[], None] | None = None,
        failure_timeout_s: float = SHUTDOWN_TIMEOUT_S,
        stop_timeout_s: float = FINISH_STEP_TIMEOUT_S,
    ) -> list[str]:
        """Start, wait for the end or a stop, join; names of threads that did not stop.

        After a failure the others get `failure_timeout_s` to stop; after an outside
        stop (a signal) `stop_timeout_s`, so a drafter can finish its current step.
        A stage failure is left in `group.failure` (see `raise_if_failed`).
        """
        self.counters.restart_clock()
        self.group.start()
        try:
            self.group.wait(stall_timeout_s, tick)
        finally:
            failed = self.group.failure is not None
            stuck = self.group.shutdown(failure_timeout_s if failed else stop_timeout_s)
            self.counters.stop_clock()
            self._end_abandoned_spans()
        return stuck

    def _end_abandoned_spans(self) -> None:
        # Batches still queued when the pipeline stopped: end their traces so they
        # are exported (marked abandoned) instead of silently dropped.
        for q in (self.batch_queue, self.hs_queue):
            for item in q.drain():
                if not isinstance(item, _EndOfStream):
                    item.span.set_attribute("abandoned", True)
                    item.span.end()

    def raise_if_failed(self) -> None:
        self.group.raise_if_failed()


# --------------------------------------------------------------------------- training

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
        train_start_s = time.perf_counter()
        with SignalStop(setup.pipe.group.stop) as signals:
            try:
                stuck.extend(setup.pipe.run(stall_timeout_s))
            finally:
                setup.progress.close()
        train_s = time.perf_counter() - train_start_s
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
