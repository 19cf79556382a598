"""tracing: time the phases of a PyTorch program as OpenTelemetry spans and ProfileStats.

A library written as OTel instrumentation is (it never imports dflash; torch only for
device timing): phases record through the application's TracerProvider once it has set
one, and the SDK reads the OTEL_* variables itself (docs/observability.md).

    telemetry = setup(TracingConfig(default_service_name="my-app"), provider=None,
                      exporters=(), span_processors=(), phase_hooks=())
    with phase("drafter.step", parent=batch_span, attributes={"step": 3}) as p:
        p.set_attribute("tokens", n)              # taken now: numpy to Python values
    root = start_span("batch"); ...; root.end()   # a span that crosses threads
    telemetry.stats.snapshot(); report = telemetry.shutdown()   # bounded, idempotent

tracing.spans: the phase contract; tracing.telemetry: which provider, the shutdown
report; tracing.stats, .reporter, .device: ProfileStats, interval tables, device timing.
"""

from tracing.clock import now_ns
from tracing.config import TracingConfig, TracingConfigError
from tracing.device import CudaClock, DeviceClock, EventResolver, HostClock
from tracing.export import DeliveryCounts, OtlpJsonFileExporter
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
