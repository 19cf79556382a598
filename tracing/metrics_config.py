"""Validated settings of the metrics signal: explicit argument > OTEL_* variable > default.

The OTLP settings follow the specification's per-signal rule: an
OTEL_EXPORTER_OTLP_METRICS_* variable wins over the traces' setting (`base`, when it is
not from a traces-only variable), which wins over the generic OTEL_EXPORTER_OTLP_*
one. As for traces, a malformed variable is warned about once and treated as unset
(`tracing.env`); a bad explicit argument raises TracingConfigError.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tracing import env as otel_env
from tracing.config import (
    DEFAULT_ENDPOINTS,
    TracingConfig,
    TracingConfigError,
    check_choice,
    env_parser,
    parse_endpoint,
    parse_exporters,
    parse_header_argument,
    parse_protocol,
    read_protocol,
)

METRICS_EXPORTERS = ("none", "otlp", "console")
TEMPORALITIES = ("cumulative", "delta", "lowmemory")


@dataclass(frozen=True)
class MetricsConfig:
    """Settings of the metrics signal; validated on construction. `from_env` honours OTEL_*."""

    exporter: tuple[str, ...] = ("none",)
    """Any of none, otlp, console (a comma-separated string is accepted)."""
    otlp_endpoint: str | None = None
    """Collector URL: http(s)://host[:port][/path]; for HTTP /v1/metrics is appended."""
    otlp_endpoint_is_metrics_url: bool = False
    """The HTTP endpoint is the full metrics URL, used as is
    (OTEL_EXPORTER_OTLP_METRICS_ENDPOINT)."""
    otlp_protocol: str = "grpc"
    """grpc or http (OTLP/HTTP with protobuf bodies; "http/protobuf" is accepted)."""
    otlp_headers: Mapping[str, str] = field(default_factory=dict)
    """Extra request headers; names are lower-cased."""
    export_interval_s: float = 60.0
    """Period of collection and export (OTEL_METRIC_EXPORT_INTERVAL, in ms there)."""
    export_timeout_s: float = 2.0
    """Bound on one export, retries included: a dead collector costs the reader thread
    at most this per interval (not the specification's 30 s)."""
    shutdown_timeout_s: float = 3.0
    """Default bound on `Metrics.shutdown` (final export, exporter close)."""
    namespace: str = ""
    """Prefix of every instrument name (`myapp` makes `tokens` into `myapp.tokens`)."""
    temporality: str = "cumulative"
    """cumulative, delta or lowmemory, as OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE
    defines them; every exporter, a user's own included, is read with it."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen dataclass: normalize in place once
        set_(
            self, "exporter", parse_exporters(self.exporter, METRICS_EXPORTERS, "metrics exporter")
        )
        set_(self, "otlp_protocol", parse_protocol(self.otlp_protocol, "metrics otlp_protocol"))
        set_(self, "otlp_headers", parse_header_argument(self.otlp_headers, "metrics otlp_headers"))
        for name in ("export_interval_s", "export_timeout_s", "shutdown_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise TracingConfigError(
                    f"metrics {name} must be a positive number of seconds, got {value!r}"
                )
        set_(self, "temporality", parse_temporality(self.temporality))
        if not isinstance(self.namespace, str):
            raise TracingConfigError(f"metrics namespace must be a string, got {self.namespace!r}")
        if self.otlp_endpoint is not None:
            endpoint = parse_endpoint(
                self.otlp_endpoint, self.otlp_protocol, "metrics otlp_endpoint"
            )
            set_(self, "otlp_endpoint", endpoint)
        if "otlp" in self.exporter and self.otlp_endpoint is None:
            raise TracingConfigError(
                "metrics exporter 'otlp' needs an endpoint: set otlp_endpoint or "
                + otel_env.METRICS_ENDPOINT
            )

    @classmethod
    def from_env(
        cls,
        base: TracingConfig | None = None,
        environ: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> MetricsConfig:
        """Reads the metrics OTEL_* variables; keyword arguments (not None) override them.

        `base`: the traces' config, whose endpoint, protocol and headers the metrics
        share unless a metrics variable says else. With no exporter named, metrics go
        over OTLP when an endpoint is known, else nowhere. OTEL_SDK_DISABLED=true wins
        over everything: nothing is exported."""
        env = os.environ if environ is None else environ
        given = {k: v for k, v in overrides.items() if v is not None}
        unknown = set(given) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TracingConfigError(f"unknown metrics setting(s): {', '.join(sorted(unknown))}")
        values = _env_values(env, base)
        if "otlp_headers" in given:
            explicit = parse_header_argument(given.pop("otlp_headers"), "metrics otlp_headers")
            values["otlp_headers"] = {**values.get("otlp_headers", {}), **explicit}
        if "otlp_endpoint" in given:
            values["otlp_endpoint_is_metrics_url"] = False
        values.update(given)
        if "exporter" not in values:
            values["exporter"] = ("otlp",) if values.get("otlp_endpoint") else ("none",)
        if otel_env.read(env, otel_env.SDK_DISABLED, otel_env.parse_bool, "not disabling"):
            values["exporter"] = ("none",)
        return cls(**values)


def parse_temporality(value: object, setting: str = "metrics temporality") -> str:
    name = str(value).strip().lower()
    check_choice(setting, name, TEMPORALITIES)
    return name


def _env_values(env: Mapping[str, str], base: TracingConfig | None) -> dict[str, Any]:
    """The settings the variables (and `base`) give; malformed variables are left out."""
    read = otel_env.read
    values: dict[str, Any] = {}
    protocol = (
        read_protocol(env, otel_env.METRICS_PROTOCOL)
        or _shared_protocol(env, base)
        or read_protocol(env, otel_env.PROTOCOL)
    )
    if protocol:
        values["otlp_protocol"] = protocol
    protocol_now = str(protocol or MetricsConfig.otlp_protocol)
    endpoint = env_parser(parse_endpoint, protocol_now)
    metrics_url = read(env, otel_env.METRICS_ENDPOINT, endpoint, "sending nowhere")
    base_url = _shared_endpoint(base) or read(env, otel_env.ENDPOINT, endpoint, "sending nowhere")
    if metrics_url or base_url:
        values["otlp_endpoint"] = metrics_url or base_url
        values["otlp_endpoint_is_metrics_url"] = bool(metrics_url)
    exporters = read(
        env,
        otel_env.METRICS_EXPORTER,
        env_parser(parse_exporters, METRICS_EXPORTERS, "metrics exporter"),
        "using the default",
    )
    if exporters is not None:
        values["exporter"] = exporters
        if "otlp" in exporters and "otlp_endpoint" not in values:
            values["otlp_endpoint"] = DEFAULT_ENDPOINTS[protocol_now]
    headers = _headers(env, base)
    if headers:
        values["otlp_headers"] = headers
    temporality = read(
        env,
        otel_env.METRICS_TEMPORALITY,
        env_parser(parse_temporality),
    )
    if temporality:
        values["temporality"] = temporality
    values.update(_env_timing(env))
    return values


def _shared_protocol(env: Mapping[str, str], base: TracingConfig | None) -> str | None:
    """The traces' protocol, unless it is the one OTEL_EXPORTER_OTLP_TRACES_PROTOCOL set."""
    if base is None:
        return None
    traces_only = read_protocol(env, otel_env.TRACES_PROTOCOL)
    return None if traces_only == base.otlp_protocol else base.otlp_protocol


def _shared_endpoint(base: TracingConfig | None) -> str | None:
    """The traces' endpoint, unless it is a traces URL (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)."""
    if base is None or base.otlp_endpoint_is_traces_url:
        return None
    return base.otlp_endpoint


def _headers(env: Mapping[str, str], base: TracingConfig | None) -> dict[str, str]:
    """Generic headers < the traces' (but not the traces-only ones) < the metrics' ones."""
    read_pairs = otel_env.read_pairs
    traces_only = read_pairs(env, otel_env.TRACES_HEADERS, otel_env.parse_headers)
    shared = {}
    if base is not None:
        shared = {k: v for k, v in base.otlp_headers.items() if traces_only.get(k) != v}
    return {
        **read_pairs(env, otel_env.HEADERS, otel_env.parse_headers),
        **shared,
        **read_pairs(env, otel_env.METRICS_HEADERS, otel_env.parse_headers),
    }


def _env_timing(env: Mapping[str, str]) -> dict[str, Any]:
    read = otel_env.read
    values: dict[str, Any] = {}
    interval = read(env, otel_env.METRIC_EXPORT_INTERVAL, otel_env.parse_millis)
    if interval is not None:
        values["export_interval_s"] = interval
    timeout_s = otel_env.read_export_timeout_s(
        env, otel_env.METRICS_TIMEOUT, otel_env.METRIC_EXPORT_TIMEOUT
    )
    if timeout_s is not None:
        values["export_timeout_s"] = timeout_s
    return values


def otlp_metrics_url(cfg: MetricsConfig) -> str:
    """The URL the OTLP exporter sends to: for HTTP a base URL gets /v1/metrics appended;
    OTEL_EXPORTER_OTLP_METRICS_ENDPOINT is used as is."""
    assert cfg.otlp_endpoint is not None  # checked by MetricsConfig
    if cfg.otlp_protocol == "grpc" or cfg.otlp_endpoint_is_metrics_url:
        return cfg.otlp_endpoint
    endpoint = cfg.otlp_endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/metrics") else endpoint + "/v1/metrics"
