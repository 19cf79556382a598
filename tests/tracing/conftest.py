"""Fixtures for the tracing tests: an in-memory exporter behind the real SDK provider."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# The editable install may predate tracing/__init__.py; import this checkout's package.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)

import tracing  # noqa: E402


@pytest.fixture
def memory() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    yield exporter
    tracing.shutdown(timeout_s=1.0)
