"""The run's health as metrics: skipped steps, skipped cache samples by reason, and the
exporters' own span delivery, as integer counters with their labels."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData

import tracing
from dflash.observe.metrics import NAMESPACE, start_run_metrics
from dflash.offline.spool import Spool


class Captured(MetricExporter):
    def __init__(self) -> None:
        super().__init__()
        self.last: MetricsData | None = None

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **_: Any):
        self.last = metrics_data
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **_: Any) -> None:
        pass

    def points(self) -> dict[str, dict[str, Any]]:
        """metric name -> {label value (or ""): point value} of the last export."""
        assert self.last is not None
        found: dict[str, dict[str, Any]] = {}
        for rm in self.last.resource_metrics:
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    found[metric.name] = {
                        next(iter(p.attributes.values()), ""): p.value
                        for p in metric.data.data_points
                    }
        return found


def test_skipped_steps_samples_and_span_delivery_are_integer_counters() -> None:
    captured = Captured()
    cfg = tracing.TracingConfig(run_id="r", attribute_namespace=NAMESPACE)
    skipped = {"missing": 0, "unreadable": 2, "nonfinite": 1, "truncated": 0}
    bad = {"steps": 0}
    metrics = start_run_metrics(
        cfg,
        tracing.ProfileStats(),
        tokens={},
        steps={},
        queues={},
        skipped_steps=lambda: bad["steps"],
        skipped_samples={r: (lambda r=r: skipped[r]) for r in skipped},
        spans={"handed": lambda: 10, "exported": lambda: 7, "failed": lambda: 1},
        exporters=[captured],
        export_interval_s=3600,
    )
    bad["steps"], skipped["nonfinite"] = 3, 4
    assert metrics.force_flush()
    points = captured.points()
    assert points["dflash.train.skipped_steps"] == {"": 3}
    assert points["dflash.cache.skipped_samples"] == {
        "missing": 0,
        "unreadable": 2,
        "nonfinite": 4,
        "truncated": 0,
    }
    assert points["dflash.telemetry.spans"] == {"handed": 10, "exported": 7, "failed": 1}
    values = [v for name in points if "skipped" in name for v in points[name].values()]
    assert all(type(v) is int for v in values), values
    metrics.shutdown()


def test_the_spool_depth_is_bytes_and_samples_now(tmp_path: Path) -> None:
    # A real spool: two whole samples and one being written (not yet renamed).
    spool = Spool(tmp_path / "spool")
    held = tmp_path / "spool" / "hidden_states"
    (held / "hs_0.safetensors").write_bytes(b"x" * 1000)
    (held / "hs_1.safetensors").write_bytes(b"x" * 500)
    (held / "hs_2.safetensors.tmp").write_bytes(b"x" * 200)
    captured = Captured()
    cfg = tracing.TracingConfig(run_id="r", attribute_namespace=NAMESPACE)
    depth = spool.depth
    metrics = start_run_metrics(
        cfg,
        tracing.ProfileStats(),
        tokens={},
        steps={},
        queues={},
        spool={"usage": lambda: depth()[0], "samples": lambda: depth()[1]},
        exporters=[captured],
        export_interval_s=3600,
    )
    assert metrics.force_flush()
    points = captured.points()
    assert points["dflash.spool.usage"] == {"": 1700}
    assert points["dflash.spool.samples"] == {"": 2}
    (held / "hs_0.safetensors").unlink()  # the reader took one
    assert metrics.force_flush()
    points = captured.points()
    assert points["dflash.spool.usage"] == {"": 700}
    assert points["dflash.spool.samples"] == {"": 1}
    units = {m.name: m.unit for m in _metrics(captured)}
    assert units["dflash.spool.usage"] == "By" and units["dflash.spool.samples"] == "{sample}"
    metrics.shutdown()
    spool.close()


def _metrics(captured: Captured) -> list[Any]:
    assert captured.last is not None
    return [
        m for rm in captured.last.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
    ]
