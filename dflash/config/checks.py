"""Value checks of config fields: `setting(..., check=f)` calls f(value).

Each returns None for a good value, else the reason it is bad; the section names the
flag in the ConfigError. Range and type checks need none: `setting` declares them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

from tracing.config import TracingConfigError, parse_endpoint

__all__ = [
    "byte_size",
    "device_list",
    "endpoint",
    "existing_file",
    "existing_folder",
    "http_url",
    "json_object",
    "layer_ids",
    "layer_order",
    "noise_ratios",
    "noise_spec",
    "not_blank",
    "one_device",
    "parse_size",
    "parse_steps",
    "report_tools",
    "split_device_name",
    "step_range",
    "token_ids",
]


def not_blank(value: str) -> str | None:
    """A name or path that is not empty and is text: a path with bytes that are not UTF-8
    would train, then fail writing the summary and report that quote it."""
    if not value.strip():
        return "must not be empty"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"must be UTF-8 text (position {exc.start} holds a byte that is not)"
    return None


REPORT_TOOLS = ("tensorboard", "mlflow", "wandb")
"""What --report-to may name (dflash.observe.trackers: one class each)."""


def report_tools(names: tuple[str, ...]) -> str | None:
    """--report-to: known tools, or `none` alone."""
    if names == ("none",):
        return None
    if "none" in names:  # `none` would otherwise read as an unknown tool
        return "none turns reporting off: give it alone"
    for name in names:
        if name not in REPORT_TOOLS:
            known = ", ".join(REPORT_TOOLS)
            return f"unknown tool {name!r}: expected {known} (comma-separated or repeated) or none"
    return None


def noise_ratios(spec: str) -> tuple[float, float]:
    """(first, last) masked share of a --noise-schedule: `all` is (1, 1), `linear:START:END`
    is (START, END), each in (0, 1]. ValueError saying what is wrong otherwise."""
    if spec == "all":
        return 1.0, 1.0
    parts = spec.split(":")
    if len(parts) != 3 or parts[0] != "linear":
        raise ValueError("expected 'all' or 'linear:START:END'")
    try:
        start, end = float(parts[1]), float(parts[2])
    except ValueError:
        raise ValueError("START and END are numbers") from None
    for value in (start, end):
        if not 0.0 < value <= 1.0:
            raise ValueError(f"{value} is outside (0, 1]")
    return start, end


def noise_spec(value: str) -> str | None:
    try:
        noise_ratios(value)
    except ValueError as err:
        return str(err)
    return None


def endpoint(value: str) -> str | None:
    try:
        parse_endpoint(value)
    except TracingConfigError:
        return "expected a URL http(s)://host[:port][/path], e.g. http://localhost:4318"
    return None


def parse_steps(text: str) -> tuple[int, int]:
    """`200:205` -> (200, 205); `200` -> (200, 201). Bad input: ValueError, one line."""
    start_text, sep, stop_text = str(text).strip().partition(":")
    try:
        start = int(start_text)
        stop = int(stop_text) if sep else start + 1
    except ValueError:
        raise ValueError(
            f"profile steps must look like START:STOP (e.g. 200:205), got {text!r}"
        ) from None
    if start < 0 or stop <= start:
        raise ValueError(
            f"profile steps need 0 <= START < STOP (an empty range records nothing), got {text!r}"
        )
    return start, stop


def step_range(value: str) -> str | None:
    try:
        parse_steps(value)
    except ValueError as exc:
        return str(exc).split(", got ")[0]
    return None


_DEVICE_NAME = re.compile(r"^(cpu|cuda|mps)(?::(\d+))?$")


def split_device_name(name: str) -> tuple[str, int | None] | None:
    """`cuda:1` -> ('cuda', 1), `cpu` -> ('cpu', None); None when it is no device name."""
    match = _DEVICE_NAME.match(name.strip().lower())
    if match is None:
        return None
    index = match.group(2)
    return match.group(1), None if index is None else int(index)


def device_list(names: tuple[str, ...]) -> str | None:
    if names == ("auto",):
        return None
    if not names:
        return "name at least one device"
    for name in names:
        if split_device_name(name) is None:
            return f"{name!r} is not a device: expected auto, cpu, mps, cuda or cuda:N"
    return None


def one_device(name: str) -> str | None:
    """The device of a command that runs its models on one (`eval`, `regenerate`)."""
    if name == "auto" or split_device_name(name) is not None:
        return None
    return "expected auto, cpu, mps, cuda or cuda:N"


def existing_folder(path: str | None) -> str | None:
    """An input folder (a drafter): checked when the options are read, before any work."""
    if path is None or Path(path).is_dir():
        return None
    return "it is a file, not a folder" if Path(path).exists() else "no such folder"


def existing_file(path: str | None) -> str | None:
    """An input file (prompts): checked when the options are read, before any work."""
    if path is None or Path(path).is_file():
        return None
    return "it is a folder, not a file" if Path(path).exists() else "no such file"


def http_url(url: str | None) -> str | None:
    if url is None or url.startswith(("http://", "https://")):
        return None
    return "expected an http:// or https:// URL"


def token_ids(ids: tuple[int, ...]) -> str | None:
    return "ids must be >= 0" if any(i < 0 for i in ids) else None


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """`2GiB`, `500MB`, `1048576` -> bytes; a ValueError for anything else."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a size such as 2GiB, 500MB or 1048576")
    number, unit = float(match.group(1)), (match.group(2) or "b").lower()
    return int(number * _UNITS[unit])


def byte_size(text: str) -> str | None:
    """A size such as 2GiB, 500MB or 1048576 (bytes), above zero."""
    try:
        size = parse_size(text)
    except ValueError as err:
        return str(err)
    return None if size > 0 else f"{text!r} is not above zero"


def json_object(text: str | None) -> str | None:
    """A JSON object given as text (`--chat-template-kwargs '{"enable_thinking": false}'`)."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"must be a JSON object ({exc.msg} at character {exc.pos})"
    return None if isinstance(value, dict) else "must be a JSON object, like '{\"key\": value}'"


def layer_ids(ids: tuple[int, ...] | None) -> str | None:
    if ids is None:
        return None
    if not ids:
        return "give at least one layer id"
    if any(i < 0 for i in ids):
        return "ids must be >= 0"
    reason = layer_order(ids)
    return None if reason is None else f"{reason} (give {','.join(map(str, sorted(set(ids))))})"


def layer_order(ids: Sequence[int]) -> str | None:
    """Why `ids` cannot be the captured target layers of a drafter an engine serves, or
    None. vLLM and SGLang capture each named layer once and concatenate them in ascending
    order, whatever order the drafter's config lists them in: the `fc` input columns of
    a drafter trained on another order would meet other layers' states."""
    seen: set[int] = set()
    for i in ids:
        if i in seen:
            return f"layer {i} is named twice: vLLM and SGLang capture each layer once"
        seen.add(i)
    if list(ids) != sorted(ids):
        return "ids must be ascending: vLLM and SGLang concatenate the layers in that order"
    return None
