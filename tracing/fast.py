"""The fast path: phase spans recorded without the SDK's Span on the hot path (the SDK's
Tracer costs the training thread about three times more: `bench/tracing_overhead.py`,
figures in docs/observability.md).

A `FastSpan` holds what a span needs; at its end it becomes the SDK's ReadableSpan (the
provider's resource, the SDK's span limits) for the `on_end` of tracing's processors.
`FastTracer` stands in for the SDK's Tracer only where no one can tell (`fits`): on the
provider `setup` built, with a parent-based sampler, the tracer enabled, and only
tracing's processors (the SDK's batch processors and a counter, whose `on_start` and
ending hook do nothing). What the SDK's Tracer does besides, it does too: the SDK's own
span metrics (`otel.sdk.span.*`, through the SDK Tracer's recorder), the W3C
random-trace-id flag (SDK 1.42 on). Once another processor is added or the tracer
configuration changes, `setup` puts the SDK's Tracer in its place. The SDK's
`ReadableSpan.to_json()` of every kind of span is the same both ways, at both ends of
the supported SDK range (`tests/tracing/test_fast.py`, `scripts/otel_versions.sh`).
"""

from __future__ import annotations

import dis
import os
import random
import traceback
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.context import Context
from opentelemetry.sdk.trace import (
    Event,
    ReadableSpan,
    SpanLimits,
    SpanProcessor,
    Tracer,
    TracerProvider,
)
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import Decision
from opentelemetry.sdk.util import BoundedList
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    Link,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)
from opentelemetry.util.types import Attributes, AttributeValue

from tracing.clock import now_ns

_UNSET = Status(StatusCode.UNSET)
_NO_ATTRIBUTES: Mapping[str, AttributeValue] = MappingProxyType({})  # as the SDK's: empty, not None
# W3C random-trace-id flag: the API has it and the SDK's Tracer sets it from 1.42 on
# (the two are released together, pinned to each other); 0 before.
RANDOM_FLAG: int = getattr(TraceFlags, "RANDOM_TRACE_ID", 0)
# Span flags by (sampled, random): TraceFlags made once, not per span.
_FLAGS = {
    (sampled, random_id): TraceFlags(
        (TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT) | (RANDOM_FLAG if random_id else 0)
    )
    for sampled in (False, True)
    for random_id in (False, True)
}


_RETURN_NONE = ([("LOAD_CONST", None), ("RETURN_VALUE", None)], [("RETURN_CONST", None)])


def does_nothing(hook: object) -> bool:
    """Whether a processor's hook is an empty function (`pass`, a docstring at most):
    its bytecode returns None and does nothing else."""
    code = getattr(hook, "__code__", None)
    if code is None:
        return False
    ops = [(op.opname, op.argval) for op in dis.get_instructions(code)]
    return [op for op in ops if op[0] not in ("RESUME", "NOP")] in _RETURN_NONE


def fits(sdk_tracer: Tracer, processors: Sequence[SpanProcessor]) -> bool:
    """Whether `FastTracer` can stand in for `sdk_tracer` with these processors: the
    tracer enabled (its configuration is the SDK's private `_is_enabled`; tracing's
    provider hands phases back to the SDK's Tracer when it changes), the SDK's span
    metrics recorder where `FastTracer` finds it, and no processor with an ending hook
    (`_on_ending`, the mutable span before `on_end`; `on_ending` should the SDK make it
    public) that does something: the fast path has no mutable SDK span to give it."""
    enabled = getattr(sdk_tracer, "_is_enabled", None)
    if enabled is None or not enabled():
        return False
    if not callable(getattr(getattr(sdk_tracer, "_tracer_metrics", None), "start_span", None)):
        return False
    for processor in processors:
        for name in ("_on_ending", "on_ending"):
            hook = getattr(type(processor), name, None)
            if hook is not None and not does_nothing(hook):
                return False
    return True


class PhaseIds(IdGenerator):
    """Span and trace ids from a generator of tracing's own, seeded from the OS and again
    in a forked child. The process-wide `random` (the SDK's default) would give every
    rank and rerun the same ids once the program calls random.seed, and drawing from it
    would change the program's own random sequence."""

    def __init__(self) -> None:
        self._random = random.Random()  # seed() without a value draws from os.urandom
        os.register_at_fork(after_in_child=self._random.seed)

    def is_trace_id_random(self) -> bool:
        """All 128 bits are random: the W3C random-trace-id flag (SDK 1.42 on) is true."""
        return True

    def generate_span_id(self) -> int:
        return self._random.getrandbits(64) or 1  # 0 is the invalid id

    def generate_trace_id(self) -> int:
        return self._random.getrandbits(128) or 1


class FastSpan(trace.Span):
    """A sampled span of `FastTracer`. Thread contract: one thread at a time changes it
    (the phase's, then the device-timing resolver's); `end` from any thread, once."""

    __slots__ = (
        *("name", "trace_id", "span_id", "parent", "trace_state", "attributes", "events"),
        *("status", "start_time", "end_time", "links", "_tracer", "_context", "_flags"),
        "_metrics_end",
    )

    def __init__(
        self,
        tracer: FastTracer,
        name: str,
        parent: SpanContext | None,
        trace_id: int,
        trace_state: TraceState | None,
        attributes: dict[str, AttributeValue] | None,
        start_time: int,
        flags: TraceFlags,
        metrics_end: Callable[[], None],
        links: Sequence[Link] = (),
    ) -> None:
        self._tracer, self.name, self.parent, self.trace_id = tracer, name, parent, trace_id
        self.span_id, self.trace_state = tracer.ids.generate_span_id(), trace_state
        self.attributes = attributes  # already clean (tracing.spans): copied, never shared
        self.events: BoundedList[Event] | None = None
        self.status, self.start_time, self.links = _UNSET, start_time, links
        self.end_time: int | None = None
        self._context: SpanContext | None = None
        self._flags, self._metrics_end = flags, metrics_end

    def get_span_context(self) -> SpanContext:
        context = self._context
        if context is None:
            args = (self.trace_id, self.span_id, False, self._flags, self.trace_state)
            context = self._context = SpanContext(*args)
        return context

    def is_recording(self) -> bool:
        return self.end_time is None

    def set_attribute(self, key: str, value: AttributeValue) -> None:
        if self.end_time is None:
            if self.attributes is None:
                self.attributes = {}
            self.attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, AttributeValue]) -> None:
        for key, value in attributes.items():
            self.set_attribute(key, value)

    def add_event(
        self, name: str, attributes: Attributes = None, timestamp: int | None = None
    ) -> None:
        if self.end_time is None:
            limits = self._tracer.limits
            event_attributes = BoundedAttributes(
                limits.max_event_attributes, attributes, max_value_len=limits.max_attribute_length
            )
            event = Event(name, event_attributes, now_ns() if timestamp is None else timestamp)
            if self.events is None:  # at most max_events, the rest counted as dropped
                self.events = BoundedList(limits.max_events)
            self.events.append(event)

    def add_link(self, context: SpanContext, attributes: Attributes = None) -> None:
        """A link added after the start, kept as the SDK's Span keeps one."""
        if self.end_time is None:
            links = self.links
            if not isinstance(links, BoundedList):
                links = self.links = BoundedList.from_seq(self._tracer.limits.max_links, links)
            links.extend(bounded_links([Link(context, attributes)], self._tracer.limits))

    def update_name(self, name: str) -> None:
        if self.end_time is None:
            self.name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        """As the SDK's Span: an OK status stays, UNSET is no change."""
        if self.end_time is None and self.status.status_code is not StatusCode.OK:
            if not isinstance(status, Status):
                status = Status(status, description)
            if status.status_code is not StatusCode.UNSET:
                self.status = status

    def record_exception(
        self,
        exception: BaseException,
        attributes: Attributes = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        """The event the SDK's `Span.record_exception` adds (same attribute names)."""
        module, qualname = type(exception).__module__, type(exception).__qualname__
        values: dict[str, AttributeValue] = {
            "exception.type": f"{module}.{qualname}" if module != "builtins" else qualname,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": str(escaped),
            **(attributes or {}),
        }
        self.add_event("exception", values, timestamp)

    def end(self, end_time: int | None = None) -> None:
        """Ends the span and hands the SDK's ReadableSpan of it to the processors."""
        if self.end_time is not None:
            return
        self.end_time = now_ns() if end_time is None else end_time
        tracer, limits = self._tracer, self._tracer.limits
        attributes: Attributes = self.attributes
        most = limits.max_span_attributes  # None: unlimited (OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT)
        if attributes and (
            (most is not None and len(attributes) > most) or limits.max_span_attribute_length
        ):  # the values are clean already; only the SDK's limits are left to apply
            attributes = BoundedAttributes(
                limits.max_span_attributes,
                attributes,
                max_value_len=limits.max_span_attribute_length,
            )
        self._metrics_end()  # the SDK's span metrics: one live span less
        span = ReadableSpan(
            name=self.name,
            context=self.get_span_context(),
            parent=self.parent,
            resource=tracer.provider.resource,  # refreshed by the SDK after a fork
            attributes=_NO_ATTRIBUTES if attributes is None else attributes,
            events=self.events if self.events is not None else (),
            links=self.links,
            kind=SpanKind.INTERNAL,
            status=self.status,
            start_time=self.start_time,
            end_time=self.end_time,
            instrumentation_scope=tracer.scope,
        )
        for processor in tracer.processors:
            processor.on_end(span)


class FastTracer:
    """`start_span` as the SDK's Tracer answers it, for the provider `setup` built.
    Thread contract: `start_span` from any thread; it never blocks."""

    def __init__(
        self,
        provider: TracerProvider,
        processors: Sequence[SpanProcessor],
        scope: InstrumentationScope,
        sdk_tracer: Tracer,
    ) -> None:
        """`sdk_tracer`: the provider's SDK Tracer of `scope`, which `fits` accepted."""
        self.sampler = provider.sampler  # kept, as the SDK's Tracer keeps it
        self.provider, self.ids, self.scope = provider, provider.id_generator, scope
        self.limits = SpanLimits()
        self.processors = tuple(processors)
        # The SDK's span metrics as its Tracer records them (off unless the SDK's internal
        # metrics are enabled from 1.4x on; always on at 1.40, to the global meter).
        self.metrics = sdk_tracer._tracer_metrics
        is_random = getattr(self.ids, "is_trace_id_random", None)
        self.random_roots = bool(RANDOM_FLAG and is_random is not None and is_random())

    def start_span(
        self,
        name: str,
        context: Context | None = None,
        attributes: dict[str, AttributeValue] | None = None,
        start_time: int | None = None,
        links: Sequence[Link] | None = None,
    ) -> trace.Span:
        parent: SpanContext | None = trace.get_current_span(context).get_span_context()
        state: TraceState | None
        if (
            parent is not None and parent.is_valid
        ):  # a parent-based sampler follows the parent's decision
            trace_id, state = parent.trace_id, parent.trace_state
            sampled = parent.trace_flags.sampled
            random_id = bool(parent.trace_flags & RANDOM_FLAG)
        else:
            parent, trace_id = None, self.ids.generate_trace_id()
            result = self.sampler.should_sample(
                context, trace_id, name, SpanKind.INTERNAL, attributes, links
            )
            sampled, state = result.decision is Decision.RECORD_AND_SAMPLE, result.trace_state
            random_id = self.random_roots
            if result.attributes:
                attributes = {**(attributes or {}), **result.attributes}
        flags = _FLAGS[sampled, random_id]
        decision = Decision.RECORD_AND_SAMPLE if sampled else Decision.DROP
        metrics_end = self.metrics.start_span(parent, decision)
        if not sampled:
            span_id = self.ids.generate_span_id()
            return trace.NonRecordingSpan(SpanContext(trace_id, span_id, False, flags, state))
        start = now_ns() if start_time is None else start_time
        args = (self, name, parent, trace_id, state, attributes, start, flags, metrics_end)
        if links:
            return FastSpan(*args, bounded_links(links, self.limits))
        return FastSpan(*args)


def bounded_links(links: Sequence[Link], limits: SpanLimits) -> BoundedList[Link]:
    """The links as the SDK's Span keeps them (its `_new_links`): those with a valid
    context (or attributes or a trace state), each with its attributes bounded by the
    link limits and made immutable, at most `max_links` of them (the rest counted as
    dropped). New Link objects: the caller's are left as they were."""
    kept = [
        Link(
            link.context,
            BoundedAttributes(
                limits.max_link_attributes,
                link.attributes,
                max_value_len=limits.max_attribute_length,
                immutable=True,
            ),
        )
        for link in links
        if link.context and (link.context.is_valid or link.attributes or link.context.trace_state)
    ]
    return BoundedList.from_seq(limits.max_links, kept)
