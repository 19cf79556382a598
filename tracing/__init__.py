"""tracing: time the phases of a PyTorch program as OpenTelemetry spans and ProfileStats.

A library written as OTel instrumentation is (it never imports dflash; torch only for
device timing): phases record through the application's TracerProvider once it has set
one, and the SDK reads the OTEL_* variables itself (docs/observability.md).

Setup and shutdown
    telemetry = setup(TracingConfig(default_service_name="my-app", rank=0, run_id=...),
                      provider=None, exporters=(), span_processors=(), device_clock=None,
                      install_global_provider=False, propagate_context=None,
                      stop_exceptions=(), phase_hooks=())
        The provider: the one passed, else the application's global one (when tracing
        has no exporter of its own), else tracing's own (tracing.telemetry). Nothing is
        sent over the network unless an endpoint or exporter is named.
    telemetry.stats, telemetry.provider, telemetry.resource, telemetry.cuda_timing
    telemetry.force_flush(timeout_s=1.0) -> bool   (True only when nothing is left queued)
    report = telemetry.shutdown(timeout_s=None) -> ShutdownReport   (bounded; idempotent)
    shutdown(timeout_s=None), active(), get_stats(), now_ns()

Phases (hot path)
    with phase(name, *, level="phase", parent=None, start_time_ns=None, attributes=None,
               device=None, stats=None, propagate=None) as p:   # also @phase("name")
        p.set_attribute("tokens", n)     # taken now: numpy to Python, a tensor refused
    - Always feeds ProfileStats (exact counts even when the trace is not sampled); records
      a span at an enabled `level` (off < step < phase) once setup chose a tracer.
    - `parent`: an OTel Context or a SpanHandle; None means the innermost open phase of
      this thread, else the current OTel context.
    - `start_time_ns` (now_ns()): for waits opened after the wait ended; the stats get the
      whole wait, the exported span starts no earlier than its parent.
    - An exception marks the span ERROR with an exception event, then propagates (not one
      of setup's `stop_exceptions`).
    - `device` (e.g. "cuda:0"): with cfg.cuda_timing "sync" the device is synchronized at
      both ends; with "events" device events are resolved on a background thread, which
      adds `tracing.device.duration` (seconds) to the span and `<name>@device` to the stats.

Spans that cross threads
    h = start_span(name, attributes=None, *, parent=None, start_time_ns=None, level="step")
    h.context (a parent for other threads), h.set_attribute(k, v), h.end() (any thread).

ProfileStats, Reporter, device clocks: see tracing.stats, tracing.reporter, tracing.device.
"""

from tracing.clock import now_ns
from tracing.config import TracingConfig, TracingConfigError
from tracing.device import CudaClock, DeviceClock, EventResolver, HostClock
from tracing.export.delivery import DeliveryCounts
from tracing.export.exporters import OtlpJsonFileExporter
from tracing.format import DEVICE_SUFFIX, format_compact, format_duration, format_table
from tracing.reporter import Reporter
from tracing.snapshot import PhaseStats, StatsSnapshot
from tracing.spans import Phase, SpanHandle, current_phase, phase, start_span
from tracing.stats import NO_THREAD, ProfileStats
from tracing.telemetry import ShutdownReport, Telemetry, active, get_stats, setup, shutdown

__all__ = [
    "DEVICE_SUFFIX",
    "NO_THREAD",
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
