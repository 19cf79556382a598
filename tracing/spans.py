"""Phase spans: the hot path. `phase(...)` times a block, feeds ProfileStats, and (at an
enabled level, with a configured provider) records an OTel span.

Cost notes: spans are started with an explicit parent Context and explicit start/end
times (no attach/detach of the OTel context, no extra clock reads); the innermost open
phase of the current thread/task is kept in one ContextVar of our own, and its OTel
Context is built only when a child asks for it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from threading import get_ident
from typing import Any, TypeVar

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Status, StatusCode

from tracing.config import TracingConfigError
from tracing.device import DeviceClock, EventResolver
from tracing.format import DEVICE_SUFFIX
from tracing.stats import NO_THREAD, ProfileStats

LEVEL_RANK = {"off": 0, "step": 1, "phase": 2}
_EMPTY_CONTEXT = Context()
_time_ns = time.time_ns
F = TypeVar("F", bound=Callable[..., Any])


class Runtime:
    """What `setup` installs for `phase` to read; replaced as a whole, never mutated."""

    __slots__ = ("tracer", "level_rank", "stats", "clock", "sync", "resolver")

    def __init__(
        self,
        stats: ProfileStats,
        tracer: trace.Tracer | None = None,
        level_rank: int = 0,
        clock: DeviceClock | None = None,
        sync: bool = False,
        resolver: EventResolver | None = None,
    ) -> None:
        self.stats = stats
        self.tracer = tracer
        self.level_rank = level_rank
        self.clock = clock
        self.sync = sync
        self.resolver = resolver


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


def _parent_context(parent: object) -> Context | None:
    if parent is None:
        current = _current.get()
        return None if current is None else current.context
    if isinstance(parent, SpanHandle):
        return parent.context
    if isinstance(parent, Context):
        return parent
    raise TypeError(f"parent must be an OTel Context or a SpanHandle, got {type(parent).__name__}")


def _mark_error(span: trace.Span, exc: BaseException) -> None:
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))


class SpanHandle:
    """A span that may be ended on another thread; `.context` is a parent for other threads.

    With tracing off the handle still measures its duration for ProfileStats.
    """

    __slots__ = ("span", "name", "start_time_ns", "_context", "_ended", "_stats")

    def __init__(
        self,
        span: trace.Span | None,
        name: str,
        start_time_ns: int,
        stats: ProfileStats | None = None,
    ) -> None:
        self.span = span
        self.name = name
        self.start_time_ns = start_time_ns
        self._context: Context | None = None
        self._ended = False
        self._stats = stats

    @property
    def context(self) -> Context | None:
        """OTel Context holding this span (None without a span: children then use the
        current phase or start their own trace)."""
        span = self.span
        if span is None:
            return None
        if self._context is None:
            self._context = trace.set_span_in_context(span, _EMPTY_CONTEXT)
        return self._context

    @property
    def recording(self) -> bool:
        return self.span is not None and self.span.is_recording()

    def set_attribute(self, key: str, value: Any) -> None:
        if self.span is not None:
            self.span.set_attribute(key, value)

    def record_exception(self, exc: BaseException) -> None:
        """Marks the span ERROR with an exception event."""
        if self.span is not None:
            _mark_error(self.span, exc)

    def end(self, end_time_ns: int | None = None) -> None:
        """Ends the span (from any thread; a second call does nothing) and records its
        duration in ProfileStats as a cross-thread entry (no share column)."""
        if self._ended:
            return
        self._ended = True
        end_ns = _time_ns() if end_time_ns is None else end_time_ns
        if self._stats is not None:
            self._stats.add(self.name, (end_ns - self.start_time_ns) / 1e9, thread=NO_THREAD)
        if self.span is not None:
            self.span.end(end_time=end_ns)


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
    span = None
    if rt.tracer is not None and _level_rank(level) <= rt.level_rank:
        context = _EMPTY_CONTEXT if parent is None else _parent_context(parent)
        span = rt.tracer.start_span(
            name, context=context, attributes=attributes, start_time=start_ns
        )
    return SpanHandle(span, name, start_ns, stats if stats is not None else rt.stats)


class Phase(SpanHandle):
    """Context manager returned by `phase`; also usable as a decorator."""

    __slots__ = ("_level", "_parent", "_attributes", "_device", "_token", "_rt", "_timed",
                 "_start_event")  # fmt: skip

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
        # Only what the level-off path needs is set here; the rest when a span starts.
        self.name = name
        self.span = None
        self.start_time_ns = start_time_ns  # type: ignore[assignment]  # None until entered
        self._level = level
        self._parent = parent
        self._attributes = attributes
        self._device = device
        self._stats = stats

    def __enter__(self) -> Phase:
        rt = self._rt = _runtime
        if rt.clock is not None and self._device is not None:
            self._enter_device(rt)
        else:
            self._timed = False
        if self.start_time_ns is None:
            self.start_time_ns = _time_ns()
        if rt.tracer is not None and _level_rank(self._level) <= rt.level_rank:
            self._start_span(rt.tracer)
        return self

    def _enter_device(self, rt: Runtime) -> None:
        clock = rt.clock
        self._timed = clock.applies_to(self._device)  # type: ignore[union-attr]
        if self._timed:
            if rt.sync:
                clock.synchronize(self._device)  # type: ignore[union-attr]
            else:
                self._start_event = clock.record(self._device)  # type: ignore[union-attr]

    def _start_span(self, tracer: trace.Tracer) -> None:
        attributes = self._attributes
        if self._device is not None:
            attributes = {**attributes} if attributes else {}
            attributes["device"] = str(self._device)
        self.span = tracer.start_span(
            self.name,
            context=_parent_context(self._parent),
            attributes=attributes,
            start_time=self.start_time_ns,
        )
        self._context = None
        self._token = _current.set(self)

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> bool:
        if self._timed:
            self._exit_device(exc)
            return False
        end_ns = _time_ns()
        stats = self._stats if self._stats is not None else self._rt.stats
        stats.add(self.name, (end_ns - self.start_time_ns) / 1e9)
        span = self.span
        if span is not None:
            _current.reset(self._token)
            if exc is not None:
                _mark_error(span, exc)
            span.end(end_time=end_ns)
        return False

    def _exit_device(self, exc: BaseException | None) -> None:
        rt = self._rt
        end_event = None
        if rt.sync:
            rt.clock.synchronize(self._device)  # type: ignore[union-attr]
        else:
            end_event = rt.clock.record(self._device)  # type: ignore[union-attr]
        end_ns = _time_ns()
        if self._stats is None:
            self._stats = rt.stats
        self._stats.add(self.name, (end_ns - self.start_time_ns) / 1e9)
        span = self.span
        if span is not None:
            _current.reset(self._token)
            if exc is not None:
                _mark_error(span, exc)
        if end_event is not None:
            self._submit_device_timing(end_event, end_ns)
        elif span is not None:
            span.set_attribute("timing.mode", "sync")
            span.end(end_time=end_ns)

    def _submit_device_timing(self, end_event: object, end_ns: int) -> None:
        """Hands the event pair to the resolver, which ends the span at `end_ns` later."""
        span, stats, name, thread = self.span, self._stats, self.name, get_ident()

        def on_resolved(device_s: float | None) -> None:
            if device_s is not None:
                stats.add(name + DEVICE_SUFFIX, device_s, thread=thread)
            if span is not None:
                if device_s is not None:
                    span.set_attribute("device.duration_ms", device_s * 1e3)
                span.set_attribute("timing.mode", "events")
                span.end(end_time=end_ns)

        self._rt.resolver.submit(self._start_event, end_event, on_resolved)  # type: ignore[union-attr]

    def end(self, end_time_ns: int | None = None) -> None:
        raise TypeError("a phase ends when its `with` block exits")

    def __call__(self, fn: F) -> F:
        """Decorator form: each call of `fn` runs inside a fresh phase with these arguments."""
        kwargs: dict[str, Any] = {
            "level": self._level,
            "parent": self._parent,
            "start_time_ns": self.start_time_ns,
            "attributes": self._attributes,
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
