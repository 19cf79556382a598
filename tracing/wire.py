"""Span records that cross a pipe: plain tuples that `marshal` writes in C.

The export process (`tracing.export_process`) receives ended spans as these records and
rebuilds the SDK's ReadableSpans from them (`from_record`), so the program being traced
spends no GIL time on OTLP encoding. A record holds what the OTLP encoder reads:

    (name, trace_id, span_id, trace_flags, trace_state, parent_span_id, parent_is_remote,
     attributes, events, links, kind, status_code, status_description, start_ns, end_ns,
     scope_index)

`scope_index` points into the batch's list of (name, version, schema_url) scopes. A
record of a SpanHandle carries the same start-time clipping as `record.to_readable`.
"""

from __future__ import annotations

import marshal
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

if TYPE_CHECKING:
    from tracing.handle import SpanHandle

Record = tuple[Any, ...]
Scope = tuple[str, str | None, str | None]
_INTERNAL = SpanKind.INTERNAL.value
_KINDS = {kind.value: kind for kind in SpanKind}
_CODES = {code.value: code for code in StatusCode}


def _state(trace_state: TraceState | None) -> tuple[tuple[str, str], ...] | None:
    return tuple(trace_state.items()) if trace_state else None


def _events(events: Sequence[Event] | None) -> tuple[Any, ...] | None:
    if not events:
        return None
    return tuple(
        (e.name, dict(e.attributes) if e.attributes else None, e.timestamp) for e in events
    )


def handle_record(handle: SpanHandle, scope_index: int) -> Record:
    """The record of an ended, sampled SpanHandle (runs on the export thread)."""
    from tracing.handle import SpanHandle

    parent = handle._parent_link
    start_ns = handle.start_time_ns
    if parent is None:
        parent_id, remote = 0, False
    elif isinstance(parent, SpanHandle):
        parent_id, remote = parent.span_id, False
        # As record.to_readable: a child never starts before its parent.
        start_ns = max(start_ns, parent.start_time_ns)
    else:
        parent_id, remote = parent.span_id, parent.is_remote
    status = handle._status
    values = handle._attributes
    return (
        handle.name, handle.trace_id, handle.span_id, 1 if handle.sampled else 0,
        _state(handle._trace_state), parent_id, remote, dict(values) if values else None,
        _events(handle._events), None, _INTERNAL,
        status.status_code.value if status is not None else 0,
        status.description if status is not None else None,
        start_ns, handle.end_time_ns, scope_index,
    )  # fmt: skip


def span_record(span: ReadableSpan, scope_index: int) -> Record:
    """The record of an SDK span (another tracer's, through the provider)."""
    context = span.context
    parent = span.parent
    links = None
    if span.links:
        links = tuple(
            (link.context.trace_id, link.context.span_id, int(link.context.trace_flags),
             link.context.is_remote, _state(link.context.trace_state),
             dict(link.attributes) if link.attributes else None)
            for link in span.links
        )  # fmt: skip
    return (
        span.name, context.trace_id, context.span_id, int(context.trace_flags),
        _state(context.trace_state), parent.span_id if parent is not None else 0,
        parent.is_remote if parent is not None else False,
        dict(span.attributes) if span.attributes else None, _events(span.events), links,
        span.kind.value, span.status.status_code.value, span.status.description,
        span.start_time, span.end_time, scope_index,
    )  # fmt: skip


def encode_batch(spans: Sequence[ReadableSpan | SpanHandle], own_scope: Scope) -> bytes:
    """One marshalled (scopes, records) batch. Attribute values marshal cannot write (a
    value the SDK would drop too) are cleaned the SDK's way and the batch written again."""
    scopes: list[Scope] = [own_scope]
    index: dict[Scope, int] = {own_scope: 0}
    records = []
    for span in spans:
        if isinstance(span, ReadableSpan):
            scope = span.instrumentation_scope
            key = (scope.name, scope.version, scope.schema_url) if scope else ("", None, None)
            if key not in index:
                index[key] = len(scopes)
                scopes.append(key)
            records.append(span_record(span, index[key]))
        else:
            records.append(handle_record(span, 0))
    try:
        return marshal.dumps((scopes, records))
    except ValueError:
        records = [_cleaned(record) for record in records]
        return marshal.dumps((scopes, records))


def _cleaned(record: Record) -> Record:
    limits = SpanLimits()
    attributes = record[7]
    if attributes:
        cleaned = BoundedAttributes(
            limits.max_span_attributes, attributes, max_value_len=limits.max_attribute_length
        )
        attributes = {k: v for k, v in cleaned.items() if _marshals(v)}
    events = record[8]
    if events:
        events = tuple((name, _clean_dict(values), ts) for name, values, ts in events)
    return (*record[:7], attributes, events, *record[9:])


def _clean_dict(values: dict[str, Any] | None) -> dict[str, Any] | None:
    if not values:
        return None
    cleaned = BoundedAttributes(None, values)
    return {k: v for k, v in cleaned.items() if _marshals(v)}


def _marshals(value: object) -> bool:
    try:
        marshal.dumps(value)
    except ValueError:
        return False
    return True


class SpanBuilder:
    """Rebuilds ReadableSpans from records (in the export process), with the traced
    process's Resource and the SDK's default span limits, as `record.to_readable` does."""

    def __init__(self, resource: Resource) -> None:
        self.resource = resource
        self.limits = SpanLimits()
        self._scopes: dict[Scope, InstrumentationScope] = {}

    def _scope(self, key: Scope) -> InstrumentationScope:
        scope = self._scopes.get(key)
        if scope is None:
            scope = self._scopes[key] = InstrumentationScope(*key)
        return scope

    def build(self, payload: bytes) -> list[ReadableSpan]:
        scopes, records = marshal.loads(payload)
        scope_objects = [self._scope(tuple(key)) for key in scopes]
        return [self._span(record, scope_objects) for record in records]

    def _span(self, record: Record, scopes: list[InstrumentationScope]) -> ReadableSpan:
        (name, trace_id, span_id, flags, state, parent_id, remote, attributes, events, links,
         kind, code, description, start_ns, end_ns, scope_index) = record  # fmt: skip
        trace_flags = TraceFlags(flags)
        trace_state = TraceState(state) if state else None
        context = SpanContext(trace_id, span_id, False, trace_flags, trace_state)
        parent = (
            SpanContext(trace_id, parent_id, remote, trace_flags, trace_state)
            if parent_id
            else None
        )
        limits = self.limits
        return ReadableSpan(
            name=name,
            context=context,
            parent=parent,
            resource=self.resource,
            attributes=BoundedAttributes(
                limits.max_span_attributes,
                attributes,
                immutable=True,
                max_value_len=limits.max_span_attribute_length,
            ),
            events=tuple(self._event(*event) for event in events) if events else (),
            links=tuple(self._link(*link) for link in links) if links else (),
            kind=_KINDS[kind],
            status=Status(_CODES[code], description),
            start_time=start_ns,
            end_time=end_ns,
            instrumentation_scope=scopes[scope_index],
        )

    def _event(self, name: str, attributes: dict | None, timestamp: int) -> Event:
        limits = self.limits
        bounded = BoundedAttributes(
            limits.max_event_attributes,
            attributes,
            immutable=True,
            max_value_len=limits.max_attribute_length,
        )
        return Event(name, bounded, timestamp)

    def _link(self, trace_id: int, span_id: int, flags: int, remote: bool,
              state: Any, attributes: dict | None) -> Link:  # fmt: skip
        context = SpanContext(
            trace_id, span_id, remote, TraceFlags(flags), TraceState(state) if state else None
        )
        return Link(context, attributes)
