"""Span recording without the SDK on the hot path.

The SDK's `Tracer.start_span` + `Span.end` cost 15-30 us per span on a small machine
(sampler objects, locks, attribute validation, processor fan-out). A phase only needs
its ids, times, name, parent, attributes and status, so the hot path keeps exactly that
on the phase's own handle (a `tracing.handle.SpanHandle`) and hands the handle to the
processors. The export thread turns it into the SDK's `ReadableSpan`
(`tracing.handle.to_readable`), with the provider's Resource and the instrumentation
scope kept here, and calls the real exporters.

Sampling is the SDK's ParentBased(TraceIdRatioBased(ratio)), computed inline: a root
is sampled when the low 64 bits of its trace id are below round(ratio * 2**64); a child
follows its parent's sampled flag, local or remote. A sampler put in the provider's
place is asked instead: for roots, and for children too unless it is parent-based.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import traceback
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any

from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ParentBased, Sampler, TraceIdRatioBased
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode

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


_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Logs `message` the first time `key` comes up (misuse reported, never raised)."""
    if key not in _warned:
        _warned.add(key)
        logger.warning("tracing: %s", message)


def coerce_attribute(value: Any) -> Any:
    """The attribute value a program means: numpy scalars and arrays as Python numbers
    and lists, an Enum as its value, sequences element by element. Anything else is left
    to the SDK's validation (which drops what is not an attribute type, with a warning)."""
    if isinstance(value, (str, bool, int, float)) and not isinstance(value, Enum):
        return value
    if isinstance(value, Enum):
        return coerce_attribute(value.value)
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):
        return value.tolist()  # np.float64(2.0) -> 2.0, np.array([1, 2]) -> [1, 2]
    if isinstance(value, (list, tuple)):
        return [coerce_attribute(v) for v in value]
    return value


class HookErrors:
    """Exceptions raised by phase hooks, counted; the first of each hook method is logged."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()
        self._logged: set[tuple[str, str]] = set()

    def record(self, hook: object, method: str, exc: BaseException) -> None:
        key = (type(hook).__qualname__, method)
        with self._lock:
            self.count += 1
            first = key not in self._logged
            self._logged.add(key)
        if first:
            logger.error("tracing: hook %s.%s raised (further ones are counted): %r",
                         *key, exc)  # fmt: skip


HOOK_ERRORS = HookErrors()


def call_hooks(hooks: Sequence[object], method: str, *args: Any) -> None:
    """`method(*args)` of every hook. A hook that raises is counted in HOOK_ERRORS and
    skipped: the phase still reaches ProfileStats and its span still ends."""
    for hook in hooks:
        try:
            getattr(hook, method)(*args)
        except Exception as exc:  # a hook must break neither tracing nor the program
            HOOK_ERRORS.record(hook, method, exc)


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


_NO_PARENT = Context()  # a new trace: no current span, whatever the thread's context
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


class PhaseIds(IdGenerator):
    """The provider's id generator, so SDK spans and phases draw ids from one source."""

    def generate_span_id(self) -> int:
        return new_span_id()

    def generate_trace_id(self) -> int:
        return new_trace_id()


def foreign_parent(context: Context | None) -> SpanContext | None:
    """The valid SpanContext held by an OTel Context (None: `context` starts no trace).

    `context=None` reads the current OTel context, as the SDK's `start_span` does.
    """
    span_context = trace.get_current_span(context).get_span_context()
    return span_context if span_context.is_valid else None


class Recorder:
    """What recording spans needs, built by `setup`.

    Thread contract: `finish` runs on the thread that ends a span and never blocks;
    the handle's `to_readable` runs on an export thread (or on the ending thread for
    `sync_processors`). `add_sync_processor` swaps the tuple in one step: a span ending
    meanwhile goes to the old or the new set, whole.
    """

    __slots__ = ("bound", "resource", "scope", "limits", "sync_processors", "_appends",
                 "_provider", "_built_sampler")  # fmt: skip

    def __init__(
        self,
        sample_ratio: float,
        resource: Resource,
        appends: Sequence[Callable[[Any], None]] = (),
        sync_processors: Sequence[SpanProcessor] = (),
        provider: TracerProvider | None = None,
    ) -> None:
        """`appends` take ended sampled handles (a bounded processor's `on_end_record`);
        `sync_processors` get a ReadableSpan through `on_end` at once. `provider`: the
        tracer provider whose sampler decides each new trace (its ratio sampler as
        built is computed inline; one put in its place is asked)."""
        self.bound = TraceIdRatioBased.get_bound_for_rate(sample_ratio)
        self.resource = resource
        self.scope = InstrumentationScope(SCOPE_NAME, SCOPE_VERSION)
        self.limits = SpanLimits()
        self._appends = tuple(appends)
        self.sync_processors = tuple(sync_processors)
        self._provider = provider
        self._built_sampler = provider.sampler if provider is not None else None

    def root_sampled(self, trace_id: int, name: str = "", attributes: Any = None) -> bool:
        """The sampling decision of a new trace. Spans under it follow it, as the
        parent-based samplers (the SDK's default) decide."""
        provider = self._provider
        if provider is not None and provider.sampler is not self._built_sampler:
            result = provider.sampler.should_sample(
                _NO_PARENT, trace_id, name, SpanKind.INTERNAL, attributes
            )
            return result.decision.is_sampled()
        return (trace_id & _TRACE_ID_LOW_MASK) < self.bound

    def child_sampler(self) -> Sampler | None:
        """The sampler to ask for a span with a parent: None when the parent's decision
        is the answer (the sampler as built, or any ParentBased one)."""
        provider = self._provider
        if provider is None or provider.sampler is self._built_sampler:
            return None
        sampler = provider.sampler
        return None if isinstance(sampler, ParentBased) else sampler

    @staticmethod
    def child_sampled(
        sampler: Sampler, parent: SpanContext, name: str, attributes: Any = None
    ) -> bool:
        context = trace.set_span_in_context(trace.NonRecordingSpan(parent))
        result = sampler.should_sample(
            context, parent.trace_id, name, SpanKind.INTERNAL, attributes
        )
        return result.decision.is_sampled()

    def add_sync_processor(self, processor: SpanProcessor) -> None:
        """`processor.on_end` gets every sampled phase span from now on."""
        self.sync_processors = (*self.sync_processors, processor)

    def finish(self, handle: Any) -> None:
        """Hands an ended, sampled span (a SpanHandle) to every bounded processor.
        Never raises; the handle delivers itself to `sync_processors`."""
        for append in self._appends:
            append(handle)

    def attributes(self, values: dict[str, Any] | None) -> BoundedAttributes:
        """A span's attributes by the one rule: `coerce_attribute`, then the SDK's own
        validation and limits (what its spans apply)."""
        limits = self.limits
        coerced = {k: coerce_attribute(v) for k, v in values.items()} if values else None
        return BoundedAttributes(
            limits.max_span_attributes,
            coerced,
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


def error_status(exc: BaseException) -> Status:
    return Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}")
