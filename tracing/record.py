"""Span recording without the SDK on the hot path.

The SDK's `Tracer.start_span` + `Span.end` cost 15-30 us per span on a small machine
(sampler objects, locks, attribute validation, processor fan-out). A phase only needs
its ids, times, name, parent, attributes and status, so the hot path keeps exactly that
on the phase's own handle (a `SpanHandle`) and hands the handle to the processors. The
export thread turns it into the SDK's `ReadableSpan` (`to_readable`), with the
provider's Resource and our instrumentation scope, and calls the real exporters.

Sampling is the SDK's ParentBased(TraceIdRatioBased(ratio)), computed inline: a root
is sampled when the low 64 bits of its trace id are below round(ratio * 2**64); a child
follows its parent's sampled flag, local or remote.
"""

from __future__ import annotations

import logging
import os
import random
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits, SpanProcessor
from opentelemetry.sdk.trace.sampling import TraceIdRatioBased
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

if TYPE_CHECKING:
    from tracing.handle import SpanHandle

logger = logging.getLogger("tracing")


def _scope_version() -> str:
    """The version of the installed distribution that ships this package."""
    from importlib import metadata

    for dist in metadata.packages_distributions().get(__name__.partition(".")[0], []):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "0+unknown"


SCOPE_NAME = "tracing"
SCOPE_VERSION = _scope_version()
_TRACE_ID_LOW_MASK = TraceIdRatioBased.TRACE_ID_LIMIT  # the bits TraceIdRatioBased reads
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)
_UNSET = Status(StatusCode.UNSET)
_NO_EVENTS: tuple[Event, ...] = ()


_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Logs `message` the first time `key` comes up (misuse reported, never raised)."""
    if key not in _warned:
        _warned.add(key)
        logger.warning("tracing: %s", message)


class _IdSource:
    """Ids from a generator of our own, seeded from the OS and re-seeded in a forked
    child. The process-wide `random` would give every rank and rerun the same ids once
    the program calls random.seed (set_seed / seed_everything do), and drawing from it
    would change the program's own random sequence."""

    def __init__(self) -> None:
        self._random = random.Random()
        self.reseed()

    def reseed(self) -> None:
        self._random.seed(int.from_bytes(os.urandom(32), "little"))
        self.getrandbits = self._random.getrandbits


_ids = _IdSource()
os.register_at_fork(after_in_child=_ids.reseed)


def new_trace_id() -> int:
    """128 random bits, never the invalid id 0 (as the SDK's RandomIdGenerator)."""
    trace_id = _ids.getrandbits(128)
    while not trace_id:
        trace_id = _ids.getrandbits(128)
    return trace_id


def new_span_id() -> int:
    span_id = _ids.getrandbits(64)
    while not span_id:
        span_id = _ids.getrandbits(64)
    return span_id


def foreign_parent(context: Context | None) -> SpanContext | None:
    """The valid SpanContext held by an OTel Context (None: `context` starts no trace).

    `context=None` reads the current OTel context, as the SDK's `start_span` does.
    """
    span_context = trace.get_current_span(context).get_span_context()
    return span_context if span_context.is_valid else None


class Recorder:
    """What recording spans needs, built once by `setup`; never mutated afterwards.

    Thread contract: `finish` runs on the thread that ends a span and never blocks;
    `to_readable` runs on an export thread (or on the ending thread for `sync_processors`).
    """

    __slots__ = ("bound", "resource", "scope", "limits", "_appends", "_sync_processors")

    def __init__(
        self,
        sample_ratio: float,
        resource: Resource,
        appends: Sequence[Callable[[SpanHandle], None]] = (),
        sync_processors: Sequence[SpanProcessor] = (),
    ) -> None:
        """`appends` take ended sampled handles (a bounded processor's `on_end_record`);
        `sync_processors` get a ReadableSpan through `on_end` at once (tests)."""
        self.bound = TraceIdRatioBased.get_bound_for_rate(sample_ratio)
        self.resource = resource
        self.scope = InstrumentationScope(SCOPE_NAME, SCOPE_VERSION)
        self.limits = SpanLimits()
        self._appends = tuple(appends)
        self._sync_processors = tuple(sync_processors)

    def root_sampled(self, trace_id: int) -> bool:
        return (trace_id & _TRACE_ID_LOW_MASK) < self.bound

    def finish(self, handle: SpanHandle) -> None:
        """Hands an ended, sampled span to every processor. Never raises."""
        for append in self._appends:
            append(handle)
        if self._sync_processors:
            self._finish_sync(handle)

    def _finish_sync(self, handle: SpanHandle) -> None:
        try:
            span = to_readable(handle)
        except Exception:  # telemetry never crashes the host program
            logger.exception("tracing: could not build span %s", handle.name)
            return
        for processor in self._sync_processors:
            try:
                processor.on_end(span)
            except Exception:
                logger.exception("tracing: span processor %s raised", type(processor).__name__)

    def attributes(self, values: dict[str, Any] | None) -> BoundedAttributes:
        limits = self.limits
        return BoundedAttributes(
            limits.max_span_attributes,
            values,
            immutable=True,
            max_value_len=limits.max_span_attribute_length,
        )

    def exception_event(self, exc: BaseException, timestamp_ns: int) -> Event:
        """The event the SDK's `Span.record_exception` adds (same attribute names)."""
        module = type(exc).__module__
        qualname = type(exc).__qualname__
        limits = self.limits
        attributes = BoundedAttributes(
            limits.max_event_attributes,
            {
                "exception.type": f"{module}.{qualname}"
                if module and module != "builtins"
                else qualname,
                "exception.message": str(exc),
                "exception.stacktrace": "".join(traceback.format_exception(exc)),
                "exception.escaped": "False",
            },
            immutable=True,
            max_value_len=limits.max_attribute_length,
        )
        return Event("exception", attributes, timestamp_ns)


def span_context(handle: SpanHandle) -> SpanContext:
    """The SpanContext of a handle that has a span (built once, then cached)."""
    cached = handle._span_context
    if cached is None:
        flags = _SAMPLED if handle.sampled else _NOT_SAMPLED
        cached = SpanContext(handle.trace_id, handle.span_id, False, flags, handle._trace_state)
        handle._span_context = cached
    return cached


def error_status(exc: BaseException) -> Status:
    return Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}")


def span_start_ns(handle: SpanHandle) -> int:
    """The exported start of a handle's span. A wait begun before its parent existed
    starts with its parent (a child outside its parent confuses trace views); the
    statistics keep all of it."""
    link = handle._parent_link
    if link is not None and not isinstance(link, SpanContext):
        return max(handle.start_time_ns, link.start_time_ns)
    return handle.start_time_ns


def readable_spans(spans: Sequence[ReadableSpan | SpanHandle]) -> list[ReadableSpan]:
    """The SDK spans of a batch that mixes SDK spans and ended handles."""
    return [s if isinstance(s, ReadableSpan) else to_readable(s) for s in spans]


def to_readable(handle: SpanHandle) -> ReadableSpan:
    """The SDK span of an ended handle (runs on the export thread; cached per handle)."""
    readable = handle._readable
    if readable is not None:
        return readable
    recorder = handle._rec
    assert recorder is not None  # only handles with a span reach the processors
    parent = handle._parent_link
    if parent is not None and not isinstance(parent, SpanContext):
        parent = span_context(parent)
    # dict(...) copies in one step under the GIL: a late set_attribute cannot break it.
    values = handle._attributes
    readable = ReadableSpan(
        name=handle.name,
        context=span_context(handle),
        parent=parent,
        resource=recorder.resource,
        attributes=recorder.attributes(dict(values) if values else None),
        events=tuple(handle._events) if handle._events else _NO_EVENTS,
        kind=SpanKind.INTERNAL,
        status=handle._status or _UNSET,
        start_time=span_start_ns(handle),
        end_time=handle.end_time_ns,
        instrumentation_scope=recorder.scope,
    )
    handle._readable = readable
    return readable
