"""The third signal end to end: a real short `dflash-train train` run's log records reach
the real OpenTelemetry Collector, and through the stack's logs pipeline a stand-in for
Loki, each tied to its trace in the real Jaeger.

The Collector is built from its Go modules (tools/otelcol) and runs
docker/otel-collector/config.yaml on free loopback ports: its traces go to the session's
Jaeger, its logs through the stack's own `otlphttp/loki` exporter (OTLP/HTTP under
`/otlp`, as Loki 3 takes it) to `LokiStandIn`, which decodes each request with the OTLP
protobuf definitions. The run is the command a user types, with the collector's port.
"""

from __future__ import annotations

import gzip
import json
import socket
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from conftest import JaegerProcess, free_port
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2 as logs_pb
from test_collector_pipeline import Collector, loopback_config
from test_doc_commands import otelcol_binary  # noqa: F401 - the session fixture
from test_e2e_dflash import checkout_env, dflash_train
from test_jaeger_otlp import unique_service

pytestmark = pytest.mark.slow

STEPS = 12
RUN_TIMEOUT_S = 420


def _value(value: Any) -> Any:
    """An OTLP AnyValue as Python: maps as dicts, arrays as lists."""
    kind = value.WhichOneof("value")
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in value.kvlist_value.values}
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return None if kind is None else getattr(value, kind)


class LokiStandIn:
    """Loki's OTLP endpoint, stood in for on a free loopback port: every log record it
    receives (`records`), with its resource, as plain Python."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.paths: list[str] = []
        self._lock = threading.Lock()
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server hook name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                # The collector's otlphttp exporter compresses (gzip, its default), as
                # Loki accepts.
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                stand_in.take(self.path, logs_pb.ExportLogsServiceRequest.FromString(body))
                payload = logs_pb.ExportLogsServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def take(self, path: str, request: Any) -> None:
        found = []
        for resource_logs in request.resource_logs:
            resource = {a.key: _value(a.value) for a in resource_logs.resource.attributes}
            for scope_logs in resource_logs.scope_logs:
                for record in scope_logs.log_records:
                    found.append(
                        {
                            "resource": resource,
                            "scope": scope_logs.scope.name,
                            "event_name": record.event_name,
                            "severity": record.severity_text,
                            "body": _value(record.body),
                            "attributes": {a.key: _value(a.value) for a in record.attributes},
                            "trace_id": record.trace_id.hex(),
                            "span_id": record.span_id.hex(),
                        }
                    )
        with self._lock:
            self.paths.append(path)
            self.records += found

    def of(self, service: str) -> list[dict[str, Any]]:
        with self._lock:
            return [r for r in self.records if r["resource"].get("service.name") == service]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture(scope="module")
def loki() -> Iterator[LokiStandIn]:
    stand_in = LokiStandIn()
    try:
        yield stand_in
    finally:
        stand_in.close()


@pytest.fixture(scope="module")
def collector_ports(
    otelcol_binary: Path,  # noqa: F811 - the fixture imported above
    jaeger: JaegerProcess,
    loki: LokiStandIn,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, int]]:
    """The stack's Collector config on free ports: traces into Jaeger, logs to `loki`."""
    ports = {name: free_port() for name in ("grpc", "http", "prometheus", "telemetry")}
    config = loopback_config(jaeger, ports, logs_endpoint=f"{loki.base_url}/otlp")
    metrics_url = f"http://127.0.0.1:{ports['prometheus']}/metrics"
    process = Collector(otelcol_binary, config, tmp_path_factory.mktemp("otelcol"), metrics_url)
    try:
        process.start()
        yield ports
    finally:
        process.stop()


def train(args: list[str], cwd: Path, service: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`dflash-train train ARGS` of this checkout, STEPS steps, as `service`."""
    environment = {k: v for k, v in checkout_env().items() if not k.startswith("OTEL_")}
    environment.update(DFLASH_STEPS=str(STEPS), OTEL_SERVICE_NAME=service, **env)
    return subprocess.run(
        [*dflash_train(), "train", *args],
        cwd=cwd,
        env=environment,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )


def wait_for_records(
    loki: LokiStandIn, service: str, done: Any, jaeger: JaegerProcess
) -> list[dict[str, Any]]:
    return jaeger.wait_for(
        lambda: loki.of(service), done, timeout_s=30, waiting_for=f"log records of {service}"
    )


def test_a_runs_step_events_reach_the_collector_tied_to_their_traces(
    collector_ports: dict[str, int], loki: LokiStandIn, jaeger: JaegerProcess, tmp_path: Path
) -> None:
    service = unique_service("logs")
    endpoint = f"http://127.0.0.1:{collector_ports['grpc']}"
    out = tmp_path / "run"
    done = train(
        ["--otlp-endpoint", endpoint, "--otlp-protocol", "grpc", "--output-dir", str(out)],
        tmp_path,
        service,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) >= 2
    summary = [line for line in output.splitlines() if line.startswith("telemetry: tracing:")]
    assert len(summary) == 1 and "; logs: records exported " in summary[0], output[-3000:]
    assert summary[0].endswith("failed 0, dropped 0"), summary[0]
    exported = int(summary[0].split("logs: records exported ")[1].split(",")[0])

    records = wait_for_records(loki, service, lambda r: len(r) >= exported, jaeger)
    assert len(records) == exported and all(p == "/otlp/v1/logs" for p in loki.paths)
    events = [r for r in records if r["event_name"] == "dflash.step"]
    # One event per metrics.jsonl line, in order: its figures as attributes, the line as
    # its body (the final evaluation adds keys to the last line afterwards).
    assert [e["attributes"]["step"] for e in events] == [line["step"] for line in lines]
    for event, line in zip(events, lines, strict=True):
        body = json.loads(event["body"])
        assert event["attributes"] == {k: v for k, v in body.items() if v is not None}
        assert all(line[key] == value for key, value in body.items()), (line, body)
        assert event["severity"] == "INFO" and event["scope"] == "tracing"

    # The resource says where the rank ran: the traces' resource, host and process.
    resource = events[0]["resource"]
    assert resource["host.name"] == socket.gethostname()
    assert isinstance(resource["process.pid"], int) and resource["process.pid"] > 0
    assert resource["dflash.rank"] == 0 and resource["dflash.run.id"]
    assert all(e["resource"] == resource for e in records)

    # Each event names the trace of its step's batch, and the drafter.step span in it.
    traces = jaeger.wait_for(
        lambda: jaeger.traces(service),
        lambda found: len(found) >= STEPS,
        waiting_for=f"the traces of {service}",
    )
    spans = {
        (t["traceID"].rjust(32, "0"), s["spanID"].rjust(16, "0")): s
        for t in traces
        for s in t["spans"]
    }
    for event in events:
        assert int(event["trace_id"], 16) and int(event["span_id"], 16), event
        span = spans[(event["trace_id"], event["span_id"])]
        tags = {tag["key"]: tag["value"] for tag in span["tags"]}
        assert span["operationName"] == "drafter.step"
        assert tags["dflash.step"] == event["attributes"]["step"] - 1  # 0-based on spans


def test_a_diverging_runs_warnings_and_error_are_records_of_its_traces(
    collector_ports: dict[str, int], loki: LokiStandIn, jaeger: JaegerProcess, tmp_path: Path
) -> None:
    service = unique_service("logs-diverged")
    endpoint = f"http://127.0.0.1:{collector_ports['grpc']}"
    args = ["--otlp-endpoint", endpoint, "--otlp-protocol", "grpc", "--lr", "1e30"]
    args += ["--log-every", "1", "--max-bad-steps", "3", "--output-dir", str(tmp_path / "run")]
    done = train(args, tmp_path, service)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-4000:]
    error_line = output.strip().splitlines()[-1]
    assert error_line.startswith("Error: ") and "DivergedError" in error_line, output[-3000:]
    # What the run printed is what it printed before the logs: the records add no line.
    assert "non-finite hidden" not in output and "steps skipped since" not in output

    records = wait_for_records(
        loki, service, lambda r: any(x["severity"] == "ERROR" for x in r), jaeger
    )
    events = {r["attributes"]["step"]: r for r in records if r["event_name"] == "dflash.step"}
    warnings = [r for r in records if r["severity"] == "WARN"]
    # Each skipped step is a WARN record of that step's trace (its drafter.step span).
    assert [w["attributes"]["dflash.step"] for w in warnings] == [2, 3, 4], warnings
    for warning in warnings:
        step = warning["attributes"]["dflash.step"]
        assert "steps skipped since the last logged step" in warning["body"]
        assert (warning["trace_id"], warning["span_id"]) == (
            events[step]["trace_id"],
            events[step]["span_id"],
        )
    # The line the command ends with is an ERROR record with the exception's stack trace.
    (error,) = [r for r in records if r["severity"] == "ERROR"]
    assert error["body"] == error_line
    assert error["attributes"]["exception.type"] == "PipelineError"
    assert "DivergedError" in error["attributes"]["exception.stacktrace"]


def test_a_logs_backend_that_is_down_is_one_line_and_costs_the_run_nothing(
    collector_ports: dict[str, int], tmp_path: Path
) -> None:
    # Traces and metrics to the collector, logs to their own endpoint, where nothing
    # listens (a flag would send all three to one place: the variables say it).
    service = unique_service("logs-down")
    dead = f"http://127.0.0.1:{free_port()}"
    out = tmp_path / "run"
    done = train(
        ["--output-dir", str(out)],
        tmp_path,
        service,
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{collector_ports['grpc']}",
        OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
        OTEL_EXPORTER_OTLP_LOGS_ENDPOINT=dead,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    told = [line for line in output.splitlines() if " fails: " in line]
    assert len(told) == 1, output[-3000:]
    assert told[0].startswith(f"telemetry: logs export to {dead} (grpc) fails: nothing listens")
    (summary,) = [line for line in output.splitlines() if line.startswith("telemetry: tracing:")]
    assert "spans exported " in summary and ", failed 0, dropped 0 (queue" in summary
    assert "spans exported 0," not in summary, summary
    assert "; metrics: exports ok " in summary and "failed 0 (0 points lost)" in summary
    assert "; logs: records exported 0, failed " in summary, summary
    telemetry = json.loads((out / "summary.json").read_text())["telemetry"]
    lines = len((out / "metrics.jsonl").read_text().splitlines())
    lost = telemetry["log_records_failed"] + telemetry["log_records_dropped"]
    # Every step event is counted lost, and the record of the told line if it came in time.
    assert telemetry["log_records_exported"] == 0 and lines <= lost <= lines + 1, telemetry
    assert telemetry["shutdown_s"] < 4.0  # the one shared bound, not one more per signal
