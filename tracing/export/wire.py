"""Span records that cross a pipe: plain tuples that `marshal` writes in C.

The export process (`tracing.export.process`) receives ended spans as these records and
encodes the OTLP request from them (`RequestBuilder`; `SpanBuilder` rebuilds the SDK's
ReadableSpans where that is needed), so the program being traced spends no GIL time on
OTLP encoding. A record holds what the OTLP encoder reads:

    (name, trace_id, span_id, trace_flags, trace_state, parent_span_id, parent_is_remote,
     attributes, events, links, kind, status_code, status_description, start_ns, end_ns,
     scope_index)

`scope_index` points into the batch's list of (name, version, schema_url) scopes. A
record of a SpanHandle starts where `handle.to_readable` starts its span.

On the pipe, each marshalled frame follows its length (FRAME); the child answers each
batch with (sequence number, 1 exported / 0 failed) (ACK), sequence number 0 meaning ready.
"""

from __future__ import annotations

import marshal
import struct
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

from tracing.handle import span_start_ns

if TYPE_CHECKING:
    from tracing.handle import SpanHandle

FRAME = struct.Struct("<I")
ACK = struct.Struct("<IB")
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
    parent = handle._parent_link
    if parent is None:
        parent_id, remote = 0, False
    elif isinstance(parent, SpanContext):
        parent_id, remote = parent.span_id, parent.is_remote
    else:  # a SpanHandle
        parent_id, remote = parent.span_id, False
    status = handle._status
    values = handle._attributes
    return (
        handle.name, handle.trace_id, handle.span_id, 1 if handle.sampled else 0,
        _state(handle._trace_state), parent_id, remote, dict(values) if values else None,
        _events(handle._events), None, _INTERNAL,
        status.status_code.value if status is not None else 0,
        status.description if status is not None else None,
        span_start_ns(handle), handle.end_time_ns, scope_index,
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
            limits.max_span_attributes, attributes, max_value_len=limits.max_span_attribute_length
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
    process's Resource and the SDK's default span limits, as `handle.to_readable` does."""

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


class EncodedBatch(Sequence[ReadableSpan]):
    """An OTLP request already built from records, handed to an SDK exporter in place of
    its spans: `encode_spans` of the exporter's module returns `.request` for it
    (`install_encoded_batches`); `len` is the span count the exporter reports."""

    def __init__(self, request: Any, count: int) -> None:
        self.request = request
        self._count = count

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: Any) -> Any:
        raise TypeError("an EncodedBatch holds an encoded request, not spans")

    def __iter__(self) -> Iterator[ReadableSpan]:
        raise TypeError("an EncodedBatch holds an encoded request, not spans")


def install_encoded_batches(module: Any) -> bool:
    """Makes `module.encode_spans` (an SDK exporter module's) pass EncodedBatches through;
    False when the module has none (another SDK version): spans must be built then."""
    original = getattr(module, "encode_spans", None)
    if original is None:
        return False
    if getattr(original, "passes_encoded_batches", False):
        return True

    def encode_spans(spans: Any) -> Any:
        return spans.request if isinstance(spans, EncodedBatch) else original(spans)

    encode_spans.passes_encoded_batches = True  # type: ignore[attr-defined]
    module.encode_spans = encode_spans
    return True


class RequestBuilder(SpanBuilder):
    """Encodes a batch of records straight into the OTLP request the SDK's `encode_spans`
    builds from the same spans, byte for byte (tests/tracing/test_export_process.py),
    at a third of its cost: a record of plain attributes (str, bool, int, float; no
    events, no links; within the attribute limit), which is every phase span, becomes
    one protobuf Span in C; any other goes through SpanBuilder and the SDK's encoder."""

    def __init__(self, resource: Resource) -> None:
        super().__init__(resource)
        from opentelemetry.exporter.otlp.proto.common._internal import (
            _encode_instrumentation_scope,
            _encode_resource,
        )
        from opentelemetry.exporter.otlp.proto.common._internal.trace_encoder import (
            _encode_span,
        )
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )
        from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
        from opentelemetry.proto.trace.v1 import trace_pb2

        self._pb = trace_pb2
        self._request_cls = ExportTraceServiceRequest
        self._any, self._kv = AnyValue, KeyValue
        self._encode_span = _encode_span
        self._encode_scope = _encode_instrumentation_scope
        self._resource_pb = _encode_resource(resource)
        self._max_attributes = self.limits.max_span_attributes
        self._max_length = self.limits.max_span_attribute_length
        self._cached: dict[tuple[str, str], Any] = {}

    def request(self, payload: bytes) -> EncodedBatch:
        scopes, records = marshal.loads(payload)
        scope_objects = [self._scope(tuple(key)) for key in scopes]
        by_scope: dict[int, list[Any]] = {}
        for record in records:
            span = self._fast(record)
            if span is None:
                span = self._encode_span(self._span(record, scope_objects))
            by_scope.setdefault(record[15], []).append(span)
        pb = self._pb
        scope_spans = [
            pb.ScopeSpans(
                scope=self._encode_scope(scope_objects[index]),
                spans=spans,
                schema_url=scope_objects[index].schema_url,
            )
            for index, spans in by_scope.items()
        ]
        resource_spans = pb.ResourceSpans(
            resource=self._resource_pb, scope_spans=scope_spans,
            schema_url=self.resource.schema_url,
        )  # fmt: skip
        request = self._request_cls(resource_spans=[resource_spans] if records else [])
        return EncodedBatch(request, len(records))

    def _fast(self, record: Record) -> Any:
        (name, trace_id, span_id, _flags, state, parent_id, remote, attributes, events, links,
         kind, code, description, start_ns, end_ns, _scope) = record  # fmt: skip
        if events or links:
            return None
        values = None
        if attributes:
            if len(attributes) > self._max_attributes or self._max_length is not None:
                return None
            any_value, key_value, cache = self._any, self._kv, self._cached
            values = []
            for key, value in attributes.items():
                kind_of = type(value)
                if not key or type(key) is not str:
                    return None
                if kind_of is str:
                    # Names, devices, thread names repeat: one message each, copied in C.
                    pair = cache.get((key, value))
                    if pair is None:
                        pair = key_value(key=key, value=any_value(string_value=value))
                        if len(cache) < _CACHE_SIZE:
                            cache[(key, value)] = pair
                    values.append(pair)
                elif kind_of is int:
                    values.append(key_value(key=key, value=any_value(int_value=value)))
                elif kind_of is float:
                    values.append(key_value(key=key, value=any_value(double_value=value)))
                elif kind_of is bool:
                    values.append(key_value(key=key, value=any_value(bool_value=value)))
                else:
                    return None
        pb = self._pb
        try:
            return pb.Span(
                trace_id=trace_id.to_bytes(16, "big"),
                span_id=span_id.to_bytes(8, "big"),
                trace_state=",".join(f"{k}={v}" for k, v in state) if state else None,
                parent_span_id=parent_id.to_bytes(8, "big") if parent_id else None,
                name=name,
                kind=kind + 1,  # SpanKind.INTERNAL (0) is SPAN_KIND_INTERNAL (1), and so on
                start_time_unix_nano=start_ns,
                end_time_unix_nano=end_ns,
                attributes=values,
                status=pb.Status(code=code, message=description),
                flags=_REMOTE_FLAGS if remote else _HAS_REMOTE_FLAG,
            )
        except (ValueError, TypeError, OverflowError):  # e.g. an int beyond int64
            return None


_CACHE_SIZE = 4096
_HAS_REMOTE_FLAG = 0x100  # SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK
_REMOTE_FLAGS = 0x100 | 0x200  # ... and SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK
