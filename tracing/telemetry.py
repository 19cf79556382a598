"""`setup`: builds the tracer provider, exporters and device timing from a TracingConfig
and installs them for `phase`; `Telemetry.shutdown` undoes it within a time bound."""

from __future__ import annotations

import atexit
import importlib.metadata
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import (
    TELEMETRY_SDK_LANGUAGE,
    TELEMETRY_SDK_NAME,
    TELEMETRY_SDK_VERSION,
    Resource,
)
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from tracing import spans
from tracing.config import TracingConfig
from tracing.device import DeviceClock, EventResolver, cuda_clock_or_none
from tracing.export.exporters import build_exporters
from tracing.export.ledger import ForkLedger
from tracing.export.processor import BoundedBatchSpanProcessor, DeliveryCounts
from tracing.record import HOOK_ERRORS, PhaseIds, Recorder
from tracing.stats import ProfileStats

logger = logging.getLogger("tracing")
_lock = threading.Lock()
_active: Telemetry | None = None


@dataclass(frozen=True)
class ShutdownReport:
    """What became of the spans of one Telemetry, and how long shutdown took."""

    spans_exported: int
    spans_dropped: int
    """Never queued: the export queue was full (collector too slow or unreachable)."""
    spans_failed: int
    """Sent, but the exporter reported an error."""
    spans_pending: int
    """Still queued when the time bound ran out."""
    device_unresolved: int
    """Device-timed phases whose events did not complete in time (ended without device time)."""
    duration_s: float
    hook_errors: int = 0
    """Exceptions raised by phase hooks while this Telemetry was installed (skipped)."""
    spans_late: int = 0
    """Ended after shutdown began, before this report (a phase still open then): not
    exported. Later ones are counted by `Telemetry.delivery_counts().late`."""
    children_lost: int = 0
    """Forked children that ended without flushing (killed: `Pool.__exit__` terminates)."""
    spans_lost_in_children: int = 0
    """Spans those children queued and never exported (tracing.export.ledger)."""

    @property
    def spans_not_delivered(self) -> int:
        return self.spans_failed + self.spans_pending

    @property
    def clean(self) -> bool:
        return not (
            self.spans_dropped or self.spans_not_delivered or self.device_unresolved
            or self.spans_late or self.spans_lost_in_children
        )  # fmt: skip

    def summary(self) -> str:
        """One line for the log."""
        text = (
            f"tracing: shutdown in {self.duration_s:.2f}s; spans exported {self.spans_exported}, "
            f"dropped {self.spans_dropped} (queue full), not delivered {self.spans_not_delivered} "
            f"(failed {self.spans_failed}, pending {self.spans_pending})"
        )
        if self.device_unresolved:
            text += f", device timings unresolved {self.device_unresolved}"
        if self.hook_errors:
            text += f", phase hook errors {self.hook_errors}"
        if self.spans_late:
            text += f", ended after shutdown {self.spans_late}"
        if self.children_lost:
            text += (
                f", lost in {self.children_lost} forked children killed before flushing "
                f"{self.spans_lost_in_children}"
            )
        return text

    def __str__(self) -> str:
        return self.summary()


class Telemetry:
    """The installed tracing state of this process. Create with `setup`."""

    def __init__(
        self,
        cfg: TracingConfig,
        stats: ProfileStats,
        provider: TracerProvider | None,
        processors: list[BoundedBatchSpanProcessor],
        resolver: EventResolver | None,
        built_exporters: int = 0,
    ) -> None:
        """`built_exporters`: how many of `processors` (the first ones) export to an
        exporter built from `cfg` (rebuilt in a forked child)."""
        self.cfg = cfg
        self.stats = stats
        self.provider = provider
        self.processors = processors
        self.resolver = resolver
        self._built_exporters = built_exporters
        self._report: ShutdownReport | None = None
        self._shutdown_lock = threading.Lock()
        self._hook_errors_before = HOOK_ERRORS.count
        self.ledger = ForkLedger() if processors else None

    @property
    def tracing_spans(self) -> bool:
        """Whether phases create spans (a provider exists and the level is not off)."""
        return self.provider is not None

    def force_flush(self, timeout_s: float = 1.0) -> bool:
        """Exports what is queued; waits at most `timeout_s`. True only when nothing is
        left: no device timing unresolved, no span queued, every export succeeded."""
        if self.provider is None:
            return True
        deadline = time.monotonic() + timeout_s
        resolver = self.resolver
        while resolver is not None and resolver.pending and time.monotonic() < deadline:
            time.sleep(0.001)  # device-timed spans reach the queue once resolved
        if resolver is not None and resolver.pending:
            return False
        left_ms = max(0.0, deadline - time.monotonic()) * 1e3
        return self.provider.force_flush(int(left_ms)) and not self.delivery_counts().pending

    def delivery_counts(self) -> DeliveryCounts:
        total = DeliveryCounts()
        for processor in self.processors:
            total += processor.counts()
        return total

    def shutdown(self, timeout_s: float | None = None) -> ShutdownReport:
        """Flushes and closes everything within `timeout_s` (default cfg.shutdown_timeout_s).

        Idempotent: later calls return the first report. After it, `phase` only feeds
        the default ProfileStats.
        """
        with self._shutdown_lock:
            if self._report is None:
                self._report = self._shutdown(
                    self.cfg.shutdown_timeout_s if timeout_s is None else timeout_s
                )
        return self._report

    def _shutdown(self, timeout_s: float) -> ShutdownReport:
        started = time.monotonic()
        deadline = started + timeout_s * 0.95  # headroom for the bookkeeping below
        global _active
        with _lock:
            if _active is self:
                spans.install(spans.Runtime(spans.DEFAULT_STATS))
                _active = None
        atexit.unregister(self._shutdown_at_exit)
        unresolved = 0
        if self.resolver is not None:
            # Device events get at most a third of the budget; spans still need exporting.
            unresolved = self.resolver.stop(max(0.0, deadline - time.monotonic()) / 3)
        total = DeliveryCounts()
        for index, processor in enumerate(self.processors):
            share_s = max(0.0, deadline - time.monotonic()) / (len(self.processors) - index)
            total += processor.shutdown_counted(share_s)
        if self.provider is not None:
            # Our processors return at once now; others (e.g. a test's) get what is left.
            _shutdown_provider(self.provider, max(0.0, deadline - time.monotonic()))
        children_lost, spans_lost = self.ledger.lost() if self.ledger is not None else (0, 0)
        if self.ledger is not None and self.ledger.slot is not None:
            self.ledger.slot.close()  # this child reported its own spans
        return ShutdownReport(
            spans_exported=total.exported,
            spans_dropped=total.dropped,
            spans_failed=total.failed,
            spans_pending=total.pending,
            device_unresolved=unresolved,
            duration_s=time.monotonic() - started,
            hook_errors=HOOK_ERRORS.count - self._hook_errors_before,
            spans_late=total.late,
            children_lost=children_lost,
            spans_lost_in_children=spans_lost,
        )

    def _shutdown_at_exit(self) -> None:
        report = self.shutdown()
        if not report.clean:
            logger.warning("%s (pid %d)", report.summary(), os.getpid())

    def _reinit_after_fork(self) -> None:
        """In a forked child (one thread, the forking one): the export threads, locks and
        exporters that cannot cross a fork start anew; the parent's queued spans stay the
        parent's. Device timing stops (CUDA does not survive a fork). At the child's exit
        its spans are flushed within the shutdown bound, or reported as not delivered."""
        self._shutdown_lock = threading.Lock()
        if self._report is not None:
            return
        runtime = spans.runtime()
        if runtime.recorder is not None:  # the child is a process of its own
            runtime.recorder.resource = _child_resource(runtime.recorder.resource, self.cfg)
        fresh = build_exporters(self.cfg, pid_suffix=True)
        slot = self.ledger.slot_for_this_child() if self.ledger is not None else None
        for index, processor in enumerate(self.processors):
            processor.reinit_after_fork(fresh[index] if index < self._built_exporters else None)
            processor.ledger_slot = slot
        if self.ledger is not None:
            self.ledger = ForkLedger()  # this child's own children
            self.ledger.slot = slot
        self.resolver = None
        spans.install(
            spans.Runtime(
                self.stats,
                recorder=runtime.recorder,
                level_rank=runtime.level_rank,
                propagate=runtime.propagate,
                stop_exceptions=runtime.stop_exceptions,
            )
        )
        # A multiprocessing child leaves through os._exit, after running its finalizers;
        # it clears them when it starts, then calls its after-fork hooks: register there.
        mp_util = sys.modules.get("multiprocessing.util")
        if mp_util is not None:
            mp_util.register_after_fork(self, _finalize_at_child_exit)


def _finalize_at_child_exit(telemetry: Telemetry) -> None:
    import multiprocessing.util

    multiprocessing.util.Finalize(
        telemetry, Telemetry._shutdown_at_exit, args=(telemetry,), exitpriority=10
    )


def _shutdown_provider(provider: TracerProvider, timeout_s: float) -> None:
    thread = threading.Thread(target=provider.shutdown, name="tracing-provider-close", daemon=True)
    thread.start()
    thread.join(timeout_s)


class _HashOnceResource(Resource):
    """A Resource that computes its hash once. The OTLP encoder groups spans by resource
    and so hashes it for every span, and Resource's hash JSON-dumps all its attributes:
    about a tenth of the export thread's time per span. A Resource never changes."""

    def __init__(self, attributes: dict[str, object], schema_url: str | None = None) -> None:
        super().__init__(attributes, schema_url)  # type: ignore[arg-type]
        self._hash = super().__hash__()

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return super().__eq__(other)


class _Provider(TracerProvider):
    """The tracer provider `setup` returns: a span processor added to it later also gets
    every ended phase span (phases are recorded without SDK span objects, tracing.record),
    and its sampler decides each new trace of phases."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._phase_sink: Callable[[SpanProcessor], None] | None = None

    def send_phases_to(self, sink: Callable[[SpanProcessor], None]) -> None:
        """From now on each added processor is also handed to `sink`."""
        self._phase_sink = sink

    def add_span_processor(self, span_processor: SpanProcessor) -> None:
        super().add_span_processor(span_processor)
        if self._phase_sink is not None:
            self._phase_sink(span_processor)


def _child_resource(parent: Resource, cfg: TracingConfig) -> Resource:
    """A forked child's resource: its own `process.pid` and a fresh `service.instance.id`
    (unless the user named one in OTEL_RESOURCE_ATTRIBUTES)."""
    attributes = {**parent.attributes, "process.pid": os.getpid()}
    if "service.instance.id" not in cfg.resource_attributes:
        attributes["service.instance.id"] = str(uuid.uuid4())
    return _HashOnceResource(attributes, parent.schema_url)


def build_resource(cfg: TracingConfig) -> Resource:
    """The resource of every signal of this process (traces and metrics share it)."""
    attributes = {
        "host.name": socket.gethostname(),
        "process.pid": os.getpid(),
        **cfg.resource_attributes,
        "service.name": cfg.service_name,
        "service.instance.id": cfg.service_instance_id,
        f"{cfg.attribute_namespace}.rank": cfg.rank,
        f"{cfg.attribute_namespace}.run.id": cfg.run_id,
    }
    # Not Resource.create: it reads os.environ again, so a malformed OTEL_RESOURCE_ATTRIBUTES
    # the config warned about and left out, or the process environment under an explicit
    # config or `from_env(environ=...)`, would still reach the resource. The config has
    # merged OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME already.
    sdk = {
        TELEMETRY_SDK_LANGUAGE: "python",
        TELEMETRY_SDK_NAME: "opentelemetry",
        TELEMETRY_SDK_VERSION: importlib.metadata.version("opentelemetry-sdk"),
    }
    return _HashOnceResource({**sdk, **attributes})


def setup(
    cfg: TracingConfig | None = None,
    *,
    stats: ProfileStats | None = None,
    exporters: Sequence[SpanExporter] = (),
    span_processors: Sequence[SpanProcessor] = (),
    device_clock: DeviceClock | None = None,
    install_global_provider: bool = False,
    propagate_context: bool | None = None,
    stop_exceptions: tuple[type[BaseException], ...] = (),
    phase_hooks: Sequence[object] = (),
) -> Telemetry:
    """Configures tracing for this process and makes `phase(...)` use it.

    `exporters` are extra exporters behind bounded batch processors (counted in the
    shutdown report); `span_processors` are added as they are (e.g. a
    SimpleSpanProcessor around an InMemorySpanExporter in tests), and so is a processor
    added to `telemetry.provider` later: they get each sampled phase span through
    `on_end`, on the ending thread (phases do not call `on_start`: they are not SDK
    spans until they end), besides the provider's own SDK spans. The provider's sampler
    (`telemetry.provider.sampler`) decides each new trace; its id generator is the
    phases' id source. `device_clock`
    replaces the CUDA clock (a HostClock in tests). `propagate_context` (default
    cfg.propagate_context) makes each phase with a span the current OTel span while it
    runs. A phase ended by one of `stop_exceptions` (e.g. the application's "stop
    requested" exception, KeyboardInterrupt) is not marked ERROR: a stop is not an
    error. `phase_hooks` (tracing.hooks.PhaseHook: a Timeline, NvtxRanges) see every
    phase start and end, sampled or not, on its thread. A previous setup is shut down first.
    """
    cfg = TracingConfig.from_env() if cfg is None else cfg
    previous = _active
    if previous is not None:
        previous.shutdown(timeout_s=1.0)
    stats = stats if stats is not None else ProfileStats(rank=cfg.rank)
    tracing_on = cfg.level != "off"
    resource = build_resource(cfg) if tracing_on else None
    built = build_exporters(cfg) if tracing_on else []
    all_exporters = [*built, *exporters]
    provider = None
    recorder = None
    processors: list[BoundedBatchSpanProcessor] = []
    if tracing_on and (all_exporters or span_processors):
        # The provider serves other tracers (install_global_provider) and flush/shutdown;
        # phases record through `recorder`, with the same resource, sampling and processors.
        provider = _Provider(
            resource=resource,
            sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)),
            shutdown_on_exit=False,  # its atexit hook would wait the SDK's 30 s default
            id_generator=PhaseIds(),
        )
        for index, exporter in enumerate(all_exporters):
            processor = BoundedBatchSpanProcessor(
                exporter,
                max_queue_size=cfg.max_queue_size,
                max_batch_size=cfg.max_export_batch_size,
                schedule_delay_s=cfg.schedule_delay_s,
                name=f"tracing-export-{index}",
            )
            processors.append(processor)
            provider.add_span_processor(processor)
        for processor in span_processors:
            provider.add_span_processor(processor)
        recorder = Recorder(
            cfg.sample_ratio,
            provider.resource,
            appends=[processor.on_end_record for processor in processors],
            sync_processors=span_processors,
            provider=provider,
        )
        provider.send_phases_to(recorder.add_sync_processor)
        if install_global_provider:
            trace.set_tracer_provider(provider)
    clock = None
    if cfg.cuda_timing != "off":
        clock = device_clock if device_clock is not None else cuda_clock_or_none(cfg.cuda_timing)
    resolver = EventResolver(clock) if clock is not None and cfg.cuda_timing == "events" else None
    telemetry = Telemetry(cfg, stats, provider, processors, resolver, len(built))
    propagate = cfg.propagate_context if propagate_context is None else propagate_context
    _install(telemetry, recorder, clock, propagate, tuple(stop_exceptions), tuple(phase_hooks))
    return telemetry


def _install(
    telemetry: Telemetry,
    recorder: Recorder | None,
    clock: DeviceClock | None,
    propagate: bool,
    stop_exceptions: tuple[type[BaseException], ...],
    hooks: tuple[object, ...] = (),
) -> None:
    global _active
    cfg = telemetry.cfg
    runtime = spans.Runtime(
        telemetry.stats,
        recorder=recorder,
        level_rank=spans.LEVEL_RANK[cfg.level],
        clock=clock,
        sync=cfg.cuda_timing == "sync",
        resolver=telemetry.resolver,
        propagate=propagate,
        stop_exceptions=stop_exceptions,
        hooks=hooks,
    )
    with _lock:
        _active = telemetry
        spans.install(runtime)
    atexit.register(telemetry._shutdown_at_exit)


def active() -> Telemetry | None:
    """The Telemetry installed by the last `setup`, or None."""
    return _active


def get_stats() -> ProfileStats:
    """The ProfileStats that `phase` feeds now (the default one before `setup`)."""
    return spans.runtime().stats


def shutdown(timeout_s: float | None = None) -> ShutdownReport | None:
    """Shuts down the active Telemetry, if any."""
    telemetry = _active
    return None if telemetry is None else telemetry.shutdown(timeout_s)


def _before_fork() -> None:
    telemetry = _active
    if telemetry is not None and telemetry.ledger is not None:
        telemetry.ledger.before_fork()
        _forking.append(telemetry.ledger)


def _after_fork_in_parent() -> None:
    while _forking:
        _forking.pop().after_fork_in_parent()


_forking: list[ForkLedger] = []


def _after_fork_in_child() -> None:
    _forking.clear()
    global _lock
    _lock = threading.Lock()  # the parent may have held it while forking
    telemetry = _active
    if telemetry is not None:
        try:
            telemetry._reinit_after_fork()
        except Exception:  # telemetry never crashes the host program
            logger.exception("tracing: could not restart tracing in the forked child")


os.register_at_fork(
    before=_before_fork,
    after_in_parent=_after_fork_in_parent,
    after_in_child=_after_fork_in_child,
)
