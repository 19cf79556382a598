"""The application's own settings for `tracing.setup` and `tracing.metrics`, validated once.

Everything OpenTelemetry configures is left to the SDK, which reads the OTEL_*
variables itself when a setting here is None: the OTLP endpoint, headers, timeout,
compression and TLS (the exporters), the sampler (the tracer provider), the resource
(`Resource.create` and its detectors). A bad value here raises TracingConfigError (one
line naming it); a bad OTEL_* variable is the SDK's to warn about.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import ParamSpec, TypeVar
from urllib.parse import urlparse

EXPORTERS = ("none", "otlp", "console", "file")
PROTOCOLS = ("grpc", "http/protobuf")
LEVELS = ("off", "step", "phase")
CUDA_TIMINGS = ("off", "sync", "events")
TEMPORALITIES = ("cumulative", "delta", "lowmemory")
PHASE_HISTOGRAMS = ("explicit", "exponential")


class TracingConfigError(ValueError):
    """A tracing setting has a bad value; the message names the setting and the value."""


@dataclass(frozen=True)
class TracingConfig:
    """What `setup` needs beyond what the SDK reads; None leaves a choice to the SDK."""

    exporter: tuple[str, ...] | None = None
    """otlp, console (a comma-separated string too); None: OTLP when `otlp_endpoint`, an
    OTLP endpoint variable or OTEL_TRACES_EXPORTER asks for it, else none."""
    otlp_endpoint: str | None = None
    """Collector base URL, http(s)://host[:port]; None: the SDK's exporter reads OTEL_*."""
    otlp_protocol: str | None = None
    """grpc or http/protobuf ("http" is accepted); None: OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL,
    else http/protobuf, the specification's default."""
    protocol_setting: str = "OTEL_EXPORTER_OTLP_PROTOCOL"
    """How the program's user chooses the protocol (a flag such as "--otlp-protocol", or a
    variable), named in the line that tells an export sent in the other protocol."""
    trace_file: str | None = None
    """Also write spans to this OTLP-JSON lines file: rank 0 writes PATH, rank N PATH.rankN."""
    level: str = "phase"
    """off (tables only), step (batch and step spans) or phase (every phase span)."""
    sample_ratio: float | None = None
    """Share of traces exported, decided at the root; None: the SDK's sampler
    (OTEL_TRACES_SAMPLER[_ARG]). The tables always see every phase."""
    cuda_timing: str = "off"
    """off (host time), sync (synchronize at both ends) or events (resolved off the hot path)."""
    propagate_context: bool = False
    """Each phase with a span is the current OTel span while it runs, so OTel-instrumented
    code inside it nests under it (costs a context attach and detach per phase)."""
    service_name: str | None = None
    """`service.name` that wins over OTEL_SERVICE_NAME (a command-line flag)."""
    default_service_name: str | None = None
    """The application's name, used when neither `service_name` nor the OTEL_* variables
    name the service (then the SDK's `unknown_service:<executable>`)."""
    service_version: str | None = None
    """`service.version` unless OTEL_RESOURCE_ATTRIBUTES names one."""
    rank: int = 0
    """Process rank under torchrun: the stats' rank, the trace file's name, a resource key."""
    run_id: str = ""
    """One value for all ranks of a run (the application shares it); random when empty."""
    attribute_namespace: str = "tracing"
    """Prefix of the resource keys for rank and run id (`<ns>.rank`, `<ns>.run.id`) and
    for those below."""
    world_size: int | None = None
    """Processes in the run (torchrun's WORLD_SIZE): `<ns>.world_size`; None: not set."""
    local_rank: int | None = None
    """The rank on its node (LOCAL_RANK): `<ns>.local_rank`; None: not set."""
    node_rank: int | None = None
    """The node's rank among the run's nodes (torchrun's GROUP_RANK, or NODE_RANK):
    `<ns>.node.rank`; the node's name is `host.name`. None: not set."""
    device_model: str | None = None
    """The device the rank computes on, in words (`NVIDIA H100 80GB HBM3`, a CPU's model
    name): `<ns>.device.model`. The caller's: tracing never asks torch at import."""
    config_hash: str | None = None
    """A digest of the program's configuration (two runs with one hash ran one config):
    `<ns>.config.hash`."""
    shutdown_timeout_s: float = 4.0
    """Default bound on `Telemetry.shutdown` (flush, exporter close)."""
    report_interval_s: float = 30.0
    """Period of the interval table printed by `Reporter`."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen dataclass: normalize in place once
        if self.exporter is not None:
            set_(self, "exporter", parse_exporters(self.exporter))
        if self.otlp_protocol is not None:
            set_(self, "otlp_protocol", parse_protocol(self.otlp_protocol))
        if self.otlp_endpoint is not None:
            set_(self, "otlp_endpoint", parse_endpoint(self.otlp_endpoint))
        check_choice("level", self.level, LEVELS)
        check_choice("cuda_timing", self.cuda_timing, CUDA_TIMINGS)
        ratio = self.sample_ratio
        if ratio is not None and (not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1):
            raise TracingConfigError(f"sample_ratio must be in [0, 1], got {ratio!r}")
        for name, least in (("rank", 0), ("world_size", 1), ("local_rank", 0), ("node_rank", 0)):
            value = getattr(self, name)
            if (value is not None or name == "rank") and (
                not isinstance(value, int) or isinstance(value, bool) or value < least
            ):
                raise TracingConfigError(f"{name} must be an integer >= {least}, got {value!r}")
        check_positive("shutdown_timeout_s", self.shutdown_timeout_s)
        check_positive("report_interval_s", self.report_interval_s)
        if "file" in (self.exporter or ()) and not self.trace_file:
            raise TracingConfigError("exporter 'file' needs trace_file (a path), got None")
        if not self.run_id:
            set_(self, "run_id", uuid.uuid4().hex[:12])


@dataclass(frozen=True)
class MetricsConfig:
    """Settings of the metrics signal; None leaves a choice to the OTEL_* variables."""

    exporter: tuple[str, ...] | None = None
    """Any of otlp, console; None: OTEL_METRICS_EXPORTER, else OTLP where an endpoint is
    known (the traces' `otlp_endpoint` or an OTLP endpoint variable), else none."""
    export_interval_s: float | None = None
    """Period of collection and export; None: the SDK's (OTEL_METRIC_EXPORT_INTERVAL)."""
    shutdown_timeout_s: float = 3.0
    namespace: str = ""
    """Prefix of every instrument name (`myapp` makes `tokens` into `myapp.tokens`)."""
    temporality: str | None = None
    """cumulative, delta or lowmemory; None: OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE,
    read here: the reader takes it from the stats wrapper in front of each exporter."""
    phase_histogram: str | None = None
    """How the ProfileStats histograms are exported: `explicit`, octave bounds (what any
    Prometheus path takes, the Collector's `prometheus` exporter included: it drops
    exponential histograms), or `exponential`, an OTLP exponential histogram of scale 3
    whose buckets are the stats' own, 8 per octave (Prometheus' OTLP receiver stores it
    as a native histogram: quantiles within one bucket, 2**(1/8) - 1, about 9 %, where
    octave bounds are up to 2x off). None: OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_
    AGGREGATION (`base2_exponential_bucket_histogram` is exponential), else explicit."""

    def __post_init__(self) -> None:
        if self.exporter is not None:
            exporters = parse_exporters(self.exporter, ("none", "otlp", "console"))
            object.__setattr__(self, "exporter", exporters)  # frozen: normalized once
        if self.phase_histogram is not None:
            check_choice("metrics phase_histogram", self.phase_histogram, PHASE_HISTOGRAMS)
        if self.temporality is not None:
            check_choice("metrics temporality", self.temporality, TEMPORALITIES)
        for name in ("export_interval_s", "shutdown_timeout_s"):
            if getattr(self, name) is not None:
                check_positive(f"metrics {name}", getattr(self, name))
        if not isinstance(self.namespace, str):
            raise TracingConfigError(f"metrics namespace must be a string, got {self.namespace!r}")


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    """Raises TracingConfigError naming `name` unless `value` is one of `choices`."""
    if value not in choices:
        raise TracingConfigError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


def check_positive(name: str, value: object) -> None:
    """Raises TracingConfigError naming `name` unless `value` is a number above 0."""
    if not isinstance(value, (int, float)) or not value > 0:
        raise TracingConfigError(f"{name} must be a positive number, got {value!r}")


def parse_exporters(value: object, choices: tuple[str, ...] = EXPORTERS) -> tuple[str, ...]:
    """A name or comma-separated list (or a sequence) of exporters; `()` for none."""
    if isinstance(value, str):
        names = [part.strip().lower() for part in value.split(",") if part.strip()]
    elif isinstance(value, (list, tuple)):
        names = [str(part).strip().lower() for part in value]
    else:
        raise TracingConfigError(f"exporter must be a name or a list of names, got {value!r}")
    for name in names:
        check_choice("exporter", name, choices)
    return tuple(dict.fromkeys(name for name in names if name != "none"))


def parse_protocol(value: object) -> str:
    """grpc or http/protobuf (the Python OTLP exporters encode protobuf only)."""
    normalized = {"http": "http/protobuf"}.get(str(value).strip().lower(), value)
    check_choice("otlp_protocol", normalized, PROTOCOLS)
    return str(normalized)


def parse_endpoint(value: object) -> str:
    """An OTLP endpoint URL, http(s)://host[:port][/path]; else TracingConfigError."""
    text = str(value).strip()
    try:
        parsed = urlparse(text)
        parsed.port  # noqa: B018 - raises on a malformed port
    except ValueError:
        raise TracingConfigError(f"otlp_endpoint is not a valid URL, got {value!r}") from None
    if parsed.scheme not in ("http", "https") or not parsed.hostname or "://" not in text:
        raise TracingConfigError(f"otlp_endpoint wants http(s)://host[:port][/path], got {value!r}")
    return text


logger = logging.getLogger("tracing")
_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Logs `message` the first time `key` comes up: telemetry reports misuse and values
    it cannot use, and never raises into the host program."""
    if key not in _warned:
        _warned.add(key)
        logger.warning("tracing: %s", message)


_P = ParamSpec("_P")
_R = TypeVar("_R")


def call_logged(fn: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> _R | None:
    """`fn(*args, **kwargs)`, or None when it raised (logged): telemetry never raises."""
    try:
        return fn(*args, **kwargs)
    except Exception:
        logger.exception("tracing: %s raised", getattr(fn, "__qualname__", repr(fn)))
        return None
