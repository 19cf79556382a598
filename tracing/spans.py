"""Phase spans: the hot path. `phase(...)` times a block, feeds ProfileStats, and (at an
enabled level, with a configured provider) records an OTel span.

Cost notes: a recorded span is the handle itself: ids from `random.getrandbits`, two
clock reads, the name, parent, attributes and status, appended to the export queue when
it ends; the export thread builds the SDK span from it (see `tracing.record`). No OTel
context is attached or detached, and no SDK object is built on the hot path: the
innermost open phase of the current thread/task is kept in one ContextVar of our own,
and an OTel Context is built only when someone asks for `.context`. With no span to
record, a phase is two clock reads and one `ProfileStats.add`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from typing import Any, TypeVar

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.trace import SpanContext, Status

from tracing import record
from tracing.clock import now_ns
from tracing.config import TracingConfigError
from tracing.device import DeviceClock, EventResolver
from tracing.format import DEVICE_SUFFIX
from tracing.record import Recorder
from tracing.stats import NO_THREAD, ProfileStats

LEVEL_RANK = {"off": 0, "step": 1, "phase": 2}
_EMPTY_CONTEXT = Context()
_time_ns = now_ns
_new_span_id = record.new_span_id
# Phase._mode: what `__exit__` has to undo (identity-compared small ints).
_PLAIN, _SPAN, _DEVICE = 0, 1, 2
F = TypeVar("F", bound=Callable[..., Any])


class Runtime:
    """What `setup` installs for `phase` to read; replaced as a whole, never mutated."""

    __slots__ = ("recorder", "level_rank", "stats", "clock", "sync", "resolver", "plain")

    def __init__(
        self,
        stats: ProfileStats,
        recorder: Recorder | None = None,
        level_rank: int = 0,
        clock: DeviceClock | None = None,
        sync: bool = False,
        resolver: EventResolver | None = None,
    ) -> None:
        self.stats = stats
        # None when no span can be recorded at any level: phases then skip all span work.
        self.recorder = recorder if level_rank > 0 else None
        self.level_rank = level_rank
        self.clock = clock
        self.sync = sync
        self.resolver = resolver
        # Phases can take the minimal path: nothing but clock reads and one `add`.
        self.plain = self.recorder is None and clock is None


DEFAULT_STATS = ProfileStats()
_runtime = Runtime(DEFAULT_STATS)
_current: ContextVar[SpanHandle | None] = ContextVar("tracing_current_phase", default=None)


def install(runtime: Runtime) -> None:
    global _runtime
    _runtime = runtime


def runtime() -> Runtime:
    return _runtime


def _level_rank(level: str) -> int:
    rank = LEVEL_RANK.get(level)
    if rank is None:
        raise TracingConfigError(f"phase level must be one of off, step, phase, got {level!r}")
    return rank


class SpanHandle:
    """A span that may be ended on another thread; `.context` is a parent for other threads.

    With tracing off the handle still measures its duration for ProfileStats. When it
    has a span (`_rec` set), the handle is also the span's record: the processors queue
    the ended handle itself and build the SDK span from it on their own thread.
    """

    __slots__ = ("name", "start_time_ns", "end_time_ns", "trace_id", "span_id", "sampled",
                 "_rec", "_parent_link", "_trace_state", "_attributes", "_events", "_status",
                 "_ended", "_stats", "_span_context", "_context", "_readable")  # fmt: skip

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

    # --- recording (hot path) --------------------------------------------------------

    def _begin(self, recorder: Recorder, parent: object, attributes: Mapping | None) -> None:
        """Gives the handle a span under `parent` (a SpanHandle, a SpanContext or None
        for a new trace): ids, sampling decision, a private copy of the attributes."""
        if parent is None:
            trace_id = record.new_trace_id()
            self.sampled = recorder.root_sampled(trace_id)
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
            span = trace.NonRecordingSpan(record.span_context(self))
            context = self._context = trace.set_span_in_context(span, _EMPTY_CONTEXT)
        return context

    @property
    def span_context(self) -> SpanContext | None:
        return None if self._rec is None else record.span_context(self)

    @property
    def span(self) -> trace.Span | None:
        """A read-only OTel view of the span (change it through this handle's methods)."""
        return None if self._rec is None else trace.NonRecordingSpan(record.span_context(self))

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
        if self._stats is not None:
            self._stats.add(self.name, (end_ns - self.start_time_ns) / 1e9, thread=NO_THREAD)
        self._finish(end_ns)

    def _finish(self, end_ns: int) -> None:
        self.end_time_ns = end_ns
        recorder = self._rec
        if recorder is not None and self.sampled:
            recorder.finish(self)


def _resolve_parent(parent: object) -> SpanHandle | SpanContext | None:
    """The parent a new span hangs under: a SpanHandle with a span, a foreign valid
    SpanContext, or None (a new trace). A handle without a span, like None, falls back
    to the current OTel context (as the SDK's start_span(context=None) does)."""
    if isinstance(parent, SpanHandle):
        if parent._rec is not None:
            return parent
        return record.foreign_parent(None)
    if isinstance(parent, Context):
        return record.foreign_parent(parent)
    raise TypeError(f"parent must be an OTel Context or a SpanHandle, got {type(parent).__name__}")


def start_span(
    name: str,
    attributes: Mapping[str, Any] | None = None,
    *,
    parent: Context | SpanHandle | None = None,
    start_time_ns: int | None = None,
    level: str = "step",
    stats: ProfileStats | None = None,
) -> SpanHandle:
    """Starts a span that is not tied to the current thread (e.g. the per-batch root).

    `parent=None` starts a new trace. End it with `handle.end()` from any thread.
    """
    rt = _runtime
    start_ns = _time_ns() if start_time_ns is None else start_time_ns
    handle = SpanHandle(name, start_ns, stats if stats is not None else rt.stats)
    recorder = rt.recorder
    if recorder is not None and _level_rank(level) <= rt.level_rank:
        handle._begin(recorder, None if parent is None else _resolve_parent(parent), attributes)
    return handle


class Phase(SpanHandle):
    """Context manager returned by `phase`; also usable as a decorator."""

    __slots__ = ("_level", "_parent", "_given_attributes", "_device", "_token", "_rt",
                 "_mode", "_start_event")  # fmt: skip

    def __init__(
        self,
        name: str,
        *,
        level: str = "phase",
        parent: Context | SpanHandle | None = None,
        start_time_ns: int | None = None,
        attributes: Mapping[str, Any] | None = None,
        device: object = None,
        stats: ProfileStats | None = None,
    ) -> None:
        """Times the block as phase `name` (see the package docstring for the arguments)."""
        # Only stores: at level off this object lives for two clock reads and one add.
        self.name = name
        self.start_time_ns = start_time_ns  # type: ignore[assignment]  # None until entered
        self._level = level
        self._parent = parent
        self._given_attributes = attributes
        self._device = device
        self._stats = stats
        self._rec = None

    def __enter__(self) -> Phase:
        rt = self._rt = _runtime
        if rt.plain:  # no span, no device timing: the level-off path, kept minimal
            self._mode = _PLAIN
            if self.start_time_ns is None:
                self.start_time_ns = _time_ns()
            return self
        self._mode = _SPAN
        self._rec = None
        if rt.clock is not None and self._device is not None:
            self._enter_device(rt)
        if self.start_time_ns is None:
            self.start_time_ns = _time_ns()
        recorder = rt.recorder
        if recorder is not None and _level_rank(self._level) <= rt.level_rank:
            self._start_span(recorder)
        return self

    def _enter_device(self, rt: Runtime) -> None:
        clock = rt.clock
        if clock.applies_to(self._device):  # type: ignore[union-attr]
            self._mode = _DEVICE
            if rt.sync:
                clock.synchronize(self._device)  # type: ignore[union-attr]
            else:
                self._start_event = clock.record(self._device)  # type: ignore[union-attr]

    def _start_span(self, recorder: Recorder) -> None:
        parent = self._parent
        if parent is None:
            parent = _current.get()
            if parent is None:
                parent = record.foreign_parent(None)
        else:
            parent = _resolve_parent(parent)
        attributes = self._given_attributes
        if self._device is not None:
            attributes = {**attributes} if attributes else {}
            attributes["device"] = str(self._device)
        self._begin(recorder, parent, attributes)
        self._ended = False
        self._token = _current.set(self)

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> bool:
        mode = self._mode
        if mode is _PLAIN:
            stats = self._stats
            if stats is None:
                stats = self._rt.stats
            stats.add(self.name, (_time_ns() - self.start_time_ns) / 1e9)
            return False
        if mode is _DEVICE:
            self._exit_device(exc)
            return False
        end_ns = _time_ns()
        stats = self._stats
        if stats is None:
            stats = self._rt.stats
        stats.add(self.name, (end_ns - self.start_time_ns) / 1e9)
        if self._rec is not None:
            _current.reset(self._token)
            if exc is not None:
                self._mark_error(exc)
            self._ended = True
            self._finish(end_ns)
        return False

    def _exit_device(self, exc: BaseException | None) -> None:
        rt = self._rt
        end_event = None
        if rt.sync:
            rt.clock.synchronize(self._device)  # type: ignore[union-attr]
        else:
            end_event = rt.clock.record(self._device)  # type: ignore[union-attr]
        end_ns = _time_ns()
        stats = self._stats if self._stats is not None else rt.stats
        stats.add(self.name, (end_ns - self.start_time_ns) / 1e9)
        if self._rec is not None:
            _current.reset(self._token)
            if exc is not None:
                self._mark_error(exc)
        if end_event is not None:
            self._submit_device_timing(end_event, end_ns, stats)
        elif self._rec is not None:
            self.set_attribute("timing.mode", "sync")
            self._ended = True
            self._finish(end_ns)

    def _submit_device_timing(self, end_event: object, end_ns: int, stats: ProfileStats) -> None:
        """Hands the event pair to the resolver, which ends the span at `end_ns` later."""
        name, thread = self.name, stats.thread_key()

        def on_resolved(device_s: float | None) -> None:
            if device_s is not None:
                stats.add(name + DEVICE_SUFFIX, device_s, thread=thread)
            if self._rec is not None:
                if device_s is not None:
                    self.set_attribute("device.duration_ms", device_s * 1e3)
                self.set_attribute("timing.mode", "events")
                self._ended = True
                self._finish(end_ns)

        self._rt.resolver.submit(self._start_event, end_event, on_resolved)  # type: ignore[union-attr]

    def end(self, end_time_ns: int | None = None) -> None:
        raise TypeError("a phase ends when its `with` block exits")

    def __call__(self, fn: F) -> F:
        """Decorator form: each call of `fn` runs inside a fresh phase with these arguments."""
        kwargs: dict[str, Any] = {
            "level": self._level,
            "parent": self._parent,
            "start_time_ns": self.start_time_ns,
            "attributes": self._given_attributes,
            "device": self._device,
            "stats": self._stats,
        }

        name = self.name

        @functools.wraps(fn)
        def wrapper(*a: Any, **kw: Any) -> Any:
            with Phase(name, **kwargs):
                return fn(*a, **kw)

        return wrapper  # type: ignore[return-value]


# `phase(...)` is the class itself: one Python call less on the hot path than a factory.
phase = Phase


def current_phase() -> SpanHandle | None:
    """The innermost open phase with a span on this thread/task, if any."""
    return _current.get()
