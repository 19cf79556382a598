"""The standard OTEL_* variables, parsed as the specification and the SDK parse them.

A malformed variable never stops the program: it is reported once (naming the
variable and its value) and treated as unset, as the SDK does. The same mistake in
an explicit argument is the caller's and raises (see `tracing.config`).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Mapping
from urllib.parse import unquote

logger = logging.getLogger("tracing")

SERVICE_NAME = "OTEL_SERVICE_NAME"
RESOURCE_ATTRIBUTES = "OTEL_RESOURCE_ATTRIBUTES"
SDK_DISABLED = "OTEL_SDK_DISABLED"
TRACES_EXPORTER = "OTEL_TRACES_EXPORTER"
SAMPLER = "OTEL_TRACES_SAMPLER"
SAMPLER_ARG = "OTEL_TRACES_SAMPLER_ARG"
ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"
TRACES_PROTOCOL = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
HEADERS = "OTEL_EXPORTER_OTLP_HEADERS"
TRACES_HEADERS = "OTEL_EXPORTER_OTLP_TRACES_HEADERS"
TIMEOUT = "OTEL_EXPORTER_OTLP_TIMEOUT"
TRACES_TIMEOUT = "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"
BSP_SCHEDULE_DELAY = "OTEL_BSP_SCHEDULE_DELAY"
BSP_EXPORT_TIMEOUT = "OTEL_BSP_EXPORT_TIMEOUT"
BSP_MAX_QUEUE_SIZE = "OTEL_BSP_MAX_QUEUE_SIZE"
BSP_MAX_EXPORT_BATCH_SIZE = "OTEL_BSP_MAX_EXPORT_BATCH_SIZE"
METRICS_EXPORTER = "OTEL_METRICS_EXPORTER"
METRIC_EXPORT_INTERVAL = "OTEL_METRIC_EXPORT_INTERVAL"
METRIC_EXPORT_TIMEOUT = "OTEL_METRIC_EXPORT_TIMEOUT"
METRICS_ENDPOINT = "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"
METRICS_PROTOCOL = "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"
METRICS_TEMPORALITY = "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE"
METRICS_HEADERS = "OTEL_EXPORTER_OTLP_METRICS_HEADERS"
METRICS_TIMEOUT = "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT"

# RFC 9110 token characters: what a header name (and a resource key) may hold.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


class ParseError(ValueError):
    """One malformed value; the message says what is wrong (without the variable)."""


def warn_once(variable: str, value: str, problem: str, fallback: str) -> None:
    """Logs one warning per (variable, value) for the life of the process."""
    with _warned_lock:
        if (variable, value) in _warned:
            return
        _warned.add((variable, value))
    logger.warning("tracing: ignoring %s=%r (%s); %s", variable, value, problem, fallback)


def parse_pairs(text: str, *, what: str, decode_keys: bool) -> tuple[dict[str, str], list[str]]:
    """`k=v,k2=v2` with percent-encoded values (and keys when `decode_keys`).

    Liberal like the SDK: spaces around names and values are trimmed, a value may hold
    unencoded spaces and `=`. Returns the pairs and a description of each bad entry."""
    pairs: dict[str, str] = {}
    problems: list[str] = []
    for item in text.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not _TOKEN.fullmatch(key):
            problems.append(f"{what} entry must look like name=value, got {item.strip()!r}")
            continue
        pairs[unquote(key) if decode_keys else key] = unquote(value.strip())
    return pairs, problems


def parse_headers(text: str) -> tuple[dict[str, str], list[str]]:
    """Header names are case-insensitive; gRPC metadata only allows lower case."""
    pairs, problems = parse_pairs(text, what="header", decode_keys=False)
    return {name.lower(): value for name, value in pairs.items()}, problems


def parse_bool(text: str) -> bool:
    """The specification's boolean: only a case-insensitive "true" is true."""
    value = text.strip().lower()
    if value not in ("true", "false", ""):
        raise ParseError("expected true or false")
    return value == "true"


def parse_millis(text: str) -> float:
    """A positive integer number of milliseconds, returned in seconds."""
    millis = parse_millis_or_zero(text)
    if millis == 0:
        raise ParseError("expected a positive number of milliseconds")
    return millis


def parse_millis_or_zero(text: str) -> float:
    """A non-negative integer number of milliseconds, returned in seconds."""
    try:
        millis = int(text.strip())
    except ValueError:
        raise ParseError("expected an integer number of milliseconds") from None
    if millis < 0:
        raise ParseError("expected a non-negative number of milliseconds")
    return millis / 1e3


def parse_count(text: str) -> int:
    try:
        count = int(text.strip())
    except ValueError:
        raise ParseError("expected an integer") from None
    if count < 1:
        raise ParseError("expected an integer >= 1")
    return count


SAMPLERS = {
    "always_on": 1.0,
    "always_off": 0.0,
    "parentbased_always_on": 1.0,
    "parentbased_always_off": 0.0,
}
RATIO_SAMPLERS = ("traceidratio", "parentbased_traceidratio")


def sampler_ratio(env: Mapping[str, str]) -> float | None:
    """The root sampling ratio named by OTEL_TRACES_SAMPLER[_ARG]; None when unset.

    Spans always follow their parent's decision (the SDK's ParentBased default); a
    plain `traceidratio` is honoured as its parent-based form."""
    name = env.get(SAMPLER, "").strip().lower()
    if not name:
        return None
    if name in SAMPLERS:
        return SAMPLERS[name]
    if name not in RATIO_SAMPLERS:
        warn_once(SAMPLER, env[SAMPLER], "not a supported sampler", "using parentbased_always_on")
        return None
    arg = env.get(SAMPLER_ARG)
    if arg is None or not arg.strip():
        return 1.0
    try:
        ratio = float(arg)
    except ValueError:
        ratio = -1.0
    if not 0.0 <= ratio <= 1.0:
        warn_once(SAMPLER_ARG, arg, "expected a number in [0, 1]", "using ratio 1.0")
        return 1.0
    return ratio


def read(
    env: Mapping[str, str],
    variable: str,
    parse: Callable[[str], object],
    fallback: str = "using the default",
) -> object | None:
    """The parsed value of `variable`, or None when unset, empty or malformed (warned)."""
    text = env.get(variable)
    if text is None or not text.strip():
        return None
    try:
        return parse(text)
    except ParseError as exc:
        warn_once(variable, text, str(exc), fallback)
        return None


def read_pairs(
    env: Mapping[str, str], variable: str, parse: Callable[[str], tuple[dict, list]]
) -> dict[str, str]:
    """Pairs from `variable`; bad entries are warned about and left out."""
    text = env.get(variable, "")
    pairs, problems = parse(text)
    for problem in problems:
        warn_once(variable, text, problem, "skipping that entry")
    return pairs


def read_resource_attributes(env: Mapping[str, str]) -> dict[str, str]:
    """OTEL_RESOURCE_ATTRIBUTES; the specification discards the whole value on any error."""
    text = env.get(RESOURCE_ATTRIBUTES, "")
    pairs, problems = parse_pairs(text, what="resource attribute", decode_keys=True)
    if problems:
        warn_once(RESOURCE_ATTRIBUTES, text, problems[0], "using no attributes from it")
        return {}
    return pairs


def read_export_timeout_s(
    env: Mapping[str, str], signal_timeout: str, own_timeout: str
) -> float | None:
    """Seconds an export may take: the signal's OTLP timeout (else OTEL_EXPORTER_OTLP_TIMEOUT)
    and the processor's or reader's `own_timeout`, the smaller one when both are set (an
    export must end within both bounds); None when neither is."""
    timeouts = [
        read(env, signal_timeout, parse_millis) or read(env, TIMEOUT, parse_millis),
        read(env, own_timeout, parse_millis),
    ]
    given = [t for t in timeouts if isinstance(t, float)]  # parse_millis gives floats
    return min(given) if given else None
