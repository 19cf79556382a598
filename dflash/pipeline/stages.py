"""The stages of the producer-consumer pipeline, independent of any model.

    prefetch --batch_queue--> TargetForwardLoop (one per target device)
             --hs_queue-->    DrafterTrainLoop  (one per drafter device)

The prefetcher calls a `make_batch(index)`, a target loop a `forward(batch)`, a
drafter loop a `step(batch, target_out, phase)`; `dflash.run.pipelined.run_pipeline`
plugs the real target and trainer in, the efficiency benchmark synthetic stages.

Tracing is written against the `tracing` API (a no-op until `tracing.setup`), with
the names of dflash.names: the prefetcher opens one root span per batch and hands its
handle along with the batch; each consumer records when it began waiting, then
opens its wait span under the batch it received with that start time. The root
ends after the drafter step. With several target threads, adjacent batches may
reach the drafters out of index order (each batch's anchors depend only on its
id, so only the order of optimizer updates changes).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import torch
from opentelemetry.trace import Link

import tracing
from dflash import names
from dflash.pipeline.queues import (
    SHUTDOWN_TIMEOUT_S,
    BoundedQueue,
    CounterSnapshot,
    PipelineCounters,
    StageGroup,
    StageThread,
    Stopped,
)
from tracing import SpanHandle

# The pipeline carries what the plugged-in stages make, whatever it is: a
# dflash.data.Batch or the benchmark's synthetic one (read here only for batch_id,
# num_tokens and, when pinned, input_ids and loss_mask), the target's features, a step's
# result. Any, because the callers' functions take their own concrete types: a Protocol
# or object here would reject them (a Callable's parameters are contravariant).
Batch = Any
TargetOut = Any
StepResult = Any


@dataclass
class BatchItem:
    """A batch on batch_queue, with the root span of its trace."""

    batch: Batch
    span: SpanHandle


@dataclass
class HiddenItem:
    """Target features of a batch on hs_queue."""

    batch: Batch
    target_out: TargetOut
    span: SpanHandle


class _EndOfStream:
    """Queue marker: no more items; each consumer takes exactly one."""


END = _EndOfStream()

BatchQueue = BoundedQueue[BatchItem | _EndOfStream]
HiddenQueue = BoundedQueue[HiddenItem | _EndOfStream]
_Item = TypeVar("_Item", BatchItem, HiddenItem)
PhaseFn = Callable[[str], AbstractContextManager[object]]
MoveFn = Callable[[Batch, TargetOut], tuple[Batch, TargetOut]]

FINISH_STEP_TIMEOUT_S = 60.0  # after a stop signal a drafter may finish its step


def _end_span(span: SpanHandle, exc: BaseException | None = None) -> None:
    if exc is not None and not isinstance(exc, Stopped):
        span.record_exception(exc)
    span.end()


class Prefetcher(StageThread):
    """Builds the batches of `indices` in order and fills batch_queue."""

    def __init__(
        self,
        group: StageGroup,
        out_q: BatchQueue,
        make_batch: Callable[[int], Batch],
        indices: Iterable[int],
        num_consumers: int,
        span_attributes: Mapping[str, object],
        pin_memory: bool = False,
    ):
        super().__init__("prefetch", group)
        self.out_q, self.make_batch, self.indices = out_q, make_batch, indices
        self.num_consumers = num_consumers
        self.span_attributes, self.pin_memory = dict(span_attributes), pin_memory

    def loop(self) -> None:
        for index in self.indices:
            # The root starts before the batch is built: a consumer already waiting for
            # this batch then has its wait inside the batch's trace.
            span = tracing.start_span(names.BATCH, self.span_attributes, level="step")
            self.enter(names.DATA_BATCH)
            try:
                # A phase of its own: the prefetch thread's track in the timeline and
                # its share in the tables (an input-bound run shows here).
                with tracing.phase(names.DATA_BATCH, parent=span):
                    batch = self.make_batch(index)
                    if self.pin_memory:  # the target thread's host-to-device copy runs async
                        tensors = (t.pin_memory() for t in _tensors(batch))
                        batch = type(batch)(batch.batch_id, *tensors)
            except BaseException as exc:
                _end_span(span, exc)
                raise
            span.set_attribute(names.BATCH_ID, batch.batch_id)
            span.set_attribute(names.TOKENS, batch.num_tokens)
            self.enter(names.BATCH_QUEUE_PUT)
            try:
                self.out_q.put(BatchItem(batch, span))
            except BaseException as exc:
                _end_span(span, exc)
                raise
        self.enter(names.BATCH_QUEUE_PUT)
        for _ in range(self.num_consumers):
            self.out_q.put(END)


def _tensors(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    return batch.input_ids, batch.loss_mask


def _thread_attributes(stage: StageThread, device: torch.device | str) -> dict[str, object]:
    """The attributes every span of this stage thread carries (call on the thread)."""
    return {
        names.THREAD_NAME: stage.name,
        names.THREAD_ID: threading.get_native_id(),
        names.DEVICE: str(device),
    }


def _take(
    stage: StageThread,
    in_q: BoundedQueue[_Item | _EndOfStream],
    counters: PipelineCounters,
    thread_attrs: Mapping[str, object],
) -> _Item | _EndOfStream:
    """Next item of `in_q` (or END); the wait becomes a span under the item's batch."""
    wait_name = f"{in_q.name}.wait"
    stage.enter(wait_name)
    wait_start_ns = tracing.now_ns()
    item, depth = in_q.get_with_depth()
    if isinstance(item, _EndOfStream):  # END, the only instance
        # No batch, so no span; but the thread did wait (often the longest wait of a
        # thread that ran out of work early), and the verdict's shares need all of it.
        tracing.get_stats().add(wait_name, (tracing.now_ns() - wait_start_ns) / 1e9)
        return END
    counters.queue_depth(in_q.name, depth)
    # The tables get the whole wait, also the part before the batch existed (an idle
    # consumer); tracing clips only the exported span to start with its parent batch.
    attrs = {**thread_attrs, names.QUEUE_DEPTH: depth}
    with tracing.phase(wait_name, parent=item.span, start_time_ns=wait_start_ns, attributes=attrs):
        pass
    return item


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
        in_q: BatchQueue,
        out_q: HiddenQueue,
        forward: Callable[[Batch], TargetOut],
        device: torch.device | str,
        counters: PipelineCounters,
        producers: _Countdown,
        num_consumers: int,
        phase_name: str = names.TARGET_FORWARD,
    ):
        super().__init__(name, group)
        self.in_q, self.out_q, self.forward, self.device = in_q, out_q, forward, device
        self.phase_name = phase_name  # target.read when `forward` reads a hidden cache
        self.counters = counters
        self.producers, self.num_consumers = producers, num_consumers

    def loop(self) -> None:
        attrs = _thread_attributes(self, self.device)
        while True:
            item = _take(self, self.in_q, self.counters, attrs)
            if isinstance(item, _EndOfStream):
                break
            self.enter(self.phase_name)
            try:
                with tracing.phase(
                    self.phase_name, parent=item.span, device=self.device, attributes=attrs
                ):
                    target_out = self.forward(item.batch)
                self.counters.add_target(item.batch.num_tokens)
                self.enter(names.HS_QUEUE_PUT)
                # A full hs_queue blocks here: the drafter-bound half of the verdict, a
                # span of the batch's trace beside its wait on the drafter's side.
                with tracing.phase(
                    names.HS_QUEUE_PUT, parent=item.span, device=self.device, attributes=attrs
                ):
                    self.out_q.put(HiddenItem(item.batch, target_out, item.span))
            except BaseException as exc:
                _end_span(item.span, exc)
                raise
        if self.producers.done():
            self.enter(names.HS_QUEUE_PUT)
            for _ in range(self.num_consumers):
                self.out_q.put(END)


StepFn = Callable[[Batch, TargetOut, PhaseFn], StepResult]


class StepPeers:
    """The drafter.step spans of one optimizer step, one per drafter replica of this
    process, and those of the other ranks' replicas, for the links of each replica's
    drafter.optimizer span.

    Where the replicas' gradients are averaged (dflash.pipeline.distributed.GradAverager),
    no replica's optimizer runs before every replica has finished its backward (a
    barrier in drafter.grad_sync), so each update applies the gradients of all the
    replicas' batches: its span links to the other replicas' drafter.step spans, in
    the traces of those batches. A replica publishes its span when its step starts; one
    that runs ahead publishes the next step's at most, so two steps are kept. The other
    ranks' spans come out of the gradient all-reduce (`set_remote`), read only when a
    recording update asks for them (`remote`): reading them may wait for the device."""

    def __init__(self, replicas: int):
        self._steps: list[dict[int, Link]] = [{} for _ in range(replicas)]
        self._remote: dict[int, Callable[[], list[Link]]] = {}
        self._lock = threading.Lock()

    def publish(self, replica: int, step: int, span: tracing.SpanHandle, batch_id: int) -> None:
        otel_span = span.span
        if otel_span is None:  # no span recorded (tracing off): nothing to link to
            return
        context = otel_span.get_span_context()
        if not (context.is_valid and context.trace_flags.sampled):
            return  # never exported: a link to it would lead nowhere
        attributes = {names.STEP: step, names.BATCH_ID: batch_id}
        link = Link(context, attributes)
        with self._lock:
            steps = self._steps[replica]
            steps[step] = link
            steps.pop(step - 2, None)

    def local(self, step: int) -> list[tuple[int, Link]]:
        """(replica, link) of every replica of this process that published `step`."""
        with self._lock:
            found = ((i, steps.get(step)) for i, steps in enumerate(self._steps))
            return [(i, link) for i, link in found if link is not None]

    def others(self, replica: int, step: int) -> list[Link]:
        """The other replicas' drafter.step spans of `step` (after the barrier: all)."""
        return [link for i, link in self.local(step) if i != replica]

    def set_remote(self, step: int, read: Callable[[], list[Link]]) -> None:
        """The other ranks' drafter.step spans of `step`, as `read()` will make them
        (once, whoever asks first); set before any replica's update of `step` starts."""
        resolved: list[list[Link]] = []
        once = threading.Lock()

        def links() -> list[Link]:
            with once:
                if not resolved:
                    resolved.append(read())
                return resolved[0]

        with self._lock:
            self._remote[step] = links
            self._remote.pop(step - 2, None)

    def remote(self, step: int) -> list[Link]:
        """The other ranks' drafter.step spans of `step` (none where no rank sent any)."""
        with self._lock:
            links = self._remote.get(step)
        return [] if links is None else links()


@dataclass(frozen=True)
class StepInProgress:
    """The step a drafter thread is in: what its gradient sync reads the spans from."""

    peers: StepPeers
    replica: int
    number: int


_in_progress = threading.local()


def step_in_progress() -> StepInProgress | None:
    """The step this drafter thread runs now, where its spans are shared (`StepPeers`)."""
    step: StepInProgress | None = getattr(_in_progress, "step", None)
    return step


@contextmanager
def _linked_update(
    name: str, device: torch.device | str, links: list[Link], remote: Callable[[], list[Link]]
) -> Iterator[tracing.Phase]:
    """The optimizer phase, linked to this process's other replicas' steps when it starts
    and to the other ranks' when it ends: reading those then waits for the all-reduce
    only after the update is queued, not before."""
    with tracing.phase(name, device=device, links=links) as handle:
        yield handle
        span = handle.span
        if span is not None and span.is_recording():
            for link in remote():
                span.add_link(link.context, link.attributes)


class DrafterTrainLoop(StageThread):
    """hs_queue -> step(batch, target_out, phase) on one drafter replica."""

    def __init__(
        self,
        name: str,
        group: StageGroup,
        in_q: HiddenQueue,
        step: StepFn,
        device: torch.device | str,
        counters: PipelineCounters,
        on_step: Callable[[int, Batch, StepResult], None],
        move: MoveFn | None = None,
        first_step: int = 0,
        peers: tuple[StepPeers, int] | None = None,
    ):
        super().__init__(name, group)
        self.in_q, self.step_fn, self.device = in_q, step, device
        self.counters, self.on_step = counters, on_step
        self.move, self.first_step = move, first_step
        self.peers = peers  # (the replicas' step spans, this replica's index)
        self.steps_done = 0

    def _phase(self, name: str) -> AbstractContextManager[object]:
        # The trainer's phases nest under drafter.step (the innermost open phase of
        # this thread); entering them here makes a failure name the exact phase.
        self.enter(name)
        if name == names.OPTIMIZER and self.peers is not None:
            peers, replica = self.peers
            step = self.first_step + self.steps_done
            remote = partial(peers.remote, step)
            return _linked_update(name, self.device, peers.others(replica, step), remote)
        return tracing.phase(name, device=self.device)

    def loop(self) -> None:
        attrs = _thread_attributes(self, self.device)
        while True:
            item = _take(self, self.in_q, self.counters, attrs)
            if isinstance(item, _EndOfStream):
                return
            self.enter(names.DRAFTER_STEP)
            try:
                batch, target_out = item.batch, item.target_out
                if self.move is not None:
                    batch, target_out = self.move(batch, target_out)
                number = self.first_step + self.steps_done
                step_attrs = {**attrs, names.STEP: number, names.BATCH_ID: batch.batch_id}
                with tracing.phase(
                    names.DRAFTER_STEP, level="step", parent=item.span, attributes=step_attrs
                ) as span:
                    if self.peers is not None:
                        peers, replica = self.peers
                        peers.publish(replica, number, span, batch.batch_id)
                        _in_progress.step = StepInProgress(peers, replica, number)
                    try:
                        result = self.step_fn(batch, target_out, self._phase)
                    finally:
                        _in_progress.step = None
            except BaseException as exc:
                _end_span(item.span, exc)
                raise
            # On the root too: a query can compare the ranks' traces of one step.
            item.span.set_attribute(names.STEP, number)
            item.span.end()
            self.counters.add_drafter(batch.num_tokens)
            self.enter(names.DRAFTER_BOOKKEEPING)
            self.on_step(self.steps_done, batch, result)
            self.steps_done += 1


@dataclass
class Pipeline:
    """One prefetcher, target threads and drafter threads around two bounded queues."""

    group: StageGroup
    batch_queue: BatchQueue
    hs_queue: HiddenQueue
    counters: PipelineCounters

    @classmethod
    def build(
        cls,
        *,
        make_batch: Callable[[int], Batch],
        indices: Iterable[int],
        forwards: list[tuple[torch.device | str, Callable[[Batch], TargetOut]]],
        steps: list[tuple[torch.device | str, StepFn, MoveFn]],
        on_step: Callable[[int, int, Batch, StepResult], None],
        batch_queue_size: int,
        hs_queue_size: int,
        span_attributes: Mapping[str, object] | None = None,
        pin_memory: bool = False,
        group: StageGroup | None = None,
        first_step: int = 0,
        target_phase: str = names.TARGET_FORWARD,
        averaged: bool = False,
    ) -> Pipeline:
        """Wire the stages; `on_step(replica, replica_step, batch, result)` after each step.

        `target_phase` names the target threads' phase (target.read for a hidden cache).
        `averaged`: the step functions average their gradients before each update (a
        barrier among them, an all-reduce across ranks), so each drafter.optimizer links
        to the other replicas' drafter.step spans, of this rank and the others
        (`StepPeers`)."""
        group, counters = group or StageGroup(), PipelineCounters()
        batch_q: BatchQueue = BoundedQueue("batch_queue", batch_queue_size, group.stop)
        hs_q: HiddenQueue = BoundedQueue("hs_queue", hs_queue_size, group.stop)
        attributes = span_attributes or {}
        Prefetcher(group, batch_q, make_batch, indices, len(forwards), attributes, pin_memory)
        producers = _Countdown(len(forwards))
        for i, (device, forward) in enumerate(forwards):
            TargetForwardLoop(
                f"target-{i}",
                group,
                batch_q,
                hs_q,
                forward,
                device,
                counters,
                producers=producers,
                num_consumers=len(steps),
                phase_name=target_phase,
            )
        peers = StepPeers(len(steps)) if averaged else None
        for i, (device, step, move) in enumerate(steps):
            report = partial(on_step, i)  # on_step(replica, replica_step, batch, result)
            DrafterTrainLoop(
                f"drafter-{i}",
                group,
                hs_q,
                step,
                device,
                counters,
                report,
                move,
                first_step,
                peers=None if peers is None else (peers, i),
            )
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
                    item.span.set_attribute(names.ABANDONED, True)
                    item.span.end()

    def snapshot(self) -> CounterSnapshot:
        """Read-only counters and the queues' depths now (for reporting threads)."""
        queued = {q.name: q.qsize() for q in (self.batch_queue, self.hs_queue)}
        return self.counters.snapshot(queued_now=queued)

    def raise_if_failed(self) -> None:
        self.group.raise_if_failed()
