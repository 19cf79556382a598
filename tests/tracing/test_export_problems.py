"""A failing OTLP export is told in one line, with its likely cause, within seconds of
its first failed attempt (tracing.diagnose), against real receivers on loopback: OTLP/HTTP
sent to a gRPC port, gRPC sent to an OTLP/HTTP port, nothing listening. Metric exports
still retrying at the shutdown bound are counted, and traces and metrics share one bound."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import tracing
from tracing import TracingConfig
from tracing.diagnose import ExportWatch, Verdict, printable, probe
from tracing.metrics import MetricsConfig, shutdown_all, start_metrics

REPO = Path(__file__).resolve().parents[2]
TOLD_WITHIN_S = 5.0


class Told:
    """The lines tracing tells, with when each came."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str]] = []
        self.arrived = threading.Event()

    def __call__(self, line: str) -> None:
        self.lines.append((time.monotonic(), line))
        self.arrived.set()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never answers (a hung collector)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    server.settimeout(0.1)
    held: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(1)
    for conn in held:
        conn.close()
    server.close()


def _export_and_wait(
    clean_env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, cfg: TracingConfig
) -> tuple[Told, float, tracing.ShutdownReport]:
    """Records phases, flushes them into the exporter; returns what was told, the time of
    the first failed attempt, and the shutdown report."""
    told = Told()
    telemetry = tracing.setup(cfg, on_export_problem=told)
    (export_watch,) = [e.watch for e in telemetry.exporters]
    with caplog.at_level(logging.DEBUG):
        for _ in range(20):
            with tracing.phase("work"):
                pass
        started = time.monotonic()
        telemetry.force_flush(timeout_s=0.05)  # the batch goes out now
        deadline = started + 15
        while not export_watch.failing and time.monotonic() < deadline:
            time.sleep(0.005)
        first_failure = time.monotonic()
        assert told.arrived.wait(TOLD_WITHIN_S + 5)
        report = telemetry.shutdown(timeout_s=4.0)
    return told, first_failure, report


def test_http_sent_to_a_grpc_port_is_told_within_seconds_naming_the_fix(
    clean_env, caplog, grpc_receiver
) -> None:
    cfg = TracingConfig(otlp_endpoint=grpc_receiver.endpoint, protocol_setting="--otlp-protocol")
    told, first_failure, report = _export_and_wait(clean_env, caplog, cfg)
    ((when, line),) = told.lines
    assert when - first_failure < TOLD_WITHIN_S
    assert "speaks gRPC" in line and "pass --otlp-protocol grpc, or use port 4318" in line
    assert line.startswith(f"traces export to {grpc_receiver.endpoint}/v1/traces (http/protobuf)")
    # The SDK's records of that export (raw HTTP/2 bytes in a BadStatusLine) are not logged.
    sdk_records = [r for r in caplog.records if r.name.startswith("opentelemetry.exporter")]
    assert sdk_records == [], [r.getMessage()[:80] for r in sdk_records]
    assert report.spans_exported == 0 and report.spans_failed == 20
    assert report.duration_s < 1.0  # a known wrong protocol: shutdown does not wait it out


def test_grpc_sent_to_an_http_port_is_told_naming_the_fix(clean_env, caplog, http_receiver) -> None:
    cfg = TracingConfig(otlp_endpoint=http_receiver.endpoint, otlp_protocol="grpc")
    told, first_failure, report = _export_and_wait(clean_env, caplog, cfg)
    ((when, line),) = told.lines
    assert when - first_failure < TOLD_WITHIN_S
    assert "speaks HTTP/1.1" in line and "set OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf" in line
    assert "or use port 4317" in line and report.spans_exported == 0


def test_nothing_listening_is_told_as_refused_and_shutdown_does_not_wait(clean_env, caplog) -> None:
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    told, first_failure, report = _export_and_wait(
        clean_env, caplog, TracingConfig(otlp_endpoint=endpoint)
    )
    ((when, line),) = told.lines
    assert when - first_failure < TOLD_WITHIN_S and "connection refused" in line
    assert report.spans_failed == 20 and report.duration_s < 1.0


def test_a_working_export_tells_nothing(clean_env, caplog, grpc_receiver, http_receiver) -> None:
    for protocol, receiver in (("grpc", grpc_receiver), ("http/protobuf", http_receiver)):
        told = Told()
        cfg = TracingConfig(otlp_endpoint=receiver.endpoint, otlp_protocol=protocol)
        telemetry = tracing.setup(cfg, on_export_problem=told)
        with tracing.phase("work"):
            pass
        report = telemetry.shutdown(timeout_s=4.0)
        assert report.spans_exported == 1 and told.lines == []
    assert probe(grpc_receiver.endpoint, "grpc") == Verdict(None)
    assert probe(http_receiver.endpoint + "/v1/traces", "http/protobuf") == Verdict(None)


def test_a_watch_is_told_once_per_outage_and_rearmed_by_a_success() -> None:
    told = Told()
    export_watch = ExportWatch("traces", f"http://127.0.0.1:{_closed_port()}", "grpc", told)
    for _ in range(3):
        export_watch.failed("one")
    export_watch.wait_for_probe(5)
    assert len(told.lines) == 1 and export_watch.unreachable
    export_watch.succeeded()
    export_watch.failed("two")
    export_watch.wait_for_probe(5)
    assert len(told.lines) == 2


def test_the_sdks_words_are_one_printable_line() -> None:
    raw = "BadStatusLine('\x00\x00\x18\x04\x00\xfe\x03 ok')\nmore"
    text = printable(raw)
    assert text.isprintable() and text.isascii() and "\n" not in text
    assert len(printable("x" * 1000)) == 160


def test_metric_exports_retrying_at_the_bound_are_counted(clean_env, silent_port) -> None:
    # A collector that accepts and never answers: the final export was counted nowhere
    # ("exports ok 0, failed 0") when the bound cut it short.
    traces = TracingConfig(otlp_endpoint=f"http://127.0.0.1:{silent_port}")
    metrics = start_metrics(MetricsConfig(export_interval_s=60), traces)
    metrics.observe("counter", "tokens", lambda: 5, unit="{token}")
    report = metrics.shutdown(timeout_s=1.0)
    assert report.exports_ok == 0 and report.exports_failed + report.exports_in_flight == 1
    assert report.points_lost >= 1 and report.duration_s < 1.5
    assert "failed 1" in report.summary() or "in flight at the bound 1" in report.summary()


def test_traces_and_metrics_share_one_shutdown_bound(clean_env, silent_port) -> None:
    clean_env.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    traces = TracingConfig(otlp_endpoint=f"http://127.0.0.1:{silent_port}")
    telemetry = tracing.setup(traces)
    metrics = start_metrics(MetricsConfig(export_interval_s=60), traces)
    metrics.observe("counter", "tokens", lambda: 5, unit="{token}")
    for _ in range(10):
        with tracing.phase("work"):
            pass
    time.sleep(0.2)  # the span export is under way, and hangs
    started = time.monotonic()
    span_report, metrics_report = shutdown_all(telemetry, metrics, timeout_s=2.0)
    took_s = time.monotonic() - started
    assert took_s < 2.5, took_s  # one bound, not one per signal (4 s before)
    assert span_report.spans_exported == 0 and span_report.spans_not_delivered == 10
    assert metrics_report is not None and metrics_report.exports_ok == 0
    assert metrics_report.exports_failed + metrics_report.exports_in_flight == 1


DISABLED = """
import sys
sys.path.insert(0, {repo!r})
import tracing
telemetry = tracing.setup(tracing.TracingConfig(otlp_endpoint="http://127.0.0.1:9"))
print(telemetry.sinks, telemetry.disabled_by)
"""


def test_sdk_disabled_names_the_variable_and_no_sink() -> None:
    env = {**os.environ, "OTEL_SDK_DISABLED": "TRUE"}
    code = textwrap.dedent(DISABLED).format(repo=str(REPO))
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.strip() == "[] OTEL_SDK_DISABLED=true"
