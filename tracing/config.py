"""Validated settings for `tracing.setup`: explicit argument > OTEL_* variable > default."""

from __future__ import annotations

import dataclasses
import os
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlparse

EXPORTERS = ("none", "otlp", "console", "file")
PROTOCOLS = ("grpc", "http")
LEVELS = ("off", "step", "phase")
CUDA_TIMINGS = ("off", "sync", "events")
DEFAULT_SERVICE_NAME = "dflash-train"

# Standard variable names, kept as constants like the SDK does.
ENV_SERVICE_NAME = "OTEL_SERVICE_NAME"
ENV_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
ENV_PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"
ENV_HEADERS = "OTEL_EXPORTER_OTLP_HEADERS"
ENV_RESOURCE_ATTRIBUTES = "OTEL_RESOURCE_ATTRIBUTES"
ENV_SAMPLER = "OTEL_TRACES_SAMPLER"
ENV_SAMPLER_ARG = "OTEL_TRACES_SAMPLER_ARG"
ENV_SDK_DISABLED = "OTEL_SDK_DISABLED"
ENV_TRACES_EXPORTER = "OTEL_TRACES_EXPORTER"


class TracingConfigError(ValueError):
    """A tracing setting has a bad value; the message names the setting and the value."""


@dataclass(frozen=True)
class TracingConfig:
    """Everything `setup` needs; validated on construction. `from_env` honors OTEL_*."""

    service_name: str = DEFAULT_SERVICE_NAME
    """OTel `service.name` of the resource."""
    exporter: tuple[str, ...] = ("none",)
    """Where spans go: any of none, otlp, console, file (a comma-separated string is accepted)."""
    otlp_endpoint: str | None = None
    """Collector URL (http://host:4317 for gRPC, http://host:4318 for HTTP); None sends nothing."""
    otlp_protocol: str = "grpc"
    """grpc or http (OTLP/HTTP with protobuf bodies)."""
    otlp_headers: Mapping[str, str] = field(default_factory=dict)
    """Extra request headers, e.g. authentication for a hosted backend."""
    trace_file: str | None = None
    """Path of the OTLP-JSON lines file written by the `file` exporter."""
    level: str = "phase"
    """off (tables only), step (batch and step spans) or phase (every phase span)."""
    sample_ratio: float = 1.0
    """Fraction of traces exported, decided at the root; the tables always see every phase."""
    cuda_timing: str = "off"
    """off (host time), sync (synchronize at both ends) or events (resolved off the hot path)."""
    rank: int = 0
    """Process rank under torchrun; goes into the resource and service.instance.id."""
    run_id: str = ""
    """Identifier shared by all ranks of one run; a random one when empty."""
    resource_attributes: Mapping[str, str] = field(default_factory=dict)
    """Extra resource attributes (OTEL_RESOURCE_ATTRIBUTES merges in under explicit ones)."""
    export_timeout_s: float = 2.0
    """Bound on one export request, retries included; a dead collector costs at most this."""
    shutdown_timeout_s: float = 4.0
    """Default bound on `Telemetry.shutdown` (flush, exporter close)."""
    max_queue_size: int = 8192
    """Spans buffered for export; beyond it new spans are dropped and counted."""
    schedule_delay_s: float = 1.0
    """Longest time an ended span waits in the queue before an export is attempted."""
    report_interval_s: float = 30.0
    """Period of the interval table printed by `Reporter`."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen dataclass: normalize in place once
        set_(self, "exporter", _parse_exporters(self.exporter))
        set_(self, "otlp_protocol", _parse_protocol(self.otlp_protocol))
        set_(self, "otlp_headers", _parse_mapping("otlp_headers", self.otlp_headers))
        set_(
            self,
            "resource_attributes",
            _parse_mapping("resource_attributes", self.resource_attributes),
        )
        _check_choice("level", self.level, LEVELS)
        _check_choice("cuda_timing", self.cuda_timing, CUDA_TIMINGS)
        if not isinstance(self.service_name, str) or not self.service_name.strip():
            raise TracingConfigError(
                f"service_name must be a non-empty string, got {self.service_name!r}"
            )
        if not 0.0 <= float(self.sample_ratio) <= 1.0:
            raise TracingConfigError(f"sample_ratio must be in [0, 1], got {self.sample_ratio!r}")
        if not isinstance(self.rank, int) or self.rank < 0:
            raise TracingConfigError(f"rank must be an integer >= 0, got {self.rank!r}")
        for name in (
            "export_timeout_s",
            "shutdown_timeout_s",
            "schedule_delay_s",
            "report_interval_s",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise TracingConfigError(
                    f"{name} must be a positive number of seconds, got {value!r}"
                )
        if not isinstance(self.max_queue_size, int) or self.max_queue_size < 1:
            raise TracingConfigError(
                f"max_queue_size must be an integer >= 1, got {self.max_queue_size!r}"
            )
        if self.otlp_endpoint is not None:
            set_(self, "otlp_endpoint", _parse_endpoint(self.otlp_endpoint))
        if "otlp" in self.exporter and self.otlp_endpoint is None:
            raise TracingConfigError(
                "exporter 'otlp' needs an endpoint: set otlp_endpoint or " + ENV_ENDPOINT
            )
        if "file" in self.exporter and not self.trace_file:
            raise TracingConfigError("exporter 'file' needs trace_file (a path), got None")
        if not self.run_id:
            set_(self, "run_id", uuid.uuid4().hex[:12])

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, **overrides: object
    ) -> TracingConfig:
        """Reads the standard OTEL_* variables; keyword arguments (not None) override them."""
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        if env.get(ENV_SERVICE_NAME):
            values["service_name"] = env[ENV_SERVICE_NAME]
        if env.get(ENV_ENDPOINT):
            values["otlp_endpoint"] = env[ENV_ENDPOINT]
            values["exporter"] = ("otlp",)
        if env.get(ENV_TRACES_EXPORTER):
            values["exporter"] = env[ENV_TRACES_EXPORTER]
        if env.get(ENV_PROTOCOL):
            values["otlp_protocol"] = env[ENV_PROTOCOL]
        if env.get(ENV_HEADERS):
            values["otlp_headers"] = env[ENV_HEADERS]
        if env.get(ENV_SAMPLER):
            values["sample_ratio"] = _sampler_ratio(env[ENV_SAMPLER], env.get(ENV_SAMPLER_ARG))
        attributes = _parse_mapping(ENV_RESOURCE_ATTRIBUTES, env.get(ENV_RESOURCE_ATTRIBUTES, ""))
        explicit_attributes = overrides.pop("resource_attributes", None) or {}
        values["resource_attributes"] = {
            **attributes,
            **_parse_mapping("resource_attributes", explicit_attributes),
        }
        if env.get(ENV_SDK_DISABLED, "").strip().lower() == "true":
            values["exporter"] = ("none",)
            values["level"] = "off"
        values.update({k: v for k, v in overrides.items() if v is not None})
        unknown = set(values) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TracingConfigError(f"unknown tracing setting(s): {', '.join(sorted(unknown))}")
        return cls(**values)  # type: ignore[arg-type]

    @property
    def service_instance_id(self) -> str:
        return f"{socket.gethostname()}-rank{self.rank}"


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise TracingConfigError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


def _parse_exporters(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        names = tuple(part.strip().lower() for part in value.split(",") if part.strip())
    elif isinstance(value, (list, tuple)):
        names = tuple(str(part).strip().lower() for part in value)
    else:
        raise TracingConfigError(f"exporter must be a name or a list of names, got {value!r}")
    for name in names:
        _check_choice("exporter", name, EXPORTERS)
    names = tuple(dict.fromkeys(name for name in names if name != "none"))
    return names or ("none",)


def _parse_protocol(value: object) -> str:
    # OTEL_EXPORTER_OTLP_PROTOCOL spells HTTP as "http/protobuf".
    normalized = {"http/protobuf": "http"}.get(str(value).strip().lower(), value)
    _check_choice("otlp_protocol", normalized, PROTOCOLS)
    return str(normalized)


def _parse_mapping(name: str, value: object) -> dict[str, str]:
    """Accepts a mapping or the OTEL `key=value,key2=value2` form."""
    if isinstance(value, Mapping):
        return {str(k): str(v) for k, v in value.items()}
    if not isinstance(value, str):
        raise TracingConfigError(f"{name} must be a mapping or 'k=v,k2=v2', got {value!r}")
    result: dict[str, str] = {}
    for item in value.split(","):
        if not item.strip():
            continue
        key, sep, val = item.partition("=")
        if not sep or not key.strip():
            raise TracingConfigError(f"{name} entry must look like key=value, got {item.strip()!r}")
        result[key.strip()] = val.strip()
    return result


def _parse_endpoint(value: object) -> str:
    text = str(value).strip()
    url = text if "://" in text else f"http://{text}"
    try:
        parsed = urlparse(url)
        port = parsed.port
    except ValueError:
        raise TracingConfigError(f"otlp_endpoint is not a valid URL, got {value!r}") from None
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise TracingConfigError(
            f"otlp_endpoint must be http(s)://host[:port][/path], got {value!r}"
        )
    del port  # parsed only to reject a malformed port
    return url


def _sampler_ratio(sampler: str, arg: str | None) -> float:
    name = sampler.strip().lower()
    if name in ("always_on", "parentbased_always_on"):
        return 1.0
    if name in ("always_off", "parentbased_always_off"):
        return 0.0
    if name in ("traceidratio", "parentbased_traceidratio"):
        try:
            return float(arg) if arg is not None else 1.0
        except ValueError:
            raise TracingConfigError(f"{ENV_SAMPLER_ARG} must be a number, got {arg!r}") from None
    raise TracingConfigError(f"{ENV_SAMPLER} must name a supported sampler, got {sampler!r}")
