"""`setup_memory`: tracing with spans going synchronously to an in-memory exporter.

A module of its own, not conftest.py: with tests/integration in the same run, `from
conftest import ...` would find that directory's conftest instead.
"""

from __future__ import annotations

from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import tracing


def setup_memory(
    exporter: InMemorySpanExporter, device_clock: object = None, **cfg: object
) -> tracing.Telemetry:
    """Tracing with spans going synchronously to `exporter`."""
    return tracing.setup(
        tracing.TracingConfig(**cfg),  # type: ignore[arg-type]
        span_processors=[SimpleSpanProcessor(exporter)],
        device_clock=device_clock,  # type: ignore[arg-type]
    )
