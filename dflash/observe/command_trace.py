"""One trace for a command that talks to a serving engine (`eval --server`,
`regenerate --server`).

The command's root span (`dflash.eval`, `dflash.regenerate`) is the current span while it
runs, and tracing's provider is the global one, so that each request to the server is a
GenAI client span under it (dflash.target.served) whose `traceparent` a vLLM started with
`--otlp-traces-endpoint` continues: the command, every completion and the engine's own
`llm_request` spans are one trace. Spans go where `--otlp-endpoint`/`--trace-file` or the
OTEL_* variables say; with none of them, and no application provider, nothing is set up.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

import tracing
from dflash.config.settings import TelemetryConfig
from dflash.log import Log
from dflash.observe.observer import setup_tracing, tracing_config

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


def wants_traces(tel: TelemetryConfig, env: dict[str, str] | None = None) -> bool:
    """A destination for spans was given: a flag, or an endpoint variable the SDK reads."""
    env = dict(os.environ) if env is None else env
    if tel.otlp_endpoint or tel.trace_file:
        return True
    return any(env.get(name) for name in ENDPOINT_VARIABLES)


@contextmanager
def command_trace(command: str, tel: TelemetryConfig, log: Log) -> Iterator[None]:
    """Runs the body under the root span `dflash.COMMAND`; ends it (ERROR when the body
    raised) and shuts tracing down within its bound, with the delivery line, on the way
    out. Without a destination the body runs untraced (an application's own global
    provider still gets the client spans: they use the global API)."""
    if not wants_traces(tel):
        yield
        return
    run_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
    cfg = tracing_config(tel, rank=0, run_id=run_id)
    telemetry = setup_tracing(cfg, install_global_provider=True)
    where = " + ".join(telemetry.sinks) or "the application's TracerProvider"
    service = telemetry.resource.attributes.get("service.name")
    log(f"{command}: traces -> {where} (service {service}, run {run_id})")
    root = tracing.start_span(f"dflash.{command}", {"dflash.command": command})
    token = otel_context.attach(root.context) if root.context is not None else None
    try:
        yield
    except BaseException as exc:
        span = root.span
        if span is not None and span.is_recording():
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:200]))
        raise
    finally:
        if token is not None:
            otel_context.detach(token)
        root.end()
        report = telemetry.shutdown()
        log(f"{command}: {report.summary()}")


def current_trace_id() -> str | None:
    """The hex trace id of the current span (None outside a recorded trace)."""
    span_context = trace.get_current_span().get_span_context()
    return format(span_context.trace_id, "032x") if span_context.is_valid else None
