"""The README's, the compose file's and the docs' tracing commands, run as a new user
would, deliver every span through the real OpenTelemetry Collector to the real Jaeger.

The Collector is built from its Go modules (tools/otelcol: the components of
docker/otel-collector/config.yaml at the compose image's release) and runs that config
with its receivers where the commands send: localhost:4317 (gRPC) and localhost:4318
(OTLP/HTTP); its Jaeger exporter goes to the session's Jaeger. Each documented command
runs literally (the environment sets only the step count and a service name to find it
by); the compose trainer's command runs with its host `otel-collector` as localhost.
A command in the wrong protocol (the README's before: OTLP/HTTP to 4317) is one line,
told within seconds of the first failed export, naming the fix.

Ports 4317 and 4318 are the machine's: test sessions take turns through a lock file,
and a port held by something else skips these tests (fails under DFLASH_REQUIRE_OTELCOL=1).
"""

from __future__ import annotations

import fcntl
import os
import re
import shlex
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO_ROOT, JaegerProcess, free_port
from test_collector_pipeline import Collector, loopback_config
from test_e2e_dflash import checkout_env, dflash_train
from test_jaeger_otlp import unique_service

import tracing
from tests.doc_commands import compose_trainer_command, runnable_commands

pytestmark = pytest.mark.slow

BUILD_SCRIPT = REPO_ROOT / "tools" / "otelcol" / "build.sh"
BUILD_TIMEOUT_S = 1800
PORTS = {"grpc": 4317, "http": 4318}
LOCK_FILE = Path("/tmp/dflash-train-otlp-4317-4318.lock")
LOCK_WAIT_S = 900
STEPS = 12
RUN_TIMEOUT_S = 420
TOLD_WITHIN_S = 5.0
SUMMARY = re.compile(r"spans exported (\d+), failed (\d+), dropped (\d+)")


def otelcol_unavailable(reason: str) -> None:
    if os.environ.get("DFLASH_REQUIRE_OTELCOL") == "1":
        pytest.fail(f"{reason} (DFLASH_REQUIRE_OTELCOL=1: these tests must run)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def otelcol_binary() -> Path:
    """DFLASH_OTELCOL_BIN, else the cached build of tools/otelcol (building it once)."""
    explicit = os.environ.get("DFLASH_OTELCOL_BIN")
    if explicit:
        if not os.access(explicit, os.X_OK):
            otelcol_unavailable(f"DFLASH_OTELCOL_BIN={explicit} is not an executable file")
        return Path(explicit)
    if shutil.which("go") is None:
        otelcol_unavailable("Go is not installed: the Collector is built from tools/otelcol/go.mod")
    try:
        done = subprocess.run(
            ["bash", str(BUILD_SCRIPT)],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        otelcol_unavailable(f"building the Collector took longer than {BUILD_TIMEOUT_S} s")
    if done.returncode != 0:
        otelcol_unavailable(f"tools/otelcol/build.sh failed:\n{done.stderr[-3000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def _port_taken(port: int) -> bool:
    """Something listens there (a closed collector's connections in TIME_WAIT do not count)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


@pytest.fixture(scope="module")
def documented_ports() -> Iterator[None]:
    """Holds the machine's turn on ports 4317 and 4318 (other test sessions wait)."""
    with LOCK_FILE.open("a") as lock:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    otelcol_unavailable(f"{LOCK_FILE} stayed locked for {LOCK_WAIT_S} s")
                time.sleep(1)
        try:
            taken = [port for port in PORTS.values() if _port_taken(port)]
            if taken:
                otelcol_unavailable(f"ports {taken} are in use on this machine")
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="module")
def collector(
    otelcol_binary: Path,
    jaeger: JaegerProcess,
    documented_ports: None,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Collector]:
    """The stack's Collector config on the documented ports, into the session's Jaeger."""
    ports = {**PORTS, "prometheus": free_port(), "telemetry": free_port()}
    config = loopback_config(jaeger, ports)
    metrics_url = f"http://127.0.0.1:{ports['prometheus']}/metrics"
    process = Collector(otelcol_binary, config, tmp_path_factory.mktemp("otelcol"), metrics_url)
    try:
        process.start()
        yield process
    finally:
        process.stop()


def run(argv: list[str], cwd: Path, service: str) -> str:
    """`argv` (a `dflash-train ...` command) as this checkout's program; its output."""
    assert argv[0] == "dflash-train", argv
    env = {k: v for k, v in checkout_env().items() if not k.startswith("OTEL_")}
    env.update(DFLASH_STEPS=str(STEPS), OTEL_SERVICE_NAME=service)
    done = subprocess.run(
        [*dflash_train(), *argv[1:]],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    return output


def assert_delivered(output: str, jaeger: JaegerProcess, service: str) -> None:
    (summary,) = SUMMARY.findall(output)
    exported, failed, dropped = map(int, summary)
    assert exported > 0 and failed == 0 and dropped == 0, summary
    assert "metrics: exports ok" in output and "failed 0 (0 points lost)" in output, output[-2000:]
    assert " fails: " not in output, output[-2000:]
    traces = jaeger.wait_for(
        lambda: jaeger.traces(service),
        lambda found: sum(len(t["spans"]) for t in found) >= exported,
    )
    batches = [t for t in traces if any(s["operationName"] == "batch" for s in t["spans"])]
    assert len(batches) == STEPS and sum(len(t["spans"]) for t in traces) == exported


@pytest.mark.parametrize("command", sorted(runnable_commands()))
def test_a_documented_command_delivers_every_span_to_jaeger(
    collector: Collector, jaeger: JaegerProcess, tmp_path: Path, command: str
) -> None:
    service = unique_service("doc-command")
    output = run(shlex.split(command), tmp_path, service)
    assert_delivered(output, jaeger, service)


def test_the_compose_trainer_command_delivers_every_span_to_jaeger(
    collector: Collector, jaeger: JaegerProcess, tmp_path: Path
) -> None:
    # The service's command with the compose network's host name as this machine's.
    argv = [
        arg.replace("otel-collector", "localhost").replace("${DFLASH_TRAIN_STEPS:-300}", str(STEPS))
        for arg in compose_trainer_command()
    ]
    argv[argv.index("--output-dir") + 1] = str(tmp_path / "compose")
    service = unique_service("compose-trainer")
    output = run(argv, tmp_path, service)
    assert_delivered(output, jaeger, service)


def test_http_to_the_grpc_port_is_one_line_naming_the_fix(
    collector: Collector, tmp_path: Path
) -> None:
    # The README's command before: OTLP/HTTP to the gRPC port, 0 spans, exit 0.
    output = run(
        shlex.split("dflash-train train --otlp-endpoint http://localhost:4317"), tmp_path, "x"
    )
    told = [line for line in output.splitlines() if " fails: " in line]
    # One line for the endpoint, whichever signal failed there first (the logs' step
    # events go out every second); the others' failures are counted at the end.
    assert len(told) == 1, output[-3000:]
    assert re.match(r"telemetry: (traces|metrics|logs) export", told[0]), told[0]
    assert "metrics: exports ok 0, failed 1" in output, output[-3000:]
    logs = re.search(r"logs: records exported 0, failed (\d+), dropped (\d+)", output)
    assert logs and int(logs[1]) + int(logs[2]) > 0, output[-3000:]
    for line in told:
        assert line.startswith("telemetry: ") and "localhost:4317 speaks gRPC" in line
        assert "pass --otlp-protocol grpc, or use port 4318" in line
    assert "BadStatusLine" not in output and "\\x00" not in output
    assert re.search(r"spans exported 0, failed [1-9]", output)


@pytest.mark.parametrize(
    ("url", "protocol", "said"),
    [
        ("http://localhost:4317", "http/protobuf", "speaks gRPC (HTTP/2), not OTLP/HTTP"),
        ("http://localhost:4318", "grpc", "speaks HTTP/1.1 (OTLP/HTTP), not gRPC"),
    ],
)
def test_a_wrong_protocol_is_told_within_seconds_of_the_first_failure(
    collector: Collector, url: str, protocol: str, said: str
) -> None:
    lines: list[tuple[float, str]] = []
    arrived = threading.Event()

    def told(line: str) -> None:
        lines.append((time.monotonic(), line))
        arrived.set()

    cfg = tracing.TracingConfig(otlp_endpoint=url, otlp_protocol=protocol)
    telemetry = tracing.setup(cfg, on_export_problem=told)
    (export_watch,) = [e.watch for e in telemetry.exporters]
    for _ in range(10):
        with tracing.phase("work"):
            pass
    telemetry.force_flush(timeout_s=0.05)
    deadline = time.monotonic() + 20
    while not export_watch.failing and time.monotonic() < deadline:
        time.sleep(0.005)
    first_failure = time.monotonic()
    assert arrived.wait(TOLD_WITHIN_S + 5)
    report = telemetry.shutdown(timeout_s=4.0)
    ((when, line),) = lines
    assert when - first_failure < TOLD_WITHIN_S and said in line, line
    assert report.spans_exported == 0 and report.spans_failed == 10
