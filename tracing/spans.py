"""Phase spans: the hot path. `phase(...)` times a block, feeds ProfileStats, and (at an
enabled level, with a configured provider) records an OTel span.

Cost notes: a recorded span is the handle itself (`tracing.handle`): ids from a private
generator, two clock reads, the name, parent, attributes and status, appended to the
export queue when it ends; the export thread builds the SDK span from it. By default no
OTel context is attached or detached and no SDK object is built on the hot path: the
innermost open phase of the current thread/task is kept in one ContextVar of our own,
and an OTel Context is built only when someone asks for `.context`. With
`propagate_context` a phase is also the current OTel span while it runs (one attach and
one detach more). With no span to record, a phase is two clock reads and one `add`.

A phase object may be entered again, and from several threads at once: the first
entry uses the object itself, every other entry a fresh copy with the same arguments,
so each entry is its own measurement. Telemetry never raises into the host program:
misuse is logged once.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from threading import get_ident
from typing import Any, TypeVar

from opentelemetry import context as otel_context
from opentelemetry.context import Context

from tracing import record
from tracing.clock import EPOCH_OFFSET_NS, now_ns
from tracing.device import DeviceClock, EventResolver
from tracing.format import DEVICE_SUFFIX
from tracing.handle import SpanHandle, resolve_parent
from tracing.record import Recorder
from tracing.stats import ProfileStats

logger = logging.getLogger("tracing")
LEVEL_RANK = {"off": 0, "step": 1, "phase": 2}
DEVICE_ATTRIBUTE = "tracing.device"
DEVICE_DURATION_ATTRIBUTE = "tracing.device.duration_s"
TIMING_MODE_ATTRIBUTE = "tracing.timing.mode"
_time_ns = now_ns
# The plain path reads the clock inline (a Python call costs more than the read itself).
_mono_ns = time.monotonic_ns
_OFFSET_NS = EPOCH_OFFSET_NS
# Phase._mode: what `__exit__` has to undo (identity-compared small ints).
_PLAIN, _SPAN, _DEVICE = 0, 1, 2
F = TypeVar("F", bound=Callable[..., Any])


class Runtime:
    """What `setup` installs for `phase` to read; replaced as a whole, never mutated."""

    __slots__ = ("recorder", "level_rank", "stats", "clock", "sync", "resolver", "plain",
                 "propagate", "stop_exceptions", "hooks")  # fmt: skip

    def __init__(
        self,
        stats: ProfileStats,
        recorder: Recorder | None = None,
        level_rank: int = 0,
        clock: DeviceClock | None = None,
        sync: bool = False,
        resolver: EventResolver | None = None,
        propagate: bool = False,
        stop_exceptions: tuple[type[BaseException], ...] = (),
        hooks: tuple[Any, ...] = (),
    ) -> None:
        self.stats = stats
        self.hooks = hooks  # tracing.hooks.PhaseHook objects (timeline, NVTX)
        # None when no span can be recorded at any level: phases then skip all span work.
        self.recorder = recorder if level_rank > 0 else None
        self.level_rank = level_rank
        self.clock = clock
        self.sync = sync
        self.resolver = resolver
        self.propagate = propagate
        # Exceptions that end a phase without marking it ERROR: a requested stop.
        self.stop_exceptions = stop_exceptions
        # Phases can take the minimal path: nothing but clock reads and one `add`.
        self.plain = self.recorder is None and clock is None and not hooks


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
        record.warn_once(
            f"level {level!r}", f"phase level must be one of off, step, phase, got {level!r}"
        )
        return LEVEL_RANK["phase"]
    return rank


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
        handle._begin(recorder, None if parent is None else resolve_parent(parent), attributes)
    if rt.hooks:
        handle._hooks = rt.hooks
        record.call_hooks(rt.hooks, "span_started", handle)
    return handle


class Phase(SpanHandle):
    """Context manager returned by `phase`; also usable as a decorator."""

    __slots__ = ("_level", "_parent", "_given_attributes", "_device", "_token", "_rt",
                 "_mode", "_start_event", "_given_start_ns", "_propagate", "_otel_token",
                 "_entries")  # fmt: skip

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
        propagate: bool | None = None,
    ) -> None:
        """Times the block as phase `name` (see the package docstring for the arguments)."""
        # Only stores: at level off this object lives for two clock reads and one add.
        self.name = name
        self._given_start_ns = start_time_ns
        self._level = level
        self._parent = parent
        self._given_attributes = attributes
        self._device = device
        self._stats = stats
        self._propagate = propagate
        self._rec = None
        self._hooks = ()  # phases call their hooks from the runtime, not from end()
        # None: never entered; False: entered once (as itself); a dict: thread -> copies.
        self._entries: dict[int, list[Phase]] | bool | None = None

    def __enter__(self) -> Phase:
        if self._entries is not None:  # re-entered, or shared: a copy measures this entry
            return self._enter_copy()
        self._entries = False  # no call in between: no thread switch splits test and set
        rt = self._rt = _runtime
        start_ns = self._given_start_ns
        if rt.plain:  # no span, no device timing: the level-off path, kept minimal
            self._mode = _PLAIN
            self.start_time_ns = _mono_ns() + _OFFSET_NS if start_ns is None else start_ns
            return self
        self._mode = _SPAN
        try:
            if rt.clock is not None and self._device is not None:
                self._enter_device(rt)
            self.start_time_ns = _time_ns() if start_ns is None else start_ns
            recorder = rt.recorder
            if recorder is not None and _level_rank(self._level) <= rt.level_rank:
                self._start_span(recorder, rt)
            if rt.hooks:
                record.call_hooks(rt.hooks, "phase_started", self)
        except Exception:  # telemetry never raises into the host program
            logger.exception("tracing: phase %s could not start its span", self.name)
            self._rec = None
            self._mode = _SPAN
            self.start_time_ns = _time_ns() if start_ns is None else start_ns
        return self

    def _enter_copy(self) -> Phase:
        entry = Phase(
            self.name,
            level=self._level,
            parent=self._parent,
            start_time_ns=self._given_start_ns,
            attributes=self._given_attributes,
            device=self._device,
            stats=self._stats,
            propagate=self._propagate,
        )
        entries = self._entries
        if not isinstance(entries, dict):
            entries = self._entries = {}
        entries.setdefault(get_ident(), []).append(entry)
        return entry.__enter__()

    def _enter_device(self, rt: Runtime) -> None:
        clock = rt.clock
        if clock.applies_to(self._device):  # type: ignore[union-attr]
            self._mode = _DEVICE
            if rt.sync:
                clock.synchronize(self._device)  # type: ignore[union-attr]
            else:
                self._start_event = clock.record(self._device)  # type: ignore[union-attr]

    def _start_span(self, recorder: Recorder, rt: Runtime) -> None:
        propagate = rt.propagate if self._propagate is None else self._propagate
        parent = self._parent
        if parent is None:
            parent = _current.get()
            if propagate:
                # Another tracer's span may be current inside this thread's phase.
                foreign = record.foreign_parent(None)
                if foreign is not None and (parent is None or foreign.span_id != parent.span_id):
                    parent = foreign
            elif parent is None:
                parent = record.foreign_parent(None)
        else:
            parent = resolve_parent(parent)
        attributes = self._given_attributes
        if self._device is not None:
            attributes = {**attributes} if attributes else {}
            attributes[DEVICE_ATTRIBUTE] = str(self._device)
        self._begin(recorder, parent, attributes)
        self._ended = False
        self._token = _current.set(self)
        self._otel_token = otel_context.attach(self.context) if propagate else None

    def _leave(self) -> None:
        """Undoes `_start_span`'s context changes; never raises."""
        try:
            if self._otel_token is not None:
                otel_context.detach(self._otel_token)
            _current.reset(self._token)
        except ValueError:  # exited in another context than it was entered in
            record.warn_once("context", f"phase {self.name} exited in another context")

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> bool:
        entries = self._entries
        if entries:  # copies exist: this thread's innermost one, if any, is exiting
            stack = entries.get(get_ident())  # type: ignore[union-attr]
            if stack:
                return stack.pop().__exit__(exc_type, exc, tb)
        mode = self._mode
        if mode is _PLAIN:
            stats = self._stats
            if stats is None:
                stats = self._rt.stats
            stats.add(self.name, (_mono_ns() + _OFFSET_NS - self.start_time_ns) / 1e9)
            return False
        try:
            if self._rt.hooks:
                record.call_hooks(self._rt.hooks, "phase_ended", self, exc)
            if mode is _DEVICE:
                self._exit_device(exc)
                return False
            end_ns = _time_ns()
            stats = self._stats
            if stats is None:
                stats = self._rt.stats
            stats.add(self.name, (end_ns - self.start_time_ns) / 1e9)
            if self._rec is not None:
                self._leave()
                if exc is not None and not isinstance(exc, self._rt.stop_exceptions):
                    self._mark_error(exc)
                self._ended = True
                self._finish(end_ns)
        except Exception:  # telemetry never raises into the host program
            logger.exception("tracing: phase %s could not end its span", self.name)
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
            self._leave()
            if exc is not None and not isinstance(exc, rt.stop_exceptions):
                self._mark_error(exc)
        if end_event is not None:
            self._submit_device_timing(end_event, end_ns, stats)
        elif self._rec is not None:
            self.set_attribute(TIMING_MODE_ATTRIBUTE, "sync")
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
                    self.set_attribute(DEVICE_DURATION_ATTRIBUTE, device_s)
                self.set_attribute(TIMING_MODE_ATTRIBUTE, "events")
                self._ended = True
                self._finish(end_ns)

        self._rt.resolver.submit(  # type: ignore[union-attr]
            self._start_event, end_event, on_resolved, self._device
        )

    def end(self, end_time_ns: int | None = None) -> None:
        record.warn_once("phase.end", "a phase ends when its `with` block exits; end() ignored")

    def __call__(self, fn: F) -> F:
        """Decorator form: each call of `fn` runs inside a fresh phase with these arguments."""
        kwargs: dict[str, Any] = {
            "level": self._level,
            "parent": self._parent,
            "start_time_ns": self._given_start_ns,
            "attributes": self._given_attributes,
            "device": self._device,
            "stats": self._stats,
            "propagate": self._propagate,
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
