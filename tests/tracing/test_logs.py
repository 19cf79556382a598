"""The logs signal (tracing.logs): the SDK's logging bridge tied to the current phase,
events, exceptions that end a phase, where records go (OTEL_LOGS_EXPORTER, the traces'
endpoint), a dead endpoint told once and bounded, and the one shutdown bound of all
three signals."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator

import pytest
from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter
from test_export_problems import TOLD_WITHIN_S, Told, silent_port  # noqa: F401 - a fixture

import tracing
from tracing import TracingConfig
from tracing.logs import Logs, build_log_exporters, start_logs
from tracing.metrics import MetricsConfig, shutdown_all, start_metrics


@pytest.fixture
def app_logger() -> Iterator[logging.Logger]:
    """A logger of the test's own, nothing printed (the bridge is its handler)."""
    logger = logging.getLogger("test_logs.app")
    logger.propagate = False
    yield logger
    logger.handlers.clear()


@pytest.fixture
def records() -> Iterator[InMemoryLogRecordExporter]:
    exporter = InMemoryLogRecordExporter()
    yield exporter
    tracing.shutdown(timeout_s=1.0)


def finished(logs: Logs, exporter: InMemoryLogRecordExporter) -> list:
    report = logs.shutdown(timeout_s=2.0)
    found = [r.log_record for r in exporter.get_finished_logs()]
    assert report.records_exported == len(found) and report.records_not_delivered == 0
    return found


def test_warnings_of_an_attached_logger_are_records_of_the_current_phase(
    clean_env, app_logger, records, memory
) -> None:
    cfg = TracingConfig()
    telemetry = tracing.setup(cfg, exporters=[memory])
    logs = start_logs(cfg, exporters=[records])
    logs.attach(app_logger.name)
    app_logger.warning("before any phase")
    with tracing.phase("work") as work:
        app_logger.warning("inside %s", "work", extra={"_private": 1, "step": 3})
        app_logger.info("an info line is not a record")
        app_logger.warning("for telemetry? no", extra={"telemetry": False})
    app_logger.error("failed", exc_info=ValueError("boom"))
    found = finished(logs, records)
    telemetry.shutdown()
    outside, inside, failed = found
    assert (outside.body, outside.severity_text, outside.trace_id) == (
        "before any phase",
        "WARN",
        0,
    )
    context = work.span.get_span_context()
    assert inside.body == "inside work" and inside.attributes["step"] == 3
    assert (inside.trace_id, inside.span_id) == (context.trace_id, context.span_id)
    assert "_private" not in inside.attributes
    assert failed.severity_text == "ERROR" and failed.attributes["exception.type"] == "ValueError"


def test_an_event_carries_its_attributes_and_the_context_it_is_given(
    clean_env, records, memory
) -> None:
    cfg = TracingConfig()
    tracing.setup(cfg, exporters=[memory])
    logs = start_logs(cfg, exporters=[records])
    root = tracing.start_span("batch")
    figures = {"step": 4, "loss": 2.5, "rates": {"a": 1.0, "b": None}, "acc": [0.5], "x": None}
    logs.event("app.step", figures, context=root.context, body="the line")
    root.end()
    (event,) = finished(logs, records)
    assert event.event_name == "app.step" and event.body == "the line"
    assert dict(event.attributes) == {"step": 4, "loss": 2.5, "rates": {"a": 1.0}, "acc": (0.5,)}
    assert event.trace_id == root.span.get_span_context().trace_id


def test_an_exception_that_ends_phases_is_one_error_record_of_the_innermost(
    clean_env, records, memory
) -> None:
    cfg = TracingConfig()
    tracing.setup(cfg, exporters=[memory])
    logs = start_logs(cfg, exporters=[records])
    with pytest.raises(KeyError), tracing.phase("outer"), tracing.phase("inner") as inner:
        raise KeyError("missing")
    (record,) = finished(logs, records)
    assert record.severity_text == "ERROR" and record.body == "KeyError: 'missing'"
    assert record.attributes["exception.type"] == "KeyError"
    assert "raise KeyError" in record.attributes["exception.stacktrace"]
    assert record.span_id == inner.span.get_span_context().span_id
    with pytest.raises(KeyError), tracing.phase("after"):  # logs shut down: no more sinks
        raise KeyError("later")


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        ({}, ["OTLPLogExporter"]),
        ({"OTEL_LOGS_EXPORTER": "none"}, []),
        ({"OTEL_LOGS_EXPORTER": "console"}, ["ConsoleLogRecordExporter"]),
        ({"OTEL_SDK_DISABLED": "true"}, []),
    ],
)
def test_logs_go_where_the_traces_go_unless_the_variables_say(
    clean_env, variables, expected
) -> None:
    for name, value in variables.items():
        clean_env.setenv(name, value)
    cfg = TracingConfig(otlp_endpoint="http://127.0.0.1:9")
    exporters = build_log_exporters(cfg)
    assert [type(e).__name__ for e in exporters] == expected
    logs = Logs(tracing.telemetry.build_resource(cfg), exporters)
    logs.attach("test_logs.none")
    assert logs.enabled == bool(expected)
    assert (logs.handler in logging.getLogger("test_logs.none").handlers) == bool(expected)
    logs.shutdown(timeout_s=1.0)
    assert logging.getLogger("test_logs.none").handlers == []


def test_no_endpoint_and_no_variable_is_no_logs(clean_env) -> None:
    assert build_log_exporters(TracingConfig()) == []
    clean_env.setenv("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT", "http://127.0.0.1:9/v1/logs")
    assert [type(e).__name__ for e in build_log_exporters(TracingConfig())] == ["OTLPLogExporter"]


def test_records_reach_an_otlp_http_receiver_with_the_traces_resource(
    clean_env, http_receiver, app_logger
) -> None:
    cfg = TracingConfig(otlp_endpoint=http_receiver.endpoint, default_service_name="logs-test")
    telemetry = tracing.setup(cfg)
    logs = start_logs(cfg, resource=telemetry.resource)
    logs.attach(app_logger.name)
    with tracing.phase("work"):
        app_logger.warning("careful")
    logs.event("logs-test.step", {"step": 1})
    report = logs.shutdown(timeout_s=4.0)
    telemetry.shutdown()
    (request,) = [r for r in http_receiver.requests if r.path == "/v1/logs"]
    assert [r["body"] for r in request.log_records] == ["careful", ""]
    assert request.log_records[1]["event_name"] == "logs-test.step"
    assert int(request.log_records[0]["trace_id"], 16) != 0
    assert request.resource["host.name"] == f'string_value: "{socket.gethostname()}"'
    assert request.resource["process.pid"].startswith("int_value: ")
    assert request.resource["service.name"] == 'string_value: "logs-test"'
    assert (report.records_exported, report.records_failed, report.records_dropped) == (2, 0, 0)
    assert report.summary() == "logs: records exported 2, failed 0, dropped 0"


def test_a_dead_endpoint_is_told_once_for_all_signals_and_the_logs_are_counted(
    clean_env, app_logger
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    clean_env.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    clean_env.setenv("OTEL_BLRP_SCHEDULE_DELAY", "50")
    told = Told()
    cfg = TracingConfig(otlp_endpoint=f"http://127.0.0.1:{port}")
    telemetry = tracing.setup(cfg, on_export_problem=told)
    logs = start_logs(cfg, on_export_problem=told)
    logs.attach(app_logger.name)
    for _ in range(5):
        with tracing.phase("work"):
            app_logger.warning("a warning")
    assert told.arrived.wait(TOLD_WITHIN_S + 5)
    time.sleep(1.0)  # both signals have failed by now; the second is not told
    started = time.monotonic()
    report = logs.shutdown(timeout_s=2.0)
    assert time.monotonic() - started < 1.0  # known unreachable: closed at once
    telemetry.shutdown(timeout_s=2.0)
    ((_, line),) = told.lines
    assert f"127.0.0.1:{port} (connection refused)" in line
    assert report.records_exported == 0 and report.records_not_delivered == 5


def test_bad_batch_variables_of_the_logs_are_one_line_and_the_sdks_default(
    clean_env, caplog, records
) -> None:
    clean_env.setenv("OTEL_BLRP_MAX_QUEUE_SIZE", "0")
    with caplog.at_level(logging.WARNING, logger="tracing"):
        logs = start_logs(TracingConfig(), exporters=[records])
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "tracing: ignoring OTEL_BLRP_MAX_QUEUE_SIZE='0' (not a whole number above 0); using 2048"
    ]
    logs.event("x", {})
    assert len(finished(logs, records)) == 1


def test_traces_metrics_and_logs_share_one_shutdown_bound(
    clean_env,
    silent_port,  # noqa: F811 - the fixture imported above
    app_logger,
) -> None:
    clean_env.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    clean_env.setenv("OTEL_BLRP_SCHEDULE_DELAY", "50")
    traces = TracingConfig(otlp_endpoint=f"http://127.0.0.1:{silent_port}")
    telemetry = tracing.setup(traces)
    metrics = start_metrics(MetricsConfig(export_interval_s=60), traces)
    metrics.observe("counter", "tokens", lambda: 5, unit="{token}")
    logs = start_logs(traces)
    logs.attach(app_logger.name)
    for _ in range(10):
        with tracing.phase("work"):
            app_logger.warning("hung")
    time.sleep(0.3)  # the span and log exports are under way, and hang
    started = time.monotonic()
    span_report, _ = shutdown_all(telemetry, metrics, timeout_s=2.0, logs=logs)
    took_s = time.monotonic() - started
    assert took_s < 2.5, took_s  # one bound for the three signals
    assert span_report.spans_not_delivered == 10
    report = logs.report()
    assert report.records_exported == 0 and report.records_not_delivered == 10
