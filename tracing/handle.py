"""SpanHandle: a span that may end on any thread, and the record the processors queue.

With tracing off a handle only measures its duration for ProfileStats. With a span
(`_rec` set) it holds exactly what the span needs (ids, times, name, parent,
attributes, status); the export thread builds the SDK span from it (`to_readable`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from tracing import record
from tracing.clock import now_ns
from tracing.record import Recorder
from tracing.stats import NO_THREAD, ProfileStats

logger = logging.getLogger("tracing")
_EMPTY_CONTEXT = Context()
_time_ns = now_ns
_new_span_id = record.new_span_id
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)
_UNSET = Status(StatusCode.UNSET)
_NO_EVENTS: tuple[Event, ...] = ()


class SpanHandle:
    """A span that may be ended on another thread; `.context` is a parent for other threads.

    With tracing off the handle still measures its duration for ProfileStats. When it
    has a span (`_rec` set), the handle is also the span's record: the processors queue
    the ended handle itself and build the SDK span from it on their own thread.
    """

    __slots__ = ("name", "start_time_ns", "end_time_ns", "trace_id", "span_id", "sampled",
                 "_rec", "_parent_link", "_trace_state", "_attributes", "_events", "_status",
                 "_ended", "_stats", "_span_context", "_context", "_readable",
                 "_hooks")  # fmt: skip

    def __init__(
        self,
        name: str,
        start_time_ns: int,
        stats: ProfileStats | None = None,
    ) -> None:
        self.name = name
        self.start_time_ns = start_time_ns
        self._rec: Recorder | None = None
        self._ended = False
        self._stats = stats
        self._hooks: tuple[Any, ...] = ()  # tracing.hooks.PhaseHook objects, set by start_span

    # --- recording (hot path) --------------------------------------------------------

    def _begin(self, recorder: Recorder, parent: object, attributes: Mapping | None) -> None:
        """Gives the handle a span under `parent` (a SpanHandle, a SpanContext or None
        for a new trace): ids, sampling decision, a private copy of the attributes."""
        if parent is None:
            trace_id = record.new_trace_id()
            self.sampled = recorder.root_sampled(trace_id, self.name, attributes)
            self._trace_state = None
        elif isinstance(parent, SpanHandle):
            trace_id = parent.trace_id
            self.sampled = parent.sampled
            self._trace_state = parent._trace_state
        else:  # a SpanContext from another tracer's (possibly remote) span
            assert isinstance(parent, SpanContext)
            trace_id = parent.trace_id
            self.sampled = parent.trace_flags.sampled
            self._trace_state = parent.trace_state
        if parent is not None:
            sampler = recorder.child_sampler()
            if sampler is not None:
                under = parent if isinstance(parent, SpanContext) else span_context(parent)
                self.sampled = recorder.child_sampled(sampler, under, self.name, attributes)
        self.trace_id = trace_id
        self.span_id = _new_span_id()
        self._parent_link = parent
        self._attributes = dict(attributes) if attributes and self.sampled else None
        self._events: list[Event] | None = None
        self._status: Status | None = None
        self._span_context: SpanContext | None = None
        self._context: Context | None = None
        self._readable: ReadableSpan | None = None
        self._rec = recorder

    def _mark_error(self, exc: BaseException) -> None:
        if self.sampled:
            recorder = self._rec
            assert recorder is not None
            event = recorder.exception_event(exc, _time_ns())
            if self._events is None:
                self._events = [event]
            else:
                self._events.append(event)
            self._status = record.error_status(exc)

    # --- public face -----------------------------------------------------------------

    @property
    def context(self) -> Context | None:
        """OTel Context holding this span (None without a span: children then use the
        current phase or start their own trace)."""
        if self._rec is None:
            return None
        context = self._context
        if context is None:
            span = trace.NonRecordingSpan(span_context(self))
            context = self._context = trace.set_span_in_context(span, _EMPTY_CONTEXT)
        return context

    @property
    def span_context(self) -> SpanContext | None:
        return None if self._rec is None else span_context(self)

    @property
    def span(self) -> trace.Span | None:
        """A read-only OTel view of the span (change it through this handle's methods)."""
        return None if self._rec is None else trace.NonRecordingSpan(span_context(self))

    @property
    def recording(self) -> bool:
        return self._rec is not None and self.sampled and not self._ended

    def set_attribute(self, key: str, value: Any) -> None:
        if self._rec is None or not self.sampled or self._ended:
            return  # no span, not sampled, or ended (the SDK ignores these too)
        if self._attributes is None:
            self._attributes = {key: value}
        else:
            self._attributes[key] = value

    def record_exception(self, exc: BaseException) -> None:
        """Marks the span ERROR with an exception event."""
        if self._rec is not None and not self._ended:
            self._mark_error(exc)

    def end(self, end_time_ns: int | None = None) -> None:
        """Ends the span (from any thread; a second call does nothing) and records its
        duration in ProfileStats as a cross-thread entry (no share column)."""
        if self._ended:
            return
        self._ended = True
        end_ns = _time_ns() if end_time_ns is None else end_time_ns
        if self._hooks:
            record.call_hooks(self._hooks, "span_ended", self, end_ns)
        if self._stats is not None:
            self._stats.add(self.name, (end_ns - self.start_time_ns) / 1e9, thread=NO_THREAD)
        self._finish(end_ns)

    def _finish(self, end_ns: int) -> None:
        self.end_time_ns = end_ns
        recorder = self._rec
        if recorder is not None and self.sampled:
            recorder.finish(self)
            if recorder.sync_processors:
                _deliver_now(self, recorder.sync_processors)


def resolve_parent(parent: object) -> SpanHandle | SpanContext | None:
    """The parent a new span hangs under: a SpanHandle with a span, a foreign valid
    SpanContext, or None (a new trace). A handle without a span, like None, falls back
    to the current OTel context (as the SDK's start_span(context=None) does); anything
    else is reported once and treated like None (telemetry never raises)."""
    if isinstance(parent, SpanHandle):
        if parent._rec is not None:
            return parent
        return record.foreign_parent(None)
    if isinstance(parent, Context):
        return record.foreign_parent(parent)
    record.warn_once(
        "parent", f"parent must be an OTel Context or a SpanHandle, got {type(parent).__name__}"
    )
    return record.foreign_parent(None)


def _deliver_now(handle: SpanHandle, processors: Sequence[SpanProcessor]) -> None:
    """`on_end` of each synchronous processor, on the ending thread (tests). Never raises."""
    try:
        span = to_readable(handle)
    except Exception:  # telemetry never crashes the host program
        logger.exception("tracing: could not build span %s", handle.name)
        return
    for processor in processors:
        try:
            processor.on_end(span)
        except Exception:
            logger.exception("tracing: span processor %s raised", type(processor).__name__)


# --- the SDK span of a handle (export threads) -------------------------------------


def span_context(handle: SpanHandle) -> SpanContext:
    """The SpanContext of a handle that has a span (built once, then cached)."""
    cached = handle._span_context
    if cached is None:
        flags = _SAMPLED if handle.sampled else _NOT_SAMPLED
        cached = SpanContext(handle.trace_id, handle.span_id, False, flags, handle._trace_state)
        handle._span_context = cached
    return cached


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
