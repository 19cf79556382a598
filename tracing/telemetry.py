"""`setup`: the tracer phases record through, exporters and device timing;
`Telemetry.shutdown` undoes it within a time bound. Thread contract: `setup` and
`shutdown` from one thread, `force_flush` from any.

The provider: one passed in (`provider=`; tracing's exporters, if any, join it); else,
with no exporter of tracing's own, the global TracerProvider once the application has
set one (not the API's proxy or no-op default), as OTel instrumentation takes it: its
processors, sampler and resource apply, and it stays the application's (flushed, never
shut down); else one of tracing's own: `Resource.create` with its detectors, the SDK's
sampler (OTEL_TRACES_SAMPLER) unless `sample_ratio` is set, the SDK's batch processor
per exporter. After os.fork a child's tables start empty and it flushes at its exit.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import platform
import socket
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any, TypedDict

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import OsResourceDetector, ProcessResourceDetector, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.util.types import AttributeValue

from tracing import spans
from tracing.config import TracingConfig, warn_once
from tracing.device import DeviceClock, EventResolver, cuda_clock_or_none
from tracing.diagnose import Report
from tracing.export import (
    CountingExporter,
    DeliveryCounts,
    SpanCounter,
    batch_processor,
    build_exporters,
    call_bounded,
    join_closing,
    sdk_disabled,
)
from tracing.fast import FastTracer, PhaseIds, fits
from tracing.stats import ProfileStats

logger = logging.getLogger("tracing")
_lock = threading.Lock()
_active: Telemetry | None = None


def _scope() -> InstrumentationScope:
    """`tracing` with the version of the installed distribution that ships it."""
    for dist in metadata.packages_distributions().get("tracing", []):
        with contextlib.suppress(metadata.PackageNotFoundError):
            return InstrumentationScope("tracing", metadata.version(dist))
    return InstrumentationScope("tracing", "0+unknown")


SCOPE = _scope()


@dataclass(frozen=True)
class ShutdownReport:
    """What became of the spans of one Telemetry, and how long shutdown took."""

    spans_exported: int
    spans_dropped: int  # neither exported nor failed: queue full, or still queued at the bound
    spans_failed: int  # the exporter reported an error (or was closed at the bound)
    device_unresolved: int  # device-timed phases ended without device time
    duration_s: float
    hook_errors: int = 0  # exceptions raised by phase hooks (skipped)
    spans_late: int = 0  # ended after shutdown began (a phase still open then)
    spans_to_application: int = 0  # sampled phases recorded on a provider not tracing's
    application_flushed: bool = True  # that provider's force_flush returned True in time

    @property
    def spans_not_delivered(self) -> int:
        return self.spans_failed + self.spans_dropped

    @property
    def clean(self) -> bool:
        lost = self.spans_not_delivered + self.spans_late + self.device_unresolved
        return not lost and self.application_flushed

    def summary(self) -> str:
        """One line for the log."""
        text = (
            f"tracing: shutdown in {self.duration_s:.2f}s; spans exported {self.spans_exported}, "
            f"failed {self.spans_failed}, dropped {self.spans_dropped} (queue full or left at "
            "the bound)"
        )
        if to_application := self.spans_to_application:
            flushed = "flushed" if self.application_flushed else "not flushed in time"
            text += f", to the application's span processors {to_application} ({flushed})"
        extra = {
            "device timings unresolved": self.device_unresolved,
            "phase hook errors": self.hook_errors,
            "ended after shutdown": self.spans_late,
        }
        text += "".join(f", {what} {n}" for what, n in extra.items() if n)
        return text


class _CountingTracer:
    """The application's tracer, counting the sampled spans phases start through it."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self._tracer, self.sampled = tracer, 0

    def start_span(self, name: str, context: Context | None = None, **options: Any) -> trace.Span:
        # Any: the keywords of the SDK Tracer's start_span, forwarded as they are
        span = self._tracer.start_span(name, context, **options)
        if span.get_span_context().trace_flags.sampled:
            self.sampled += 1  # under the GIL: a race loses one count, never breaks
        return span


class _Provider(TracerProvider):
    """Tracing's own provider: a processor added to it the SDK's way turns phases over
    to the SDK's Tracer, so that processor sees every phase span's `on_start` too."""

    telemetry: Telemetry | None = None

    def add_span_processor(self, span_processor: SpanProcessor) -> None:
        super().add_span_processor(span_processor)
        if self.telemetry is not None:
            self.telemetry._use(self.get_tracer(SCOPE.name, SCOPE.version))

    def _set_tracer_configurator(self, **kwargs: Any) -> None:
        """The SDK's (private, experimental) tracer configuration changes whether a
        tracer records: from here on its Tracer, which asks, records the phases.
        Any: the keywords of that private signature, forwarded as they are (its
        configurator type is private to the SDK and may change between releases)."""
        super()._set_tracer_configurator(**kwargs)
        if self.telemetry is not None:
            self.telemetry._use(self.get_tracer(SCOPE.name, SCOPE.version))


class _HashOnceResource(Resource):
    """A Resource that hashes once: the OTLP encoder hashes the resource of every span,
    and Resource's hash JSON-dumps all its attributes. A Resource never changes."""

    def __init__(self, resource: Resource) -> None:
        super().__init__(resource.attributes, resource.schema_url)
        self._hash = super().__hash__()

    def __hash__(self) -> int:  # Resource's __eq__ stays: only defining __eq__ drops a hash
        return self._hash


_instance_id = str(uuid.uuid4())
"""`service.instance.id` where the SDK makes none (its detector does from 1.4x on)."""
_detected: tuple[int, Resource] | None = None  # (pid, what the detectors found in it)


def detected_resource() -> Resource:
    """Where this process runs: the SDK's public process and OS detectors (`process.pid`,
    `process.executable.*`, `process.runtime.*`, `os.type`, ...) and `host.name`,
    `host.arch` as the SDK's host detector sets them (private in the SDK: `_Host...`).
    Once per process; a detector that fails is logged once and left out."""
    global _detected
    pid = os.getpid()
    if _detected is not None and _detected[0] == pid:
        return _detected[1]
    attributes: dict[str, str] = {}
    with contextlib.suppress(OSError):
        attributes["host.name"] = socket.gethostname()
    if machine := platform.machine():
        attributes["host.arch"] = machine
    resource = Resource(attributes)
    for detector in (ProcessResourceDetector, OsResourceDetector):
        try:
            resource = resource.merge(detector().detect())
        except Exception as exc:  # a resource is worth no failed setup
            warn_once(f"detector {detector.__name__}", f"{detector.__name__} failed: {exc!r}")
    _detected = (pid, resource)
    return resource


def build_resource(cfg: TracingConfig) -> Resource:
    """The resource of every signal of this process: `Resource.create` (its detectors,
    the OTEL_* variables), rank, run id and instance id, and the application's name and
    version where no variable names them (`cfg.service_name` wins over the variables);
    the application's placement of the rank (world size, local and node rank, device,
    config hash) beside its rank; under all of them, `detected_resource()`."""
    ns = cfg.attribute_namespace
    explicit: dict[str, AttributeValue] = {f"{ns}.rank": cfg.rank, f"{ns}.run.id": cfg.run_id}
    placement = {
        "world_size": cfg.world_size,
        "local_rank": cfg.local_rank,
        "node.rank": cfg.node_rank,
        "device.model": cfg.device_model,
        "config.hash": cfg.config_hash,
    }
    explicit.update({f"{ns}.{key}": value for key, value in placement.items() if value is not None})
    if cfg.service_name:
        explicit["service.name"] = cfg.service_name
    resource = detected_resource().merge(Resource.create(explicit))
    named = resource.attributes
    fallback: dict[str, str] = {"service.instance.id": _instance_id}
    if cfg.service_version:
        fallback["service.version"] = cfg.service_version
    fallback = {key: value for key, value in fallback.items() if key not in named}
    if cfg.default_service_name and str(named.get("service.name")).startswith("unknown_service"):
        fallback["service.name"] = cfg.default_service_name
    return _HashOnceResource(resource.merge(Resource(fallback)))


class _RuntimeArgs(TypedDict, total=False):
    """The keywords of `spans.Runtime` that `setup` chose, beside its stats and tracer."""

    level_rank: int
    clock: DeviceClock | None
    sync: bool
    resolver: EventResolver | None
    propagate: bool
    stop_exceptions: tuple[type[BaseException], ...]
    hooks: tuple[object, ...]


class Telemetry:
    """The installed tracing state of this process. Create with `setup`."""

    def __init__(self, cfg: TracingConfig, stats: ProfileStats) -> None:
        self.cfg, self.stats = cfg, stats
        self.provider: Any = None  # the TracerProvider phases record through (None: off)
        self.own_provider = False
        self.exporters: list[CountingExporter] = []
        self.sinks: list[str] = []  # where tracing's exporters send, in words
        self.disabled_by: str | None = None  # the variable that turned every signal off
        self.counter: SpanCounter | None = None
        self.resolver: EventResolver | None = None
        self.cuda_timing = "off"  # the device timing in force (off after a fallback)
        self.tracer: spans.PhaseTracer = None  # None: phases record no span
        self._runtime_args: _RuntimeArgs = {}
        self._report: ShutdownReport | None = None
        self._shutdown_lock = threading.Lock()
        self._hook_errors_before = spans.HOOK_ERRORS.count

    @property
    def resource(self) -> Resource:
        """The resource of the phase spans (the application's, on its provider)."""
        if isinstance(self.provider, TracerProvider):
            return self.provider.resource
        return build_resource(self.cfg)

    @property
    def tracing_spans(self) -> bool:
        return self.tracer is not None

    @property
    def sampler(self) -> str:
        """The sampler of the provider phases record through, in the SDK's words."""
        if isinstance(self.provider, TracerProvider):
            return self.provider.sampler.get_description()
        return "none" if self.provider is None else "the provider's"

    def _use(self, tracer: spans.PhaseTracer) -> None:
        """Phases record through `tracer` from now on."""
        self.tracer = tracer
        with _lock:
            if _active is self:
                spans.install(spans.Runtime(self.stats, tracer, **self._runtime_args))

    def force_flush(self, timeout_s: float = 1.0) -> bool:
        """Exports what is queued; waits at most `timeout_s`. True only when nothing is
        left: no device timing unresolved, no span queued, every export succeeded."""
        deadline = time.monotonic() + timeout_s
        resolver = self.resolver
        while resolver is not None and resolver.pending and time.monotonic() < deadline:
            time.sleep(0.001)  # device-timed spans reach the queue once resolved
        if resolver is not None and resolver.pending:
            return False
        if not isinstance(self.provider, TracerProvider):
            return True
        failed = self.delivery_counts().failed
        left_s = max(0.0, deadline - time.monotonic())
        flushed = call_bounded(self.provider.force_flush, left_s, int(left_s * 1e3))
        counts = self.delivery_counts()
        return bool(flushed) and counts.failed == failed and not counts.dropped

    def delivery_counts(self) -> DeliveryCounts:
        counter = self.counter
        return counter.counts(self.exporters) if counter is not None else DeliveryCounts()

    def shutdown(self, timeout_s: float | None = None) -> ShutdownReport:
        """Flushes and closes everything within `timeout_s` (default cfg.shutdown_timeout_s);
        idempotent. After it `phase` feeds the default ProfileStats only."""
        with self._shutdown_lock:
            if self._report is None:
                bound_s = self.cfg.shutdown_timeout_s if timeout_s is None else timeout_s
                self._report = self._shutdown(bound_s)
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
        if self.counter is not None:
            self.counter.closed = True
        provider, application = self.provider, isinstance(self.tracer, _CountingTracer)
        flushed = True
        if self.own_provider:
            closing = threading.Thread(target=provider.shutdown, name="tracing-close", daemon=True)
            closing.start()
            # An exporter whose endpoint is known unreachable is closed at once, not waited for.
            until = time.monotonic() + max(0.0, deadline - time.monotonic()) * 0.8
            join_closing(closing, until, self.exporters)
            for exporter in self.exporters:  # a hung export: abort its retries, drop the rest
                call_bounded(exporter.close, max(0.0, deadline - time.monotonic()))
            closing.join(max(0.0, deadline - time.monotonic()))
        elif application and isinstance(provider, TracerProvider):
            left_s = max(0.0, deadline - time.monotonic())
            flushed = bool(call_bounded(provider.force_flush, left_s, int(left_s * 1e3)))
        counts = self.delivery_counts()
        return ShutdownReport(
            spans_exported=counts.exported,
            spans_dropped=counts.dropped,
            spans_failed=counts.failed,
            device_unresolved=unresolved,
            duration_s=time.monotonic() - started,
            hook_errors=spans.HOOK_ERRORS.count - self._hook_errors_before,
            spans_late=counts.late,
            spans_to_application=self.tracer.sampled if application else 0,
            application_flushed=flushed,
        )

    def _shutdown_at_exit(self) -> None:
        report = self.shutdown()
        if not report.clean:
            logger.warning("%s", report.summary())


def _application_provider() -> trace.TracerProvider | None:
    """The global TracerProvider when the application has set one, else None."""
    provider = trace.get_tracer_provider()
    if isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        return None
    return provider


def setup(
    cfg: TracingConfig | None = None,
    *,
    stats: ProfileStats | None = None,
    provider: trace.TracerProvider | None = None,
    exporters: Sequence[SpanExporter] = (),
    span_processors: Sequence[SpanProcessor] = (),
    device_clock: DeviceClock | None = None,
    install_global_provider: bool = False,
    propagate_context: bool | None = None,
    stop_exceptions: tuple[type[BaseException], ...] = (),
    phase_hooks: Sequence[object] = (),
    on_export_problem: Report | None = None,
) -> Telemetry:
    """Configures tracing for this process (shutting a previous setup down first).
    `exporters`: more exporters, each behind the SDK's batch processor, counted in the
    report; `span_processors` are added as they are. `install_global_provider`: tracing's
    own provider becomes the global one unless the application has set one.
    `device_clock` replaces the CUDA clock (a HostClock in tests). `propagate_context`:
    each phase is the current OTel span while it runs. A phase ended by one of
    `stop_exceptions` (a requested stop) is not marked ERROR. `phase_hooks`
    (tracing.hooks.PhaseHook) see every phase, sampled or not. `on_export_problem` gets
    the line that tells a failing OTLP export and its likely cause, within seconds of
    its first failed attempt (default: a warning on the `tracing` logger)."""
    global _active
    cfg = TracingConfig() if cfg is None else cfg
    if _active is not None:
        _active.shutdown(timeout_s=1.0)
    telemetry = Telemetry(cfg, stats if stats is not None else ProfileStats(rank=cfg.rank))
    if sdk_disabled():
        telemetry.disabled_by = "OTEL_SDK_DISABLED=true"
    if cfg.level != "off":
        built, telemetry.sinks = build_exporters(cfg, on_export_problem)
        built += exporters
        _choose_tracer(telemetry, provider, built, span_processors, install_global_provider)
    clock = None
    if cfg.cuda_timing != "off":
        clock = device_clock if device_clock is not None else cuda_clock_or_none(cfg.cuda_timing)
    if clock is not None:
        telemetry.cuda_timing = cfg.cuda_timing
        if cfg.cuda_timing == "events":
            telemetry.resolver = EventResolver(clock)
    propagate = cfg.propagate_context if propagate_context is None else propagate_context
    telemetry._runtime_args = {
        "level_rank": spans.LEVEL_RANK[cfg.level],
        "clock": clock,
        "sync": cfg.cuda_timing == "sync",
        "resolver": telemetry.resolver,
        "propagate": propagate,
        "stop_exceptions": tuple(stop_exceptions),
        "hooks": tuple(phase_hooks),
    }
    with _lock:
        _active = telemetry
    telemetry._use(telemetry.tracer)
    if isinstance(telemetry.provider, _Provider):
        telemetry.provider.telemetry = telemetry
    atexit.register(telemetry._shutdown_at_exit)
    return telemetry


def _choose_tracer(
    telemetry: Telemetry,
    provider: Any,
    exporters: list[SpanExporter],
    processors: Sequence[SpanProcessor],
    install_global: bool,
) -> None:
    """Sets telemetry.provider, .tracer and .exporters (module docstring: which provider).
    Any: `provider` is the API's TracerProvider or the SDK's; the branches that add
    processors or read its sampler are reached with the SDK's alone (`own`, isinstance),
    which mypy cannot follow."""
    if provider is None and not exporters and not processors:
        provider = _application_provider()
    own = provider is None
    if own:
        ratio = telemetry.cfg.sample_ratio
        sampler = None if ratio is None else ParentBased(TraceIdRatioBased(ratio))
        resource = build_resource(telemetry.cfg)
        provider = _Provider(
            resource=resource, sampler=sampler, shutdown_on_exit=False, id_generator=PhaseIds()
        )
    telemetry.provider, telemetry.own_provider = provider, own
    sdk_tracer = provider.get_tracer(SCOPE.name, SCOPE.version)
    if isinstance(sdk_tracer, trace.NoOpTracer):  # OTEL_SDK_DISABLED=true: no spans at all
        return
    if (exporters or processors) and not isinstance(provider, TracerProvider):
        message = f"{type(provider).__name__} takes no span processors: tracing's are not used"
        warn_once("provider", message)
        exporters, processors = [], ()
    ours: list[SpanProcessor] = []
    if exporters:
        telemetry.counter = SpanCounter()  # first: it counts a span before any exports it
        telemetry.exporters = [CountingExporter(exporter) for exporter in exporters]
        ours = [telemetry.counter, *(batch_processor(e) for e in telemetry.exporters)]
    for processor in [*ours, *processors]:
        provider.add_span_processor(processor)
    if not own:
        telemetry.tracer = _CountingTracer(sdk_tracer)
    elif processors or not isinstance(provider.sampler, ParentBased):
        telemetry.tracer = sdk_tracer
    elif ours:  # tracing's own processors alone: the fast stand-in where it fits
        fast = fits(sdk_tracer, ours)
        telemetry.tracer = FastTracer(provider, ours, SCOPE, sdk_tracer) if fast else sdk_tracer
    if own and install_global and _application_provider() is None:
        trace.set_tracer_provider(provider)


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


def _after_fork_in_child() -> None:
    """In the child (one thread): device timing stops (CUDA does not survive a fork), the
    counts start at 0. A multiprocessing child leaves through os._exit after finalizers
    it registers after fork: its flush at exit is registered there."""
    global _lock, _instance_id
    _lock = threading.Lock()  # the parent may have held it while forking
    _instance_id = str(uuid.uuid4())
    telemetry = _active
    if telemetry is None or telemetry._report is not None:
        return
    telemetry._shutdown_lock = threading.Lock()
    telemetry.resolver = None
    for exporter in telemetry.exporters:  # the parent's spans are the parent's to count
        exporter.exported = exporter.failed = 0
    if telemetry.counter is not None:
        telemetry.counter.reset()
    args = telemetry._runtime_args
    telemetry._runtime_args = {**args, "clock": None, "resolver": None, "hooks": ()}
    telemetry._use(telemetry.tracer)
    mp_util = sys.modules.get("multiprocessing.util")
    if mp_util is not None:
        mp_util.register_after_fork(telemetry, _finalize_at_child_exit)


def _finalize_at_child_exit(telemetry: Telemetry) -> None:
    finalize = sys.modules["multiprocessing.util"].Finalize  # it is calling this
    finalize(telemetry, Telemetry._shutdown_at_exit, args=(telemetry,), exitpriority=10)


os.register_at_fork(after_in_child=_after_fork_in_child)
