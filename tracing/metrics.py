"""OTel metrics beside the traces: counters and gauges read by callbacks, gauges set once
per logged step, and a phase-duration histogram taken from the unsampled ProfileStats.

    metrics = start_metrics(MetricsConfig(namespace="myapp"), tracing_cfg)
    metrics.observe("counter", "tokens", lambda: n, unit="{token}", attributes={"stage": "x"})
    metrics.observe_stats(telemetry.stats, "phase.duration")      # seconds; myapp.phase
    metrics.gauge("train.loss", unit="{nat}"); metrics.record({"train.loss": 2.1})
    report = metrics.shutdown()                                    # bounded; MetricsReport

Hot path: nothing. Callbacks run on the reader's thread once per interval; the histogram
is built there from a cumulative snapshot of the stats (trace sampling never changes it)
and added to each export the SDK makes (it makes one when an instrument has data). The
metrics go where the traces' flags send them, else the SDK's variables say (it reads
OTEL_METRIC_EXPORT_INTERVAL and the OTLP ones); a collector that is down costs the reader
thread one bounded export per interval, counted in the report, and its first failure
is one line naming the likely cause (tracing.diagnose). `shutdown_all` ends the traces,
the metrics and the logs (tracing.logs) together, within one bound.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.metrics import _Gauge as Gauge  # the API's public Gauge, typed by this name
from opentelemetry.sdk.metrics import Counter, Exemplar, MeterProvider, ObservableCounter
from opentelemetry.sdk.metrics import Histogram as HistogramInstrument
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Buckets,
    ConsoleMetricExporter,
    ExponentialHistogram,
    ExponentialHistogramDataPoint,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricExporter,
    MetricExportResult,
    MetricsData,
    PeriodicExportingMetricReader,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.util.types import AttributeValue

from tracing.clock import now_ns
from tracing.config import TEMPORALITIES, MetricsConfig, TracingConfig, call_logged, warn_once
from tracing.diagnose import Report, watch_of
from tracing.export import (
    call_bounded,
    join_closing,
    lower_thread_priority,
    otlp_exporter,
    otlp_protocol,
    sdk_disabled,
    wanted_exporters,
)
from tracing.logs import Logs
from tracing.snapshot import (
    BUCKETS_PER_OCTAVE,
    MIN_BUCKET,
    TINY_S,
    PhaseStats,
    StatsSnapshot,
    bucket_of,
)
from tracing.stats import ProfileStats
from tracing.telemetry import SCOPE as TRACES_SCOPE
from tracing.telemetry import ShutdownReport, Telemetry, active, build_resource

_Point = TypeVar("_Point", HistogramDataPoint, ExponentialHistogramDataPoint)

# Versioned as the traces' scope: a backend tells which release wrote a series.
SCOPE = InstrumentationScope("tracing.metrics", TRACES_SCOPE.version)
TEMPORALITY_VARIABLE = "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE"
# The histograms built from ProfileStats get a scope of their own: the OTLP encoder
# keys scopes by name, and would let one replace the SDK instruments' scope.
STATS_SCOPE = InstrumentationScope("tracing.metrics.stats", TRACES_SCOPE.version)
# Octave edges from ~61 µs to 8 s: each ProfileStats bucket (8 per octave) lies inside
# one of them, so the histogram counts are exact, and ms phases get several buckets.
FIRST_OCTAVE = -14
PHASE_BOUNDS_S = tuple(2.0**k for k in range(FIRST_OCTAVE, 4))
HISTOGRAM_VARIABLE = "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION"
HISTOGRAM_AGGREGATIONS = {
    "explicit_bucket_histogram": "explicit",
    "base2_exponential_bucket_histogram": "exponential",
}
"""The variable's values (the OTLP exporter specification's) and the phase histogram each picks."""
EXPONENTIAL_SCALE = 3  # base 2**(2**-3): one OTLP bucket per ProfileStats bucket


@dataclass(frozen=True)
class MetricsReport:
    """What became of the metric exports of one run: points are lost in failed exports
    and in those still in flight (retrying) when shutdown reached its bound."""

    exports_ok: int
    exports_failed: int
    points_failed: int
    duration_s: float = 0.0
    exports_in_flight: int = 0
    points_in_flight: int = 0

    @property
    def points_lost(self) -> int:
        return self.points_failed + self.points_in_flight

    def summary(self) -> str:
        text = f"metrics: exports ok {self.exports_ok}, failed {self.exports_failed}"
        if self.exports_in_flight:
            text += f", still in flight at the bound {self.exports_in_flight}"
        return text + f" ({self.points_lost} points lost)"


def phase_histogram_kind(name: str | None) -> str:
    """`MetricsConfig.phase_histogram`; None reads the specification's variable for the
    default histogram aggregation (unknown values: explicit, warned once)."""
    if name is not None:
        return name
    value = os.environ.get(HISTOGRAM_VARIABLE, "").strip().lower()
    kinds = {"": "explicit", **HISTOGRAM_AGGREGATIONS}
    if value not in kinds:
        warn_once(HISTOGRAM_VARIABLE, f"ignoring {HISTOGRAM_VARIABLE}={value!r}")
    return kinds.get(value, "explicit")


def preferred_temporality(name: str | None) -> dict[type, AggregationTemporality]:
    """The temporality of each instrument kind under a preference, by the specification's
    table (a kind not named stays cumulative); None reads the variable (bad: warned once)."""
    if name is None:
        name = os.environ.get(TEMPORALITY_VARIABLE, "").strip().lower() or "cumulative"
        if name not in TEMPORALITIES:
            warn_once(TEMPORALITY_VARIABLE, f"ignoring {TEMPORALITY_VARIABLE}={name!r}")
    delta_kinds: tuple[type, ...] = {
        "delta": (Counter, HistogramInstrument, ObservableCounter),
        "lowmemory": (Counter, HistogramInstrument),
    }.get(name, ())
    return dict.fromkeys(delta_kinds, AggregationTemporality.DELTA)


class _StatsExporter(MetricExporter):
    """Adds the ProfileStats histograms to each export and counts the results.
    Runs on the reader's thread; never raises (an exporter error is a failed export)."""

    def __init__(
        self,
        inner: MetricExporter,
        owner: Metrics,
        temporality: dict[type, AggregationTemporality],
    ) -> None:
        super().__init__(preferred_temporality=temporality)
        self.inner, self.owner = inner, owner
        self.ok = self.failed = self.points_failed = 0
        self.in_flight = self.points_in_flight = 0  # exports not returned yet
        self.watch = watch_of(inner)  # an OTLP exporter's failures, told (tracing.diagnose)
        self.closed = False

    def export(
        self,
        metrics_data: MetricsData,
        timeout_millis: float = 10_000,
        **kwargs: Any,  # the SDK's signature
    ) -> MetricExportResult:
        lower_thread_priority()  # the reader's thread, as the spans' export
        data = self.owner._with_stats(metrics_data)
        metrics = [m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics]
        points = sum(len(metric.data.data_points) for metric in metrics)
        self.in_flight += 1
        self.points_in_flight += points
        try:
            result = None if self.closed else self._export(data, timeout_millis)
        finally:
            self.in_flight -= 1
            self.points_in_flight -= points
        if result == MetricExportResult.SUCCESS:
            self.ok += 1
            return MetricExportResult.SUCCESS
        self.failed += 1
        self.points_failed += points
        return MetricExportResult.FAILURE

    def _export(self, data: MetricsData, timeout_millis: float) -> MetricExportResult | None:
        export_watch = self.watch
        if export_watch is None:
            return call_logged(
                self.inner.export, data, timeout_millis=timeout_millis
            )  # None: raised
        with export_watch.exporting():
            result = call_logged(self.inner.export, data, timeout_millis=timeout_millis)
        if result == MetricExportResult.SUCCESS:
            export_watch.succeeded()
        else:
            export_watch.failed()
        return result

    @property
    def unreachable(self) -> bool:
        """Its endpoint is known unreachable (or speaks another protocol)."""
        return self.watch is not None and self.watch.unreachable

    def close(self) -> None:
        """Aborts an export waiting to retry; later exports fail at once, unsent."""
        if not self.closed:
            self.closed = True
            if self.watch is not None:
                self.watch.closed = True
            self.inner.shutdown()

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self.inner.force_flush(timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:  # the SDK's
        if not self.closed:
            self.closed = True
            self.inner.shutdown(timeout_millis=timeout_millis)


RecentSpans = Callable[[str], Sequence[ReadableSpan]]
"""The last sampled spans of a phase name, oldest first (SpanCounter.recent_spans)."""


class _StatsHistogram:
    """Cumulative histogram of one ProfileStats, one point per phase name, each bucket
    with the latest sampled span of that phase that fell in it as its exemplar.

    The durations come from the stats (every phase, sampled or not): the SDK's exemplar
    reservoirs only see synchronous instruments recorded in a span's context, and
    there is none here. The exemplars come from the spans tracing's own processors saw
    end (SpanCounter keeps the last few per name: a deque append per sampled span), so
    a bucket's exemplar is a trace the exporters were handed; a phase never sampled,
    or recorded on an application's provider, has none."""

    def __init__(
        self,
        stats: ProfileStats,
        name: str,
        description: str,
        phase_key: str,
        kind: str = "explicit",
        spans: RecentSpans | None = None,
    ) -> None:
        self.stats, self.name, self.description = stats, name, description
        self.phase_key, self.start_ns, self._last_total = phase_key, now_ns(), 0
        self.kind, self.spans = kind, spans

    def recent_spans(self, name: str) -> Sequence[ReadableSpan]:
        """`spans(name)`; by default the active Telemetry's, when it feeds these stats."""
        if self.spans is not None:
            return self.spans(name)
        telemetry = active()
        counter = None if telemetry is None else telemetry.counter  # read once: shutdown
        if telemetry is None or counter is None or telemetry.stats is not self.stats:
            return ()
        return counter.recent_spans(name)

    def metric(self) -> Metric:
        snap = self.stats.snapshot()
        total = sum(s.count for s in snap.phases.values())
        if total < self._last_total:  # the stats were reset: a new cumulative series
            self.start_ns = now_ns()
        self._last_total = total
        time_ns = now_ns()
        data: ExponentialHistogram | Histogram
        if self.kind == "exponential":
            points = self._points(snap, time_ns, _exponential_point, _stats_bucket)
            data = ExponentialHistogram(points, AggregationTemporality.CUMULATIVE)
        else:
            explicit = self._points(snap, time_ns, _explicit_point, _octave_index)
            data = Histogram(explicit, AggregationTemporality.CUMULATIVE)
        return Metric(self.name, self.description, "s", data)

    def _points(
        self,
        snap: StatsSnapshot,
        time_ns: int,
        point: Callable[[dict[str, AttributeValue], int, int, PhaseStats, list[Exemplar]], _Point],
        bucket: Callable[[float], int],
    ) -> list[_Point]:
        """One point per phase that has durations, with its exemplars by `bucket`."""
        return [
            point(
                {self.phase_key: name},
                self.start_ns,
                time_ns,
                s,
                _exemplars(self.recent_spans(name), bucket, self.start_ns),
            )
            for name, s in sorted(snap.phases.items())
            if s.count
        ]


def _explicit_point(
    attributes: dict[str, AttributeValue],
    start_ns: int,
    time_ns: int,
    s: PhaseStats,
    exemplars: list[Exemplar],
) -> HistogramDataPoint:
    return HistogramDataPoint(
        attributes=attributes,
        start_time_unix_nano=start_ns,
        time_unix_nano=time_ns,
        count=s.count,
        sum=s.total_s,
        bucket_counts=_bucket_counts(s.buckets),
        explicit_bounds=list(PHASE_BOUNDS_S),
        min=s.min_s,
        max=s.max_s,
        exemplars=exemplars,
    )


def _exponential_point(
    attributes: dict[str, AttributeValue],
    start_ns: int,
    time_ns: int,
    s: PhaseStats,
    exemplars: list[Exemplar],
) -> ExponentialHistogramDataPoint:
    """The stats' buckets as they are: ProfileStats bucket b, [2**(b/8), 2**((b+1)/8)),
    is OTLP bucket b of scale 3, (2**(b/8), 2**((b+1)/8)] (only a duration exactly on
    an edge, a power of 2**(1/8), would be counted one bucket lower by the OTLP rule)."""
    low, high = min(s.buckets), max(s.buckets)
    counts = [0] * (high - low + 1)
    for bucket, n in s.buckets.items():
        counts[bucket - low] += n
    return ExponentialHistogramDataPoint(
        attributes=attributes,
        start_time_unix_nano=start_ns,
        time_unix_nano=time_ns,
        count=s.count,
        sum=s.total_s,
        scale=EXPONENTIAL_SCALE,
        zero_count=0,  # zero durations count in MIN_BUCKET, ~1 ns: no zero bucket
        positive=Buckets(low, counts),
        negative=Buckets(0, []),
        flags=0,
        min=s.min_s,
        max=s.max_s,
        exemplars=exemplars,
    )


def _stats_bucket(seconds: float) -> int:
    """The ProfileStats bucket of a duration (the exponential histogram's index)."""
    return MIN_BUCKET if seconds <= TINY_S else bucket_of(seconds)


def _octave_index(seconds: float) -> int:
    """The index of a duration's bucket among PHASE_BOUNDS_S (+Inf last)."""
    index = _stats_bucket(seconds) // BUCKETS_PER_OCTAVE - FIRST_OCTAVE + 1
    return min(max(index, 0), len(PHASE_BOUNDS_S))


def _exemplars(
    spans: Sequence[ReadableSpan], bucket: Callable[[float], int], since_ns: int
) -> list[Exemplar]:
    """Per bucket, the latest of `spans` (ended since `since_ns`) whose duration fell in
    it: its duration in seconds, end time, trace and span id."""
    chosen: dict[int, Exemplar] = {}
    for span in reversed(spans):
        start, end, context = span.start_time, span.end_time, span.context
        if start is None or end is None or context is None or end < since_ns:
            continue
        seconds = (end - start) / 1e9
        key = bucket(seconds)
        if key not in chosen:
            chosen[key] = Exemplar({}, seconds, end, context.span_id, context.trace_id)
    return [chosen[key] for key in sorted(chosen)]


def _bucket_counts(buckets: Mapping[int, int]) -> list[int]:
    """ProfileStats log buckets summed into PHASE_BOUNDS_S (upper bounds, +Inf last)."""
    counts = [0] * (len(PHASE_BOUNDS_S) + 1)
    for bucket, n in buckets.items():
        # bucket b covers [2**(b/8), 2**((b+1)/8)): inside octave floor(b/8).
        index = bucket // BUCKETS_PER_OCTAVE - FIRST_OCTAVE + 1
        counts[min(max(index, 0), len(PHASE_BOUNDS_S))] += n
    return counts


class Metrics:
    """The metrics of one process: a meter provider with one periodic reader per exporter.
    Thread contract: registration (`observe_*`, `gauge`) from any thread, best before
    training; `record` from any thread, off the hot path (once per logged step);
    callbacks run on the reader thread and an exception in one only loses its value."""

    def __init__(
        self, cfg: MetricsConfig, resource: Resource, exporters: Sequence[MetricExporter] = ()
    ) -> None:
        self.cfg, self.resource = cfg, resource
        temporality = preferred_temporality(cfg.temporality)
        self._wrapped = [_StatsExporter(e, self, temporality) for e in exporters]
        interval_ms = None if cfg.export_interval_s is None else cfg.export_interval_s * 1e3
        readers = [PeriodicExportingMetricReader(w, interval_ms) for w in self._wrapped]
        self.provider = MeterProvider(readers, resource=resource, shutdown_on_exit=False)
        self._meter = self.provider.get_meter(SCOPE.name, SCOPE.version)
        self._observed: dict[str, list[tuple[Callable[[], float], dict[str, AttributeValue]]]] = {}
        self._gauges: dict[str, Gauge] = {}
        self._histograms: list[_StatsHistogram] = []
        self._report: MetricsReport | None = None
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return bool(self._wrapped)

    def full_name(self, name: str) -> str:
        return f"{self.cfg.namespace}.{name}" if self.cfg.namespace else name

    def observe(
        self,
        kind: Literal["counter", "updowncounter", "gauge"],
        name: str,
        fn: Callable[[], float],
        *,
        unit: str,
        description: str = "",
        attributes: Mapping[str, AttributeValue] | None = None,
    ) -> None:
        """A counter, an up-down counter (a count that rises and falls: a queue's size) or
        a gauge (a reading: peak memory) read through `fn()` at each collection; series of
        one name differ by `attributes`."""
        creators = {
            "counter": self._meter.create_observable_counter,
            "updowncounter": self._meter.create_observable_up_down_counter,
            "gauge": self._meter.create_observable_gauge,
        }
        if kind not in creators:
            raise ValueError(f"metric kind must be one of {', '.join(creators)}, got {kind!r}")
        with self._lock:
            series = self._observed.get(name)
            if series is None:
                series = self._observed[name] = []
                creators[kind](self.full_name(name), [self._callback(name)], unit, description)
            series.append((fn, dict(attributes or {})))

    def _callback(self, name: str) -> Callable[[CallbackOptions], list[Observation]]:
        def observe(options: CallbackOptions) -> list[Observation]:
            out = []
            for fn, attributes in list(self._observed[name]):
                try:
                    value = fn()
                    # A count stays an integer (an OTLP asInt point), a reading a double.
                    exact = isinstance(value, int) and not isinstance(value, bool)
                    out.append(Observation(value if exact else float(value), attributes))
                except Exception:  # one broken callback loses one value
                    continue
            return out

        return observe

    def gauge(self, name: str, *, unit: str, description: str = "") -> None:
        """Declares a gauge that `record` sets (e.g. loss, once per logged step)."""
        with self._lock:
            if name not in self._gauges:
                self._gauges[name] = self._meter.create_gauge(
                    self.full_name(name), unit, description
                )

    def record(
        self,
        values: Mapping[str, float | None],
        attributes: Mapping[str, AttributeValue] | None = None,
    ) -> None:
        """Sets declared gauges; None values and undeclared names are skipped."""
        for name, value in values.items():
            instrument = self._gauges.get(name)
            if instrument is not None and value is not None:
                instrument.set(float(value), attributes)

    def observe_stats(
        self,
        stats: ProfileStats,
        name: str = "phase.duration",
        description: str = "",
        spans: RecentSpans | None = None,
    ) -> None:
        """Exports `stats` as a histogram in seconds with attribute `<namespace>.phase`
        (`MetricsConfig.phase_histogram`, else the variable: octave bounds or exponential,
        chosen here, when the histogram is registered), each bucket's
        exemplar the latest span of `spans(phase)` in it; `spans` None: the sampled
        spans of the active Telemetry, when `stats` is its stats."""
        desc = description or "Duration of each phase, from every phase (sampled or not)."
        key = self.full_name("phase")
        kind = phase_histogram_kind(self.cfg.phase_histogram)
        self._histograms.append(
            _StatsHistogram(stats, self.full_name(name), desc, key, kind, spans)
        )

    def _with_stats(self, data: MetricsData) -> MetricsData:
        if not self._histograms:
            return data
        extra = ScopeMetrics(STATS_SCOPE, [h.metric() for h in self._histograms], "")
        if not data.resource_metrics:
            return MetricsData([ResourceMetrics(self.resource, [extra], "")])
        first, *rest = data.resource_metrics
        merged = ResourceMetrics(first.resource, [*first.scope_metrics, extra], first.schema_url)
        return MetricsData([merged, *rest])

    def force_flush(self, timeout_s: float = 2.0) -> bool:
        return self.provider.force_flush(timeout_s * 1e3)

    def report(self, duration_s: float = 0.0) -> MetricsReport:
        wrapped = self._wrapped
        ok, failed = sum(w.ok for w in wrapped), sum(w.failed for w in wrapped)
        points_failed = sum(w.points_failed for w in wrapped)
        in_flight = sum(w.in_flight for w in wrapped)
        points_in_flight = sum(w.points_in_flight for w in wrapped)
        return MetricsReport(ok, failed, points_failed, duration_s, in_flight, points_in_flight)

    def shutdown(self, timeout_s: float | None = None) -> MetricsReport:
        """Final export and close, bounded by `timeout_s`; idempotent. An exporter whose
        endpoint is known unreachable is closed at once (its final export fails without
        waiting for retries); the others get most of the bound, then are closed (a
        retrying export aborts)."""
        with self._lock:
            if self._report is None:
                started = time.monotonic()
                budget_s = self.cfg.shutdown_timeout_s if timeout_s is None else timeout_s
                deadline = started + budget_s * 0.95
                closing = threading.Thread(
                    target=call_logged,
                    args=(self.provider.shutdown, budget_s * 1e3),
                    name="tracing-metrics-close",
                    daemon=True,
                )
                closing.start()
                join_closing(closing, started + budget_s * 0.95 * 0.8, self._wrapped)
                for wrapped in self._wrapped:
                    call_bounded(wrapped.close, max(0.0, deadline - time.monotonic()))
                closing.join(max(0.0, deadline - time.monotonic()))
                self._report = self.report(time.monotonic() - started)
        return self._report


def build_metric_exporters(
    cfg: MetricsConfig, traces: TracingConfig, report: Report | None = None
) -> list[MetricExporter]:
    """The exporters `cfg` names, or the variables or the traces' endpoint imply (none
    under OTEL_SDK_DISABLED=true). `report`: see tracing.export.otlp_exporter."""
    if sdk_disabled():
        return []
    protocol = otlp_protocol(traces.otlp_protocol, "metrics")
    temporality = preferred_temporality(cfg.temporality)
    exporters: list[MetricExporter] = []
    for name in wanted_exporters(cfg.exporter, "metrics", traces.otlp_endpoint is not None):
        if name == "console":
            exporters.append(ConsoleMetricExporter(preferred_temporality=temporality))
        elif name == "otlp":
            options = {"preferred_temporality": temporality}
            endpoint, setting = traces.otlp_endpoint, traces.protocol_setting
            exporter = otlp_exporter("metrics", protocol, endpoint, report, setting, **options)
            exporters += [exporter] if exporter is not None else []
    return exporters


def start_metrics(
    cfg: MetricsConfig,
    tracing_cfg: TracingConfig,
    *,
    exporters: Sequence[MetricExporter] = (),
    resource: Resource | None = None,
    on_export_problem: Report | None = None,
) -> Metrics:
    """Metrics with the exporters `cfg` names plus `exporters` (e.g. an in-memory one in
    tests), and the traces' resource (`resource`, else `build_resource(tracing_cfg)`).
    `on_export_problem` gets the line that tells a failing OTLP export and its likely
    cause (default: a warning on the `tracing` logger)."""
    resource = resource if resource is not None else build_resource(tracing_cfg)
    built = build_metric_exporters(cfg, tracing_cfg, on_export_problem)
    return Metrics(cfg, resource, [*built, *exporters])


def shutdown_all(
    telemetry: Telemetry,
    metrics: Metrics | None,
    timeout_s: float | None = None,
    logs: Logs | None = None,
) -> tuple[ShutdownReport, MetricsReport | None]:
    """Shuts the traces, the metrics and the logs (`logs`; its report is then
    `logs.report()`) down side by side, within one bound (`timeout_s`, default the
    traces' `shutdown_timeout_s`): a dead collector costs one bound, not one per signal."""
    bound_s = telemetry.cfg.shutdown_timeout_s if timeout_s is None else timeout_s
    started = time.monotonic()
    box: list[MetricsReport] = []
    others: list[Callable[[], object]] = []
    if metrics is not None:
        others.append(lambda: box.append(metrics.shutdown(bound_s)))
    if logs is not None:
        others.append(lambda: logs.shutdown(bound_s))
    threads = [threading.Thread(target=fn, name="tracing-shutdown", daemon=True) for fn in others]
    for thread in threads:
        thread.start()
    report = telemetry.shutdown(bound_s)
    for thread in threads:
        thread.join(max(0.0, started + bound_s - time.monotonic()))
    if metrics is None:
        return report, None
    return report, (box[0] if box else metrics.report(time.monotonic() - started))
