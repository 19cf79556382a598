"""Validated settings for `tracing.setup`: explicit argument > OTEL_* variable > default.

An explicit argument with a bad value raises TracingConfigError (one line naming it);
a bad OTEL_* variable is warned about once and treated as unset (`tracing.env`).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from tracing import env as otel_env

EXPORTERS = ("none", "otlp", "console", "file")
PROTOCOLS = ("grpc", "http")
LEVELS = ("off", "step", "phase")
CUDA_TIMINGS = ("off", "sync", "events")
# Where OTLP goes when OTEL_TRACES_EXPORTER=otlp names no endpoint (the specification's).
DEFAULT_ENDPOINTS = {"grpc": "http://localhost:4317", "http": "http://localhost:4318"}
ResourceValue = str | bool | int | float


def default_service_name() -> str:
    """The specification's fallback: `unknown_service:` + the executable's name."""
    executable = os.path.basename(sys.executable) if sys.executable else ""
    return f"unknown_service:{executable}" if executable else "unknown_service"


class TracingConfigError(ValueError):
    """A tracing setting has a bad value; the message names the setting and the value."""


@dataclass(frozen=True)
class TracingConfig:
    """Everything `setup` needs; validated on construction. `from_env` honors OTEL_*."""

    service_name: str | None = None
    """OTel `service.name`; None: resource_attributes' service.name, else unknown_service:<exe>."""
    exporter: tuple[str, ...] = ("none",)
    """Where spans go: any of none, otlp, console, file (a comma-separated string is accepted)."""
    otlp_endpoint: str | None = None
    """Collector URL: http(s)://host[:port][/path] (4317 for gRPC, 4318 for HTTP, where
    /v1/traces is appended); None sends nothing."""
    otlp_endpoint_is_traces_url: bool = False
    """The HTTP endpoint is the full traces URL, used as is (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)."""
    otlp_protocol: str = "grpc"
    """grpc or http (OTLP/HTTP with protobuf bodies; "http/protobuf" is accepted)."""
    otlp_headers: Mapping[str, str] = field(default_factory=dict)
    """Extra request headers, e.g. authentication; names are lower-cased, a `k=v,k2=v2`
    string has percent-encoded values."""
    trace_file: str | None = None
    """OTLP-JSON lines file of the `file` exporter: rank 0 writes PATH, rank N PATH.rankN."""
    level: str = "phase"
    """off (tables only), step (batch and step spans) or phase (every phase span)."""
    sample_ratio: float = 1.0
    """Fraction of traces exported, decided at the root; the tables always see every phase."""
    cuda_timing: str = "off"
    """off (host time), sync (synchronize at both ends) or events (resolved off the hot path)."""
    propagate_context: bool = False
    """Each phase with a span is the current OTel span while it runs, so OTel-instrumented
    code inside it nests under it (costs a context attach and detach per phase)."""
    rank: int = 0
    """Process rank under torchrun: the stats' rank, the trace file's name, a resource key."""
    run_id: str = ""
    """Identifier of the run, one value for all ranks (the application shares it); random
    when empty. A resource attribute `<attribute_namespace>.run.id`."""
    attribute_namespace: str = "tracing"
    """Prefix of the resource keys for rank and run id (`<ns>.rank`, `<ns>.run.id`)."""
    service_instance_id: str = ""
    """OTel `service.instance.id`, unique per process; a random UUID when empty."""
    resource_attributes: Mapping[str, ResourceValue] = field(default_factory=dict)
    """Extra resource attributes (OTEL_RESOURCE_ATTRIBUTES merges in under explicit ones)."""
    export_timeout_s: float = 2.0
    """Bound on one export request, retries included; a dead collector costs at most this."""
    shutdown_timeout_s: float = 4.0
    """Default bound on `Telemetry.shutdown` (flush, exporter close)."""
    max_queue_size: int = 8192
    """Spans buffered for export; beyond it new spans are dropped and counted."""
    max_export_batch_size: int = 512
    """Most spans in one export request."""
    schedule_delay_s: float = 1.0
    """Longest time an ended span waits in the queue before an export is attempted."""
    report_interval_s: float = 30.0
    """Period of the interval table printed by `Reporter`."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen dataclass: normalize in place once
        set_(self, "exporter", parse_exporters(self.exporter))
        set_(self, "otlp_protocol", parse_protocol(self.otlp_protocol))
        set_(self, "otlp_headers", parse_header_argument(self.otlp_headers))
        set_(self, "resource_attributes", _explicit_attributes(self.resource_attributes))
        check_choice("level", self.level, LEVELS)
        check_choice("cuda_timing", self.cuda_timing, CUDA_TIMINGS)
        self._check_numbers()
        if self.service_name is None:
            named = self.resource_attributes.get("service.name")
            set_(self, "service_name", str(named) if named else default_service_name())
        if not isinstance(self.service_name, str) or not self.service_name.strip():
            raise TracingConfigError(
                f"service_name must be a non-empty string, got {self.service_name!r}"
            )
        if self.otlp_endpoint is not None:
            set_(self, "otlp_endpoint", parse_endpoint(self.otlp_endpoint, self.otlp_protocol))
        if "otlp" in self.exporter and self.otlp_endpoint is None:
            raise TracingConfigError(
                "exporter 'otlp' needs an endpoint: set otlp_endpoint or " + otel_env.ENDPOINT
            )
        if "file" in self.exporter and not self.trace_file:
            raise TracingConfigError("exporter 'file' needs trace_file (a path), got None")
        if not self.run_id:
            set_(self, "run_id", uuid.uuid4().hex[:12])
        if not self.service_instance_id:
            # Only a value the user set on purpose (OTEL_RESOURCE_ATTRIBUTES) beats a fresh one.
            named = self.resource_attributes.get("service.instance.id")
            set_(self, "service_instance_id", str(named) if named else str(uuid.uuid4()))

    def _check_numbers(self) -> None:
        if not isinstance(self.sample_ratio, (int, float)) or not 0.0 <= self.sample_ratio <= 1.0:
            raise TracingConfigError(f"sample_ratio must be in [0, 1], got {self.sample_ratio!r}")
        if not isinstance(self.rank, int) or self.rank < 0:
            raise TracingConfigError(f"rank must be an integer >= 0, got {self.rank!r}")
        for name in ("export_timeout_s", "shutdown_timeout_s", "report_interval_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise TracingConfigError(
                    f"{name} must be a positive number of seconds, got {value!r}"
                )
        delay = self.schedule_delay_s
        if not isinstance(delay, (int, float)) or not delay >= 0:
            raise TracingConfigError(
                f"schedule_delay_s must be a non-negative number of seconds, got {delay!r}"
            )
        for name in ("max_queue_size", "max_export_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise TracingConfigError(f"{name} must be an integer >= 1, got {value!r}")

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        default_service_name: str | None = None,
        **overrides: Any,
    ) -> TracingConfig:
        """Reads the standard OTEL_* variables; keyword arguments (not None) override them.

        `default_service_name`: the application's name, used when neither `service_name`
        nor OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES names one. OTEL_SDK_DISABLED=true
        wins over everything: no spans, no export (the tables still print)."""
        env = os.environ if environ is None else environ
        given = {k: v for k, v in overrides.items() if v is not None}
        unknown = set(given) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TracingConfigError(f"unknown tracing setting(s): {', '.join(sorted(unknown))}")
        values = _env_values(env)
        explicit_attributes = _explicit_attributes(given.pop("resource_attributes", {}))
        attributes = {**otel_env.read_resource_attributes(env), **explicit_attributes}
        values["resource_attributes"] = attributes
        values["service_name"] = (
            given.pop("service_name", None)
            or explicit_attributes.get("service.name")
            or env.get(otel_env.SERVICE_NAME, "").strip()
            or attributes.get("service.name")
            or default_service_name
        )
        if "otlp_headers" in given:
            explicit_headers = parse_header_argument(given.pop("otlp_headers"))
            values["otlp_headers"] = {**values.get("otlp_headers", {}), **explicit_headers}
        if "otlp_endpoint" in given:
            values["otlp_endpoint_is_traces_url"] = False
        values.update(given)
        if "exporter" not in values and values.get("otlp_endpoint"):
            values["exporter"] = ("otlp",)
        if otel_env.read(env, otel_env.SDK_DISABLED, otel_env.parse_bool, "not disabling"):
            values["exporter"] = ("none",)
            values["level"] = "off"
        return cls(**values)


def _env_values(env: Mapping[str, str]) -> dict[str, Any]:
    """The settings the OTEL_* variables give; malformed ones are warned and left out."""
    read = otel_env.read
    values: dict[str, Any] = {}
    protocol = read_protocol(env, otel_env.TRACES_PROTOCOL) or read_protocol(env, otel_env.PROTOCOL)
    if protocol:
        values["otlp_protocol"] = protocol
    protocol_now = str(protocol or TracingConfig.otlp_protocol)

    endpoint = env_parser(parse_endpoint, protocol_now)
    traces_url = read(env, otel_env.TRACES_ENDPOINT, endpoint, "sending nowhere")
    base_url = read(env, otel_env.ENDPOINT, endpoint, "sending nowhere")
    if traces_url or base_url:
        values["otlp_endpoint"] = traces_url or base_url
        values["otlp_endpoint_is_traces_url"] = bool(traces_url)
    exporters = read(
        env, otel_env.TRACES_EXPORTER, env_parser(parse_exporters), "using the default"
    )
    if exporters is not None:
        values["exporter"] = exporters
        if "otlp" in exporters and "otlp_endpoint" not in values:
            values["otlp_endpoint"] = DEFAULT_ENDPOINTS[protocol_now]
    headers = {
        **otel_env.read_pairs(env, otel_env.HEADERS, otel_env.parse_headers),
        **otel_env.read_pairs(env, otel_env.TRACES_HEADERS, otel_env.parse_headers),
    }
    if headers:
        values["otlp_headers"] = headers
    ratio = otel_env.sampler_ratio(env)
    if ratio is not None:
        values["sample_ratio"] = ratio
    values.update(_env_batching(env))
    return values


def _env_batching(env: Mapping[str, str]) -> dict[str, Any]:
    read = otel_env.read
    values: dict[str, Any] = {}
    timeout_s = otel_env.read_export_timeout_s(
        env, otel_env.TRACES_TIMEOUT, otel_env.BSP_EXPORT_TIMEOUT
    )
    if timeout_s is not None:
        values["export_timeout_s"] = timeout_s
    delay = read(env, otel_env.BSP_SCHEDULE_DELAY, otel_env.parse_millis_or_zero)
    if delay is not None:
        values["schedule_delay_s"] = delay
    counts = {
        otel_env.BSP_MAX_QUEUE_SIZE: "max_queue_size",
        otel_env.BSP_MAX_EXPORT_BATCH_SIZE: "max_export_batch_size",
    }
    for variable, name in counts.items():
        count = read(env, variable, otel_env.parse_count)
        if count is not None:
            values[name] = count
    return values


def env_parser(parse: Callable[..., Any], *args: Any) -> Callable[[str], Any]:
    """`parse` (which raises TracingConfigError) as a parser for `env.read`: the problem
    becomes an env.ParseError without the value, which the warning names already."""

    def parse_text(text: str) -> Any:
        try:
            return parse(text, *args)
        except TracingConfigError as exc:
            raise otel_env.ParseError(str(exc).split(", got ")[0]) from None

    return parse_text


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    """Raises TracingConfigError naming `name` unless `value` is one of `choices`."""
    if value not in choices:
        raise TracingConfigError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


def parse_exporters(
    value: object, choices: tuple[str, ...] = EXPORTERS, setting: str = "exporter"
) -> tuple[str, ...]:
    """A name or comma-separated list (or a sequence) of exporters; `("none",)` if empty."""
    if isinstance(value, str):
        names = tuple(part.strip().lower() for part in value.split(",") if part.strip())
    elif isinstance(value, (list, tuple)):
        names = tuple(str(part).strip().lower() for part in value)
    else:
        raise TracingConfigError(f"{setting} must be a name or a list of names, got {value!r}")
    for name in names:
        check_choice(setting, name, choices)
    names = tuple(dict.fromkeys(name for name in names if name != "none"))
    return names or ("none",)


def parse_protocol(value: object, setting: str = "otlp_protocol") -> str:
    """grpc or http; OTEL_EXPORTER_OTLP_*PROTOCOL spells HTTP "http/protobuf" (http/json:
    unsupported)."""
    normalized = {"http/protobuf": "http"}.get(str(value).strip().lower(), value)
    check_choice(setting, normalized, PROTOCOLS)
    return str(normalized)


def read_protocol(env: Mapping[str, str], variable: str) -> str | None:
    """An OTEL_*_PROTOCOL variable. `http/json` is what a user sets for a collector's HTTP
    port; the Python OTLP exporters encode protobuf only, which every OTLP/HTTP receiver
    also takes on that port: it is sent as http/protobuf, warned once (not as gRPC)."""
    text = env.get(variable, "")
    if text.strip().lower() == "http/json":
        otel_env.warn_once(
            variable,
            text,
            "the Python OTLP exporters encode protobuf only",
            "sending http/protobuf to the same endpoint",
        )
        return "http"
    value = otel_env.read(env, variable, env_parser(parse_protocol))
    return None if value is None else str(value)


def parse_header_argument(value: object, setting: str = "otlp_headers") -> dict[str, str]:
    """Explicit headers: a mapping or a `k=v,k2=v2` string; names lower-cased."""
    if isinstance(value, Mapping):
        return {str(k).strip().lower(): str(v) for k, v in value.items()}
    if not isinstance(value, str):
        raise TracingConfigError(f"{setting} must be a mapping or 'k=v,k2=v2', got {value!r}")
    headers, problems = otel_env.parse_headers(value)
    if problems:
        raise TracingConfigError(f"{setting}: {problems[0]}")
    return headers


def _explicit_attributes(value: object) -> dict[str, ResourceValue]:
    if isinstance(value, Mapping):
        result: dict[str, ResourceValue] = {}
        for key, item in value.items():
            result[str(key)] = item if isinstance(item, (str, bool, int, float)) else str(item)
        return result
    if not isinstance(value, str):
        raise TracingConfigError(
            f"resource_attributes must be a mapping or 'k=v,k2=v2', got {value!r}"
        )
    pairs, problems = otel_env.parse_pairs(value, what="resource attribute", decode_keys=True)
    if problems:
        raise TracingConfigError(problems[0])
    return dict(pairs)


def parse_endpoint(value: object, protocol: str, setting: str = "otlp_endpoint") -> str:
    """An OTLP endpoint URL with a scheme `protocol` can use and a host; else an error."""
    text = str(value).strip()
    try:
        parsed = urlparse(text)
        parsed.port  # noqa: B018 - raises on a malformed port
    except ValueError:
        raise TracingConfigError(f"{setting} is not a valid URL, got {value!r}") from None
    if parsed.scheme not in ("http", "https") or not parsed.hostname or "://" not in text:
        raise TracingConfigError(
            f"{setting} for OTLP/{protocol} must be http(s)://host[:port][/path], got {value!r}"
        )
    return text
