"""tracing: time the phases of a PyTorch program as OpenTelemetry spans and ProfileStats.

A reusable library (it never imports dflash; torch is imported only for device timing).

Setup and shutdown
    cfg = TracingConfig.from_env(default_service_name="my-app", exporter="otlp",
                                 otlp_endpoint="http://localhost:4317", rank=0, run_id=...)
        Standard OTEL_* variables apply (docs/observability.md has the table); keyword
        arguments that are not None win, except OTEL_SDK_DISABLED=true, which wins over
        all. A bad argument raises TracingConfigError (one line naming the value); a bad
        variable is logged once and treated as unset. With no endpoint, nothing is sent
        over the network. Resource: service.name, a service.instance.id unique per
        process, telemetry.sdk.*, `<attribute_namespace>.rank` and `.run.id`.
    telemetry = setup(cfg=None, *, stats=None, exporters=(), span_processors=(),
                      device_clock=None, install_global_provider=False,
                      propagate_context=None, stop_exceptions=()) -> Telemetry
    telemetry.stats                      the ProfileStats every phase feeds
    telemetry.force_flush(timeout_s=1.0) -> bool   (True only when nothing is left queued)
    report = telemetry.shutdown(timeout_s=None) -> ShutdownReport   (bounded; idempotent)
    report.summary() -> str              one line: exported / dropped / not delivered / seconds
    shutdown(timeout_s=None), active(), get_stats()   module-level equivalents
    now_ns()                             the clock of every phase (monotonic, epoch-anchored)
    After os.fork the child restarts export (fresh thread, its own trace file PATH.pidN,
    flushed at its exit), its stats start empty, span ids are re-seeded.

Phases (hot path)
    with phase(name, *, level="phase", parent=None, start_time_ns=None, attributes=None,
               device=None, stats=None, propagate=None) as p:   # also @phase("name")
        p.set_attribute("tokens", n)
    - Always feeds ProfileStats (exact counts even when the trace is not sampled).
    - Records a span when setup installed a provider and `level` <= cfg.level
      (off < step < phase); otherwise it costs a couple of clock reads and one `add`.
    - `parent`: an OTel Context or a SpanHandle; None means the innermost open phase of
      this thread, else the current OTel context.
    - `start_time_ns` (tracing.now_ns()): for wait spans opened after the wait ended. The
      stats get the whole duration; the exported span starts no earlier than its parent.
    - An exception marks the span ERROR with an exception event, then propagates.
    - A phase object may be entered again and from several threads: each entry is its
      own measurement (use the object `with` returns). Misuse is logged, never raised.
    - `propagate` (default: setup's propagate_context): the phase is the current OTel
      span while it runs, so OTel-instrumented code inside nests under it.
    - `device` (e.g. "cuda:0"): with cfg.cuda_timing "sync" the device is synchronized at
      both ends; with "events" device events are recorded and resolved on a background
      thread, which adds `tracing.device.duration_s` to the span, `<name>@device` to the
      stats and ends the span at its original host end time. Without CUDA: one warning,
      "off".

Spans that cross threads
    h = start_span(name, attributes=None, *, parent=None, start_time_ns=None, level="step",
                   stats=None) -> SpanHandle         # parent=None starts a new trace
    h.context (give it to other threads as `parent=`), h.set_attribute(k, v),
    h.record_exception(exc), h.end(end_time_ns=None) (any thread; duration goes to the
    stats as a cross-thread entry without a share).

ProfileStats
    stats.add(name, seconds, thread=<current>); stats.snapshot() / stats.take_interval()
    -> StatsSnapshot (count, total, min, max, mean, p50, p95 per name);
    snapshot.thread_shares(name) -> {thread: its seconds in name / its own wall time},
    snapshot.threads_of(*names), snapshot.share(name, threads=None) (mean over threads);
    snapshot.to_dict() / StatsSnapshot.from_dict(d) / StatsSnapshot.merge(snaps);
    format_table(snap, title=None, rank_snapshots=None) (per-rank min/max columns),
    format_compact(snap); str(stats) is the classic one-line-per-name printout.

Reporter
    r = Reporter(stats, interval_s=30.0, *, stream=None, log=None, verdict=None).start()
    r.add_rate("target tok/s", counter_fn, unit="tok/s"); r.add_gauge("hs_queue", depth_fn)
    r.set_verdict(fn(snapshot) -> str | None); r.stop(final=True) prints the cumulative
    table; r.install_exit_hooks() adds atexit + a chaining sys.excepthook (signals stay
    with the application, which calls stop()).

Device clocks
    DeviceClock protocol; CudaClock (torch.cuda events); HostClock (host-clock fake for tests).
"""

from tracing.clock import now_ns
from tracing.config import TracingConfig, TracingConfigError
from tracing.device import CudaClock, DeviceClock, EventResolver, HostClock
from tracing.export.exporters import OtlpJsonFileExporter
from tracing.export.processor import BoundedBatchSpanProcessor, DeliveryCounts
from tracing.format import DEVICE_SUFFIX, format_compact, format_duration, format_table
from tracing.reporter import Reporter
from tracing.snapshot import PhaseStats, StatsSnapshot
from tracing.spans import Phase, SpanHandle, current_phase, phase, start_span
from tracing.stats import NO_THREAD, ProfileStats
from tracing.telemetry import ShutdownReport, Telemetry, active, get_stats, setup, shutdown

__all__ = [
    "DEVICE_SUFFIX",
    "NO_THREAD",
    "BoundedBatchSpanProcessor",
    "CudaClock",
    "DeliveryCounts",
    "DeviceClock",
    "EventResolver",
    "HostClock",
    "OtlpJsonFileExporter",
    "Phase",
    "PhaseStats",
    "ProfileStats",
    "Reporter",
    "ShutdownReport",
    "SpanHandle",
    "StatsSnapshot",
    "Telemetry",
    "TracingConfig",
    "TracingConfigError",
    "active",
    "current_phase",
    "format_compact",
    "format_duration",
    "format_table",
    "get_stats",
    "now_ns",
    "phase",
    "setup",
    "shutdown",
    "start_span",
]
