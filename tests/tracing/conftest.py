"""Fixtures for the tracing tests: an in-memory exporter behind the real SDK provider, an
environment without OTEL_* variables, and real OTLP receivers (HTTP and gRPC)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# The editable install may predate tracing/__init__.py; import this checkout's package.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)
from receivers import GrpcReceiver, HttpReceiver  # noqa: E402

import tracing  # noqa: E402


@pytest.fixture
def memory() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    yield exporter
    tracing.shutdown(timeout_s=1.0)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No OTEL_* variable set; the returned monkeypatch sets the ones a test needs."""
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)
    return monkeypatch


@pytest.fixture
def http_receiver() -> Iterator[HttpReceiver]:
    receiver = HttpReceiver()
    yield receiver
    receiver.close()


@pytest.fixture
def grpc_receiver() -> Iterator[GrpcReceiver]:
    receiver = GrpcReceiver()
    yield receiver
    receiver.close()
