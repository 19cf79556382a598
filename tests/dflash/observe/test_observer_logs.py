"""The run's logs: one logger (dflash.log) that prints the lines as before, and, while
telemetry exports logs, a `dflash.step` event per logged step tied to its step's span,
and warnings (a skipped non-finite step) as records of that span, never printed."""

from __future__ import annotations

import json
import logging

import pytest
from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import tracing
from dflash import log as dlog
from dflash.observe.observer import BRIDGED_LOGGERS, STEP_EVENT, Observer, setup_tracing
from dflash.run.pipelined import run_pipeline
from tests.dflash.app_fixtures import small_cfg, tiny_target  # noqa: F401 - fixture
from tracing.logs import Logs

STEPS = 4


def test_say_prints_the_line_alone_with_the_level_it_says(capsys) -> None:
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append  # type: ignore[method-assign]
    dlog.logger.addHandler(handler)
    try:
        dlog.say("loss: block size 8")
        dlog.say("warning: this config needs about 9.0 GiB per device")
        dlog.get_logger("run").warning("for telemetry alone", extra=dlog.NOT_PRINTED)
        with dlog.line_writer(lambda line: print(f"[err] {line}")):
            dlog.say("Error: a line")
        dlog.say("after")
    finally:
        dlog.logger.removeHandler(handler)
    printed = capsys.readouterr().out.splitlines()
    assert printed == [
        "loss: block size 8",
        "warning: this config needs about 9.0 GiB per device",
        "[err] Error: a line",
        "after",
    ]
    levels = [(r.levelname, r.name) for r in seen]
    assert levels == [
        ("INFO", "dflash"),
        ("WARNING", "dflash"),
        ("WARNING", "dflash.run"),
        ("ERROR", "dflash"),
        ("INFO", "dflash"),
    ]


def observer_with_logs() -> tuple[Observer, InMemorySpanExporter, InMemoryLogRecordExporter]:
    spans, records = InMemorySpanExporter(), InMemoryLogRecordExporter()
    cfg = tracing.TracingConfig(report_interval_s=60, attribute_namespace="dflash")
    telemetry = setup_tracing(cfg, span_processors=[SimpleSpanProcessor(spans)])
    logs = Logs(telemetry.resource, [records])
    logs.attach(*BRIDGED_LOGGERS)
    return Observer(cfg, telemetry, world_size=1, logs=logs), spans, records


@pytest.mark.usefixtures("tiny_target")
def test_each_logged_step_is_an_event_of_its_drafter_step_span(tmp_path) -> None:
    obs, spans, records = observer_with_logs()
    lines: list[str] = []
    cfg = small_cfg(tmp_path, steps=STEPS, log_every=1)
    try:
        run_pipeline(cfg, log=lines.append, observer=obs)
    finally:
        obs.close(lines.append)
    assert not any(h for h in logging.getLogger("dflash").handlers if h is obs.logs.handler)
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    events = [r.log_record for r in records.get_finished_logs()]
    assert [e.event_name for e in events] == [STEP_EVENT] * STEPS
    steps = {
        (s.context.trace_id, s.context.span_id): s
        for s in spans.get_finished_spans()
        if s.name == "drafter.step"
    }
    for event, line in zip(events, metrics, strict=True):
        assert json.loads(event.body) == line
        assert event.attributes["loss"] == line["loss"] and event.attributes["step"] == line["step"]
        assert dict(event.attributes["tokens_per_s"]) == line["tokens_per_s"]
        assert "diverged_at_step" not in event.attributes  # None: no attribute
        span = steps[(event.trace_id, event.span_id)]
        assert span.attributes["dflash.step"] == line["step"] - 1
    (telemetry,) = [line for line in lines if line.startswith("telemetry: tracing:")]
    assert telemetry.endswith(f"; logs: records exported {STEPS}, failed 0, dropped 0")
    assert obs.close(lines.append)["log_records_exported"] == STEPS


def test_a_skipped_step_is_a_warning_of_its_span_and_no_line(tmp_path) -> None:
    obs, _, records = observer_with_logs()
    root = tracing.start_span("batch")
    with tracing.phase("drafter.step", parent=root) as step:
        context = step.context
    root.end()
    lines: list[str] = []
    obs.record_step({"step": 5, "loss": 1.0, "bad_steps": 0})
    obs.record_step({"step": 6, "loss": float("nan"), "bad_steps": 2}, context=context)
    obs.close(lines.append, table=False)
    warning, events = None, []
    for record in (r.log_record for r in records.get_finished_logs()):
        if record.event_name == STEP_EVENT:
            events.append(record)
        else:
            warning = record
    assert len(events) == 2 and warning is not None
    assert warning.severity_text == "WARN" and warning.attributes["dflash.bad_steps"] == 2
    assert warning.body.startswith("step 6: 2 steps skipped since the last logged step")
    assert warning.span_id == step.span.get_span_context().span_id
    assert not any("skipped" in line for line in lines)
