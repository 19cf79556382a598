"""The metrics signal: instruments, the stats histogram, a dead collector (the OTEL_*
variables: test_metrics_env.py)."""

from __future__ import annotations

import math
import random
import socket
import time
from collections.abc import Sequence
from typing import Any

import pytest
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import tracing
from tracing.metrics import PHASE_BOUNDS_S, MetricsConfig, _stats_bucket, start_metrics


class MemoryMetricExporter(MetricExporter):
    def __init__(self) -> None:
        super().__init__()
        self.exports: list[MetricsData] = []

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **_: Any):
        self.exports.append(metrics_data)
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **_: Any) -> None:
        pass

    def points(self) -> dict[str, list[Any]]:
        """metric name -> (unit, data points) of the last export."""
        found: dict[str, Any] = {}
        for rm in self.exports[-1].resource_metrics:
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    found[metric.name] = (metric.unit, list(metric.data.data_points))
        return found


def test_instruments_carry_namespace_units_and_values() -> None:
    memory = MemoryMetricExporter()
    cfg = MetricsConfig(namespace="app", export_interval_s=3600)
    metrics = start_metrics(cfg, tracing.TracingConfig(run_id="r1"), exporters=[memory])
    tokens = {"a": 10.0, "b": 20.0}
    metrics.observe(
        "counter", "tokens", lambda: tokens["a"], unit="{token}", attributes={"stage": "a"}
    )
    metrics.observe(
        "counter", "tokens", lambda: tokens["b"], unit="{token}", attributes={"stage": "b"}
    )
    for queue, depth in (("x", lambda: 1 / 0), ("y", lambda: 3)):  # x's callback raises
        metrics.observe(
            "updowncounter", "queue.size", depth, unit="{item}", attributes={"queue": queue}
        )
    metrics.gauge("train.loss", unit="{nat}")
    metrics.record({"train.loss": 2.5, "unknown": 1.0, "train.loss_none": None})
    assert metrics.force_flush()
    points = memory.points()
    assert points["app.tokens"][0] == "{token}"
    assert {p.attributes["stage"]: p.value for p in points["app.tokens"][1]} == {"a": 10, "b": 20}
    # The broken callback loses its own value only.
    assert [(p.attributes, p.value) for p in points["app.queue.size"][1]] == [({"queue": "y"}, 3)]
    assert [p.value for p in points["app.train.loss"][1]] == [2.5]
    resource = memory.exports[-1].resource_metrics[0].resource.attributes
    assert resource["tracing.run.id"] == "r1" and resource["service.instance.id"]
    tokens["a"] = 15.0
    metrics.record({"train.loss": 2.0})
    metrics.force_flush()
    points = memory.points()
    assert {p.attributes["stage"]: p.value for p in points["app.tokens"][1]}["a"] == 15
    assert [p.value for p in points["app.train.loss"][1]] == [2.0]
    assert metrics.shutdown().exports_failed == 0


def test_otlp_request_holds_instruments_and_stats_histogram() -> None:
    from opentelemetry.exporter.otlp.proto.common._internal.metrics_encoder import encode_metrics

    memory = MemoryMetricExporter()
    hourly = MetricsConfig(export_interval_s=3600)
    metrics = start_metrics(hourly, tracing.TracingConfig(), exporters=[memory])
    metrics.observe("gauge", "depth", lambda: 1, unit="{item}")
    metrics.observe("counter", "steps", lambda: 7, unit="{step}")
    metrics.observe("gauge", "share", lambda: 0.25, unit="1")
    stats = tracing.ProfileStats()
    stats.add("p", 0.01)
    metrics.observe_stats(stats)
    metrics.force_flush()
    request = encode_metrics(memory.exports[-1])
    scopes = [sm for rm in request.resource_metrics for sm in rm.scope_metrics]
    found = {m.name: m for sm in scopes for m in sm.metrics}
    assert set(found) == {"depth", "steps", "share", "phase.duration"}
    # Counts are OTLP integers, readings doubles.
    (steps,) = found["steps"].sum.data_points
    assert steps.WhichOneof("value") == "as_int" and steps.as_int == 7
    (share,) = found["share"].gauge.data_points
    assert share.WhichOneof("value") == "as_double" and share.as_double == 0.25
    # Every scope names the release of tracing that wrote it.
    versions = {sm.scope.name: sm.scope.version for sm in scopes}
    assert set(versions) == {"tracing.metrics", "tracing.metrics.stats"}
    assert all(versions.values()) and len(set(versions.values())) == 1, versions
    metrics.shutdown()


def reference_bucket_counts(values: Sequence[float]) -> list[int]:
    """OTel explicit-bucket rule: bucket i counts bounds[i-1] < v <= bounds[i]."""
    counts = [0] * (len(PHASE_BOUNDS_S) + 1)
    for v in values:
        counts[sum(1 for b in PHASE_BOUNDS_S if v > b)] += 1
    return counts


def test_phase_histogram_is_the_unsampled_stats() -> None:
    memory = MemoryMetricExporter()
    stats = tracing.ProfileStats()
    metrics = start_metrics(
        MetricsConfig(export_interval_s=3600), tracing.TracingConfig(), exporters=[memory]
    )
    metrics.observe_stats(stats, "phase.duration")
    # The SDK exports when an instrument has data: the histogram rides on that export.
    metrics.observe("gauge", "depth", lambda: 1, unit="{item}")
    rng = random.Random(0)
    # Log-uniform from 10 µs to 20 s, off the octave edges (where the two bucket
    # conventions may differ by the rounding of one value).
    values = [10 ** rng.uniform(-5, 1.3) for _ in range(3000)]
    for v in values:
        stats.add("fwd", v)
    stats.add("other", 0.002)
    metrics.force_flush()
    unit, points = memory.points()["phase.duration"]
    assert unit == "s"
    by_phase = {p.attributes["phase"]: p for p in points}
    fwd = by_phase["fwd"]
    assert fwd.count == 3000 and fwd.sum == pytest.approx(sum(values))
    assert list(fwd.explicit_bounds) == list(PHASE_BOUNDS_S)
    assert list(fwd.bucket_counts) == reference_bucket_counts(values)
    assert (fwd.min, fwd.max) == (min(values), max(values))
    assert by_phase["other"].count == 1
    first_start = fwd.start_time_unix_nano
    stats.reset()  # a new cumulative series starts: Prometheus sees a counter reset
    stats.add("fwd", 0.01)
    metrics.force_flush()
    fwd = {p.attributes["phase"]: p for p in memory.points()["phase.duration"][1]}["fwd"]
    assert fwd.count == 1 and fwd.start_time_unix_nano > first_start
    metrics.shutdown()


def test_phase_histogram_ignores_trace_sampling() -> None:
    memory = MemoryMetricExporter()
    telemetry = tracing.setup(tracing.TracingConfig(sample_ratio=0.0))
    try:
        metrics = start_metrics(
            MetricsConfig(export_interval_s=3600), telemetry.cfg, exporters=[memory]
        )
        metrics.observe_stats(telemetry.stats)
        metrics.observe("gauge", "depth", lambda: 1, unit="{item}")
        for _ in range(50):
            with tracing.phase("step"):
                pass
        metrics.force_flush()
        (point,) = memory.points()["phase.duration"][1]
        assert point.count == 50
        metrics.shutdown()
    finally:
        telemetry.shutdown(timeout_s=1.0)


def reference_exponential_counts(values: Sequence[float]) -> dict[int, int]:
    """OTLP exponential rule at scale 3: index i counts 2**(i/8) < v <= 2**((i+1)/8)."""
    counts: dict[int, int] = {}
    for v in values:
        index = math.ceil(math.log2(v) * 8) - 1
        counts[index] = counts.get(index, 0) + 1
    return counts


def test_exponential_phase_histogram_is_the_stats_own_buckets() -> None:
    from opentelemetry.exporter.otlp.proto.common._internal.metrics_encoder import encode_metrics

    memory = MemoryMetricExporter()
    cfg = MetricsConfig(export_interval_s=3600, phase_histogram="exponential")
    metrics = start_metrics(cfg, tracing.TracingConfig(), exporters=[memory])
    stats = tracing.ProfileStats()
    metrics.observe_stats(stats, "phase.duration")
    metrics.observe("gauge", "depth", lambda: 1, unit="{item}")
    rng = random.Random(1)
    values = [10 ** rng.uniform(-5, 1.3) for _ in range(3000)]
    for v in values:
        stats.add("fwd", v)
    metrics.force_flush()
    (fwd,) = memory.points()["phase.duration"][1]
    assert fwd.scale == 3 and fwd.zero_count == 0 and fwd.count == 3000
    counts = {fwd.positive.offset + i: n for i, n in enumerate(fwd.positive.bucket_counts) if n}
    assert counts == reference_exponential_counts(values)
    assert fwd.sum == pytest.approx(sum(values)) and (fwd.min, fwd.max) == (
        min(values),
        max(values),
    )
    # Every quantile from the exported buckets is within one bucket (9 %) of the truth;
    # from the octave bounds it was up to 2x off.
    ordered = sorted(values)
    for q in (0.5, 0.9, 0.95, 0.99):
        seen, rank = 0, q * len(values)
        for index, n in sorted(counts.items()):
            seen += n
            if seen >= rank:
                upper = 2 ** ((index + 1) / 8)
                break
        truth = ordered[math.ceil(rank) - 1]
        assert truth <= upper <= truth * 2 ** (1 / 8) * 1.0001
    request = encode_metrics(memory.exports[-1])
    kinds = {
        m.name: m.WhichOneof("data")
        for rm in request.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
    }
    assert kinds["phase.duration"] == "exponential_histogram"
    metrics.shutdown()
    with pytest.raises(tracing.TracingConfigError, match="phase_histogram"):
        MetricsConfig(phase_histogram="octaves")


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        (None, "histogram"),
        ("explicit_bucket_histogram", "histogram"),
        ("base2_exponential_bucket_histogram", "exponential_histogram"),
        ("sometimes", "histogram"),
    ],
)
def test_the_default_histogram_aggregation_variable_picks_the_phase_histogram(
    clean_env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, value: str | None, kind: str
) -> None:
    """phase_histogram None follows the specification's variable (what the stack's
    documented command sets); explicit stays the default, which every Prometheus path
    takes; a bad value is warned about, never an error."""
    from opentelemetry.exporter.otlp.proto.common._internal.metrics_encoder import encode_metrics

    if value is not None:
        clean_env.setenv("OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION", value)
    memory = MemoryMetricExporter()
    metrics = start_metrics(
        MetricsConfig(export_interval_s=3600), tracing.TracingConfig(), exporters=[memory]
    )
    stats = tracing.ProfileStats()
    with caplog.at_level("WARNING"):
        metrics.observe_stats(stats)
    metrics.observe("gauge", "depth", lambda: 1, unit="{item}")  # the SDK exports none without
    stats.add("fwd", 0.01)
    metrics.force_flush()
    metrics.shutdown()
    request = encode_metrics(memory.exports[-1])
    (found,) = [
        m.WhichOneof("data")
        for rm in request.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == "phase.duration"
    ]
    assert found == kind
    warned = [r.getMessage() for r in caplog.records if "HISTOGRAM_AGGREGATION" in r.getMessage()]
    assert len(warned) == (value == "sometimes"), warned
    # An explicit setting wins over the variable.
    clean_env.setenv(
        "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION",
        "base2_exponential_bucket_histogram",
    )
    assert tracing.metrics.phase_histogram_kind("explicit") == "explicit"


@pytest.mark.parametrize("kind", ["explicit", "exponential"])
def test_phase_buckets_carry_the_trace_of_a_recent_span(kind: str) -> None:
    """Each bucket's exemplar is the latest sampled span of that phase in it: a metric
    leads to the trace that made it."""
    spans = InMemorySpanExporter()
    telemetry = tracing.setup(tracing.TracingConfig(), exporters=[spans])
    try:
        memory = MemoryMetricExporter()
        cfg = MetricsConfig(export_interval_s=3600, phase_histogram=kind)
        metrics = start_metrics(cfg, telemetry.cfg, exporters=[memory])
        metrics.observe_stats(telemetry.stats)
        metrics.observe("gauge", "depth", lambda: 1, unit="{item}")
        for _ in range(40):
            with tracing.phase("step", level="step"):
                pass
        for _ in range(3):
            with tracing.phase("slow", level="step"):
                time.sleep(0.02)
        metrics.force_flush()
        telemetry.force_flush(2.0)
        exported = {s.context.span_id: s for s in spans.get_finished_spans()}
        points = {p.attributes["phase"]: p for p in memory.points()["phase.duration"][1]}
        assert points["step"].count == 40  # every phase; the exemplars are sampled ones
        for name, point in points.items():
            assert point.exemplars, name
            for exemplar in point.exemplars:
                span = exported[exemplar.span_id]  # a span the exporter was handed
                assert span.name == name and span.context.trace_id == exemplar.trace_id
                assert exemplar.value == (span.end_time - span.start_time) / 1e9
                assert exemplar.time_unix_nano == span.end_time
        # One exemplar per bucket: the latest span in it.
        for name, point in points.items():
            buckets = [_stats_bucket(e.value) for e in point.exemplars]
            assert len(set(buckets)) == len(buckets)
            named = sorted(
                (s for s in exported.values() if s.name == name), key=lambda s: s.end_time
            )
            last = named[-1]
            assert last.context.span_id in {e.span_id for e in point.exemplars}
        metrics.shutdown()
    finally:
        telemetry.shutdown(timeout_s=1.0)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_dead_collector_costs_nothing_and_is_counted(clean_env, protocol: str) -> None:
    clean_env.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "0.3")  # seconds, as the Python SDK reads it
    cfg = MetricsConfig(exporter="otlp", export_interval_s=0.05, shutdown_timeout_s=1.0)
    endpoint = f"http://127.0.0.1:{closed_port()}"  # the traces' flags send the metrics too
    metrics = start_metrics(
        cfg, tracing.TracingConfig(otlp_endpoint=endpoint, otlp_protocol=protocol)
    )
    metrics.gauge("loss", unit="{nat}")
    stats = tracing.ProfileStats()
    metrics.observe_stats(stats)
    started = time.monotonic()
    for _ in range(200):  # the training side: never waits on the exports
        metrics.record({"loss": 1.0})
        stats.add("p", 0.001)
    assert time.monotonic() - started < 0.5
    deadline = time.monotonic() + 10
    while metrics.report().exports_failed == 0:
        assert time.monotonic() < deadline, "no failed export counted"
        time.sleep(0.05)
    report = metrics.shutdown()
    assert report.duration_s < 1.5
    assert report.exports_ok == 0 and report.exports_failed >= 1 and report.points_failed >= 2
    assert "failed" in report.summary() and "\n" not in report.summary()
    assert metrics.shutdown() is report


@pytest.mark.parametrize(("preference", "second"), [("cumulative", 15), ("delta", 5)])
def test_temporality_preference_reaches_every_exporter(preference, second) -> None:
    """The reader takes its temporality from the config (the public constructor
    argument), also for an exporter the user built with none."""
    memory = MemoryMetricExporter()
    cfg = MetricsConfig(export_interval_s=3600, temporality=preference)
    metrics = start_metrics(cfg, tracing.TracingConfig(), exporters=[memory])
    total = {"n": 10.0}
    metrics.observe("counter", "tokens", lambda: total["n"], unit="{token}")
    metrics.force_flush()
    total["n"] = 15.0
    metrics.force_flush()
    assert [p.value for p in memory.points()["tokens"][1]] == [second]
    metrics.shutdown()


def test_temporality_from_the_environment(clean_env) -> None:
    clean_env.setenv("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", "Delta")
    memory = MemoryMetricExporter()
    metrics = start_metrics(
        MetricsConfig(export_interval_s=3600), tracing.TracingConfig(), exporters=[memory]
    )
    total = {"n": 10.0}
    metrics.observe("counter", "tokens", lambda: total["n"], unit="{token}")
    metrics.force_flush()
    total["n"] = 15.0
    metrics.force_flush()
    assert [p.value for p in memory.points()["tokens"][1]] == [5]
    metrics.shutdown()
