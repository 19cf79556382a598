"""The stack's collector config, run by real collector code, feeds Jaeger and the dashboard.

Jaeger v2 is an OpenTelemetry Collector distribution built with the same contrib
release (v0.140) as the compose file's collector image, and it includes every
component docker/otel-collector/config.yaml uses (OTLP receiver and exporter,
memory_limiter, batch, spanmetrics connector, prometheus and otlphttp exporters). So
the binary the tests build can validate that config and run it: the config is loaded,
its addresses moved to loopback ports (and the Tempo exporter left out), spans sent
through it must reach a downstream Jaeger, and the Prometheus endpoint must serve the
very span metric names the Grafana dashboard queries (the trainer's own metrics are
pushed into Prometheus' OTLP receiver: test_prometheus_stack.py).
"""

from __future__ import annotations

import copy
import importlib.util
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import requests
import yaml
from conftest import REPO_ROOT, JaegerProcess, die_with_parent, free_port
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from run_metrics_sender import metrics_run
from spantree import PHASES, batch_tree_problems
from test_jaeger_otlp import NUM_BATCHES, emit_batches, provider_for, unique_service

from dflash.observe.bottleneck import WaitShares

COLLECTOR_CONFIG = REPO_ROOT / "docker" / "otel-collector" / "config.yaml"


def load_stack_checks() -> ModuleType:
    path = REPO_ROOT / "tests" / "test_stack_config.py"
    spec = importlib.util.spec_from_file_location("stack_checks_for_collector_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def validate(binary: Path, config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(binary), "validate", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("config", ["otel-collector/config.yaml", "jaeger/config.yaml"])
def test_stack_configs_pass_collector_validation(jaeger_binary: Path, config: str) -> None:
    done = validate(jaeger_binary, REPO_ROOT / "docker" / config)
    assert done.returncode == 0, done.stderr[-3000:]


def test_validation_rejects_a_broken_collector_config(jaeger_binary: Path, tmp_path: Path) -> None:
    config = yaml.safe_load(COLLECTOR_CONFIG.read_text())
    config["connectors"]["spanmetrics"]["histogram"]["explicit"]["buckets"][0] = "100 microseconds"
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump(config))
    done = validate(jaeger_binary, broken)
    assert done.returncode != 0
    assert "spanmetrics" in done.stderr


def loopback_config(
    downstream: JaegerProcess, ports: dict[str, int], logs_endpoint: str | None = None
) -> dict[str, Any]:
    """docker/otel-collector/config.yaml with its addresses moved onto free loopback ports;
    its Loki exporter sends to `logs_endpoint` (a stand-in's base URL), else the logs
    pipeline ends in the debug exporter (no Loki here)."""
    config = copy.deepcopy(yaml.safe_load(COLLECTOR_CONFIG.read_text()))
    if logs_endpoint is not None:
        config["exporters"]["otlphttp/loki"]["endpoint"] = logs_endpoint
    else:
        del config["exporters"]["otlphttp/loki"]
        config["exporters"]["debug"] = {"verbosity": "basic"}
        config["service"]["pipelines"]["logs"]["exporters"] = ["debug"]
    protocols = config["receivers"]["otlp"]["protocols"]
    protocols["grpc"]["endpoint"] = f"127.0.0.1:{ports['grpc']}"
    protocols["http"]["endpoint"] = f"127.0.0.1:{ports['http']}"
    config["exporters"]["otlp/jaeger"]["endpoint"] = f"127.0.0.1:{downstream.ports.otlp_grpc}"
    # No Tempo here; its exporter would only log connection errors.
    del config["exporters"]["otlp/tempo"]
    traces = config["service"]["pipelines"]["traces"]
    traces["exporters"] = [e for e in traces["exporters"] if e != "otlp/tempo"]
    config["exporters"]["prometheus"]["endpoint"] = f"127.0.0.1:{ports['prometheus']}"
    # The trainer's metrics go to the Prometheus a test starts on this port; a test
    # without one gets a free port where nothing listens (the exporter retries and logs,
    # the receiver still accepts the trainer's exports).
    server = ports.get("prometheus_server") or free_port()
    otlp_prometheus = f"http://127.0.0.1:{server}/api/v1/otlp"
    config["exporters"]["otlphttp/prometheus"]["endpoint"] = otlp_prometheus
    (reader,) = config["service"]["telemetry"]["metrics"]["readers"]
    reader["pull"]["exporter"]["prometheus"].update(host="127.0.0.1", port=ports["telemetry"])
    # Flush the span metrics often so that the test does not wait for the stack's 5 s.
    config["connectors"]["spanmetrics"]["metrics_flush_interval"] = "500ms"
    return config


class Collector:
    def __init__(self, binary: Path, config: dict[str, Any], tmp_path: Path, metrics_url: str):
        self.config_path = tmp_path / "collector.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = tmp_path / "collector.log"
        self.metrics_url = metrics_url
        self.binary = binary
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60.0) -> None:
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [str(self.binary), "--config", str(self.config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log_path.read_text()[-3000:]
            try:
                if requests.get(self.metrics_url, timeout=1).ok:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"collector not serving metrics:\n{self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture
def collector(
    jaeger_binary: Path, jaeger: JaegerProcess, tmp_path: Path
) -> Iterator[tuple[Collector, dict[str, int]]]:
    names = ("grpc", "http", "prometheus", "telemetry", "prometheus_server")
    ports = {name: free_port() for name in names}
    metrics_url = f"http://127.0.0.1:{ports['prometheus']}/metrics"
    process = Collector(jaeger_binary, loopback_config(jaeger, ports), tmp_path, metrics_url)
    try:
        process.start()
        yield process, ports
    finally:
        process.stop()


SAMPLE_RE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})? ", re.M)


def scrape(url: str, service: str) -> dict[str, list[str]]:
    """metric name -> label strings of its samples for `service`."""
    samples: dict[str, list[str]] = {}
    for match in SAMPLE_RE.finditer(requests.get(url, timeout=5).text):
        labels = match["labels"] or ""
        if f'service_name="{service}"' in labels:
            samples.setdefault(match["name"], []).append(labels)
    return samples


def test_collector_fans_out_and_emits_dashboard_metrics(
    collector: tuple[Collector, dict[str, int]], jaeger: JaegerProcess
) -> None:
    process, ports = collector
    service = unique_service("via-collector")
    exporter = OTLPSpanExporter(endpoint=f"http://127.0.0.1:{ports['grpc']}", insecure=True)
    emit_batches(provider_for(service, exporter))
    # The trainer's own metrics take the collector's metrics pipeline.
    with metrics_run(service, f"http://127.0.0.1:{ports['grpc']}", "r1", WaitShares(0.2, 0, 0)):
        time.sleep(0.6)

    traces = jaeger.wait_for(
        lambda: jaeger.traces(service),
        lambda found: (
            len(found) == NUM_BATCHES and all(len(t["spans"]) == len(PHASES) for t in found)
        ),
    )
    assert all(batch_tree_problems(t) == [] for t in traces)

    def calls_per_phase() -> dict[str, list[str]]:
        return scrape(process.metrics_url, service)

    def every_phase_counted(samples: dict[str, list[str]]) -> bool:
        counted = " ".join(samples.get("traces_span_metrics_calls_total", []))
        return all(f'span_name="{phase}"' in counted for phase in PHASES)

    samples = calls_per_phase()
    deadline = time.monotonic() + 30
    while not every_phase_counted(samples):
        assert time.monotonic() < deadline, f"span metrics incomplete: {samples}"
        time.sleep(0.3)
        samples = calls_per_phase()

    checks = load_stack_checks()
    stack = checks.load_stack()
    used = set().union(*(checks.metric_names_in(q) for _, q in checks.prometheus_queries(stack)))
    assert used, "the dashboard queries no metric"
    # The trainer's own metrics go to Prometheus over OTLP (test_prometheus_stack.py);
    # what the collector serves for scraping is the span metrics alone.
    pushed, _ = checks.app_metrics(stack)
    scraped = used - pushed
    assert scraped <= set(samples), (
        f"dashboard metrics not served: {sorted(scraped - set(samples))}"
    )
    emitted, _ = checks.scraped_metrics(stack)
    assert emitted == set(samples), "the static check's name model differs from the collector"
    bounds = {
        m.group(1)
        for labels in samples["traces_span_metrics_duration_milliseconds_bucket"]
        for m in [re.search(r'le="([^"]+)"', labels)]
        if m
    }
    assert {"0.1", "30000", "+Inf"} <= bounds
