"""Shutdown time with an unreachable collector (goal: <= 5 s, the SDK default waits 30 s).

Cases, for OTLP over gRPC and over HTTP:
  closed   a port on 127.0.0.1 where nothing listens (connection refused)
  silent   a port that accepts TCP connections but never answers (a hung collector)

Each case records spans for a moment (span creation must not block), with the metrics
signal beside the traces (one counter, one export at shutdown), then shuts both down
within one bound, `tracing.metrics.shutdown_all(..., timeout_s=5.0)`, and prints its
duration and both reports. `--sequential` shuts the metrics down first, then the traces,
each with its own bound (what dflash-train did before: a dead collector cost two bounds).

Usage: python bench/tracing_shutdown.py [--spans N]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
from pathlib import Path

# Run from a checkout: prefer its `tracing` over whatever the environment installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tracing  # noqa: E402
from tracing.metrics import MetricsConfig, shutdown_all, start_metrics  # noqa: E402


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # released on close: nothing listens there


def silent_port(stop: threading.Event) -> int:
    """Accepts connections and keeps them open without ever answering."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    server.settimeout(0.1)
    held: list[socket.socket] = []

    def serve() -> None:
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue
        for conn in held:
            conn.close()
        server.close()

    threading.Thread(target=serve, name="silent-collector", daemon=True).start()
    return server.getsockname()[1]


def run_case(protocol: str, port: int, spans: int, sequential: bool) -> tuple[float, float, str]:
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "200"  # read by the SDK's batch processor
    cfg = tracing.TracingConfig(otlp_endpoint=f"http://127.0.0.1:{port}", otlp_protocol=protocol)
    telemetry = tracing.setup(cfg, on_export_problem=lambda line: print(f"      told: {line}"))
    metrics = start_metrics(MetricsConfig(export_interval_s=60), cfg, on_export_problem=print)
    metrics.observe("counter", "spans", lambda: spans, unit="{span}")
    started = time.perf_counter()
    for step in range(spans // 10):
        root = tracing.start_span("batch", {"step": step})
        for _ in range(9):
            with tracing.phase("work", parent=root):
                pass
        root.end()
    record_us = (time.perf_counter() - started) / spans * 1e6
    time.sleep(0.5)  # let the exporter start (and hang on) a request
    t0 = time.perf_counter()
    if sequential:
        metrics_report = metrics.shutdown(timeout_s=5.0)
        report = telemetry.shutdown(timeout_s=5.0)
    else:
        report, metrics_report = shutdown_all(telemetry, metrics, timeout_s=5.0)
    summary = f"{report.summary()}; {metrics_report.summary() if metrics_report else ''}"
    return time.perf_counter() - t0, record_us, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=5000, help="spans recorded before shutdown")
    parser.add_argument(
        "--sequential", action="store_true", help="metrics, then traces, each with its own bound"
    )
    args = parser.parse_args()
    stop = threading.Event()
    ports = {"closed": closed_port(), "silent": silent_port(stop)}
    worst_s = 0.0
    for protocol in ("grpc", "http"):
        for case, port in ports.items():
            shutdown_s, record_us, summary = run_case(protocol, port, args.spans, args.sequential)
            worst_s = max(worst_s, shutdown_s)
            print(f"{protocol:<5} {case:<7} shutdown {shutdown_s:5.2f}s  {record_us:5.1f} us/span")
            print(f"      {summary}")
    stop.set()
    print(f"worst shutdown {worst_s:.2f}s (goal <= 5 s): {'OK' if worst_s <= 5.0 else 'MISSED'}")


if __name__ == "__main__":
    main()
