"""Phases, the hot path: `phase(...)` times a block, feeds ProfileStats and, at an
enabled level, records a span through the tracer `setup` chose (the application's, the
SDK's, or its fast stand-in, `tracing.fast`); with none, two clock reads and one `add`.

Attribute values are taken when set, on the calling thread (`clean_value`): nothing the
program goes on changing (a numpy buffer, a CUDA tensor) is read later elsewhere. The
innermost open phase of a thread/task is kept in a ContextVar of tracing's own: no OTel
context is attached on the hot path unless `propagate_context` asks. A phase object may
be entered again and from several threads at once, each entry its own measurement.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from enum import Enum
from threading import get_ident
from typing import Any, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import Link, SpanContext, Status, StatusCode

from tracing.clock import EPOCH_OFFSET_NS, now_ns
from tracing.config import warn_once
from tracing.device import DeviceClock, DeviceTiming, EventResolver
from tracing.fast import FastSpan
from tracing.format import DEVICE_SUFFIX
from tracing.stats import NO_THREAD, ProfileStats

logger = logging.getLogger("tracing")
LEVEL_RANK = {"off": 0, "step": 1, "phase": 2}
DEVICE_DURATION_ATTRIBUTE = "tracing.device.duration"  # seconds, under `events` timing
TIMING_MODE_ATTRIBUTE = "tracing.timing.mode"
TRACK_ATTRIBUTE = "tracing.track"  # "device" on a phase's device-time child span
DEVICE_SPAN_SUFFIX = ".device"
"""`<phase>.device`: the child span of a phase that holds its device time (`events`)."""
_PLAIN_TYPES = frozenset((str, bool, int, float))
_DROP = object()
_NEW_TRACE = Context()  # no span in it: a span started under it is a root
_time_ns = now_ns
# The plain path reads the clock inline (a Python call costs more than the read itself).
_mono_ns = time.monotonic_ns
_OFFSET_NS = EPOCH_OFFSET_NS
# Phase._mode: what `__exit__` has to undo (identity-compared small ints).
_PLAIN, _SPAN, _DEVICE = 0, 1, 2
F = TypeVar("F", bound=Callable[..., object])
# Any: an SDK Tracer, tracing.fast's FastTracer or telemetry's counting wrapper of the
# application's tracer (no common base), used by their shared start_span.
PhaseTracer = Any
# Any: clean_value's answer, an OTel attribute value (str, bool, int, float, a tuple of
# one) or the _DROP sentinel, set on a span as it is.
Cleaned = Any


def clean_value(key: str, value: object) -> Cleaned:
    """The OTel attribute value a program means by `value`: numpy scalars and arrays as
    Python values, an Enum as its value. `_DROP` (warned once per key) for a torch tensor
    (reading it is a host sync, `.item()`, the caller's to choose) and for what is not an
    attribute value by the specification: str, bool, int, float, a homogeneous list."""
    if type(value) in _PLAIN_TYPES:
        return value
    if isinstance(value, Enum):
        return clean_value(key, value.value)
    torch = sys.modules.get("torch")  # never imported here: a tensor implies it is loaded
    if torch is not None and isinstance(value, torch.Tensor):
        return _refuse(key, "a torch tensor (reading it waits for the device): set .item()")
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, (numpy.generic, numpy.ndarray)):
        value = value.tolist()  # np.float64(2.0) -> 2.0, np.array([1, 2]) -> [1, 2]
    if isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (list, tuple)):
        items = tuple(None if v is None else clean_value(key, v) for v in value)
        kinds = {type(v) for v in items if v is not None}
        if _DROP not in items and len(kinds) <= 1 and kinds <= _PLAIN_TYPES:
            return items
    return _refuse(key, f"{type(value).__name__} is not str, bool, int, float or a list of one")


def _refuse(key: str, why: str) -> Cleaned:
    warn_once(f"attribute {key}", f"attribute {key!r} dropped: {why} (warned once per key)")
    return _DROP


def clean_attributes(attributes: Mapping[str, object]) -> dict[str, Cleaned]:
    """A private copy of `attributes` holding only values OTel takes (`clean_value`)."""
    cleaned = {}
    for key, value in attributes.items():
        if type(value) not in _PLAIN_TYPES:
            value = clean_value(key, value)
            if value is _DROP:
                continue
        cleaned[key] = value
    return cleaned


@dataclass(slots=True)
class Runtime:
    """What `setup` installs for `phase` to read; replaced as a whole, never mutated.
    `stop_exceptions` end a phase without marking it ERROR (a requested stop); `hooks`
    are tracing.hooks.PhaseHook objects (timeline, NVTX)."""

    stats: ProfileStats
    tracer: PhaseTracer = None  # None when no span can be recorded: phases skip all span work
    level_rank: int = 0
    clock: DeviceClock | None = None
    sync: bool = False
    resolver: EventResolver | None = None
    propagate: bool = False
    stop_exceptions: tuple[type[BaseException], ...] = ()
    hooks: tuple[object, ...] = ()
    plain: bool = field(init=False)  # nothing but clock reads and one `add`

    def __post_init__(self) -> None:
        if self.level_rank <= 0:
            self.tracer = None
        self.plain = self.tracer is None and self.clock is None and not self.hooks


EXCEPTION_SINKS: list[Callable[[BaseException, Context | None], None]] = []
"""Told of each exception a span records, with the span's context (tracing.logs makes a
log record of it); empty unless logs are set up, so a phase's exit costs nothing more."""

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
        warn_once(f"level {level!r}", f"phase level must be one of off, step, phase, got {level!r}")
        return LEVEL_RANK["phase"]
    return rank


class SpanHandle:
    """A span that may end on another thread; `.context` is a parent for other threads.
    Without a span (tracing off, level filtered) it still measures its duration for
    ProfileStats. Thread contract: `set_attribute`/`record_exception` from one thread at
    a time; `end` from any thread, once (later calls do nothing)."""

    __slots__ = ("name", "start_time_ns", "_span", "_context", "_stats", "_hooks", "_ended")

    def __init__(self, name: str, start_time_ns: int, stats: ProfileStats | None = None) -> None:
        self.name, self.start_time_ns, self._stats = name, start_time_ns, stats
        self._span: trace.Span | None = None
        self._context: Context | None = None
        self._hooks: tuple[object, ...] = ()  # tracing.hooks.PhaseHook objects, set by start_span
        self._ended = False

    @property
    def span(self) -> trace.Span | None:
        """The OTel span (SDK, fast or non-recording), or None without one."""
        return self._span

    @property
    def context(self) -> Context | None:
        """An OTel Context holding this span (None without one)."""
        context = self._context
        if context is None and self._span is not None:
            context = self._context = trace.set_span_in_context(self._span, _NEW_TRACE)
        return context

    @property
    def recording(self) -> bool:
        return self._span is not None and self._span.is_recording()

    @property
    def attributes(self) -> Mapping[str, object]:
        """The attributes recorded so far (empty when the span is not recorded)."""
        span = self._span
        if isinstance(span, (FastSpan, ReadableSpan)) and span.attributes:
            return span.attributes
        return {}

    def set_attribute(self, key: str, value: object) -> None:
        span = self._span
        if span is not None and span.is_recording():
            cleaned = clean_value(key, value)
            if cleaned is not _DROP:
                span.set_attribute(key, cleaned)

    def record_exception(self, exc: BaseException) -> None:
        """Marks the span ERROR with an exception event; each of EXCEPTION_SINKS is told."""
        span = self._span
        if EXCEPTION_SINKS and span is not None:
            for sink in list(EXCEPTION_SINKS):
                try:
                    sink(exc, self.context)
                except Exception:  # a sink must break neither tracing nor the program
                    logger.exception("tracing: exception sink %r raised", sink)
        if span is not None and span.is_recording():
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))

    def end(self, end_time_ns: int | None = None) -> None:
        """Ends the span; its duration goes to ProfileStats as a cross-thread entry."""
        if self._ended:
            return
        self._ended = True
        end_ns = _time_ns() if end_time_ns is None else end_time_ns
        _call_hooks(self._hooks, "span_ended", self, end_ns)
        if self._stats is not None:
            self._stats.add(self.name, (end_ns - self.start_time_ns) / 1e9, thread=NO_THREAD)
        if self._span is not None:
            self._span.end(end_time=end_ns)


def to_links(targets: Iterable[object]) -> list[Link]:
    """OTel Links to `targets`: a Link (its attributes cleaned as a span's are), or a
    SpanContext, a SpanHandle or a Context (the span in it), linked without attributes.
    A handle or Context without a span (tracing off, the level filtered it) is left out;
    so is anything else, warned about once."""
    links = []
    for target in targets:
        if isinstance(target, Link):
            given = target.attributes
            links.append(Link(target.context, clean_attributes(given) if given else None))
            continue
        context: SpanContext | None = None
        if isinstance(target, SpanHandle):
            span = target._span
            context = None if span is None else span.get_span_context()
        elif isinstance(target, SpanContext):
            context = target
        elif isinstance(target, Context):
            context = trace.get_current_span(target).get_span_context()
        else:
            kind = type(target).__name__
            warn_once("link", f"a link is a Link, SpanContext, SpanHandle or Context, not {kind}")
        if context is not None and context.is_valid:
            links.append(Link(context))
    return links


def _parent_context(parent: object) -> Context | None:
    """The Context under an explicit `parent` (None: the current one, as the SDK's)."""
    if isinstance(parent, SpanHandle):
        return parent.context
    if isinstance(parent, Context):
        return parent
    warn_once("parent", f"parent must be a Context or a SpanHandle, got {type(parent).__name__}")
    return None


@dataclass
class HookErrors:
    """Exceptions raised by phase hooks, counted; the first of each hook method is logged."""

    count: int = 0
    _logged: set[tuple[str, str]] = field(default_factory=set)

    def record(self, hook: object, method: str, exc: BaseException) -> None:
        key = (type(hook).__qualname__, method)
        self.count += 1  # under the GIL; a lost increment of a misbehaving hook is harmless
        if key not in self._logged:
            self._logged.add(key)
            logger.error("tracing: hook %s.%s raised (further ones are counted): %r", *key, exc)


HOOK_ERRORS = HookErrors()


def _call_hooks(hooks: tuple[object, ...], method: str, *args: object) -> None:
    """`method(*args)` of every hook; one that raises is counted and skipped."""
    for hook in hooks:
        try:
            getattr(hook, method)(*args)
        except Exception as exc:  # a hook must break neither tracing nor the program
            HOOK_ERRORS.record(hook, method, exc)


def start_span(
    name: str,
    attributes: Mapping[str, object] | None = None,
    *,
    parent: Context | SpanHandle | None = None,
    start_time_ns: int | None = None,
    level: str = "step",
    stats: ProfileStats | None = None,
    links: Sequence[object] | None = None,
) -> SpanHandle:
    """A span not tied to this thread (the per-batch root); `parent=None`: a new trace.
    `links`: spans it is causally tied to outside its parent (`to_links`: Links,
    SpanContexts, SpanHandles, Contexts), given to the sampler and recorded."""
    rt = _runtime
    start_ns = _time_ns() if start_time_ns is None else start_time_ns
    handle = SpanHandle(name, start_ns, stats if stats is not None else rt.stats)
    tracer = rt.tracer
    if tracer is not None and _level_rank(level) <= rt.level_rank:
        try:
            context = _NEW_TRACE if parent is None else _parent_context(parent)
            values = clean_attributes(attributes) if attributes else None
            kept = to_links(links) if links else None
            handle._span = tracer.start_span(
                name, context, attributes=values, links=kept, start_time=start_ns
            )
        except Exception:  # telemetry never raises into the host program
            logger.exception("tracing: span %s could not start", name)
    if rt.hooks:
        handle._hooks = rt.hooks
        _call_hooks(rt.hooks, "span_started", handle)
    return handle


class Phase(SpanHandle):
    """`with phase(name, level=, parent=, start_time_ns=, attributes=, device=) as p:`,
    also a decorator. `level`: off < step < phase, a span only at the configured one or
    below. `parent`: a Context or SpanHandle; None: this thread's innermost phase, else
    the current OTel context. `start_time_ns` (now_ns()): a wait opened after it ended
    (the stats get all of it; the span starts no earlier than its parent). `links`: spans
    of other traces it is causally tied to (`to_links`), taken when the span starts. An exception
    marks the span ERROR, then propagates. `device` (e.g. "cuda:0"): `sync` timing
    synchronizes it at both ends; `events` resolves device events off the hot path."""

    __slots__ = (
        *("_level", "_parent", "_given_attributes", "_device", "_token", "_rt", "_mode"),
        *("_start_event", "_given_start_ns", "_propagate", "_otel_token", "_entries"),
        "_links",
    )

    def __init__(
        self,
        name: str,
        *,
        level: str = "phase",
        parent: Context | SpanHandle | None = None,
        start_time_ns: int | None = None,
        attributes: Mapping[str, object] | None = None,
        device: object = None,
        stats: ProfileStats | None = None,
        propagate: bool | None = None,
        links: Sequence[object] | None = None,
    ) -> None:
        # Only stores: at level off this object lives for two clock reads and one add.
        self.name, self._level, self._parent, self._device = name, level, parent, device
        self._given_start_ns, self._given_attributes = start_time_ns, attributes
        self._stats, self._propagate, self._links = stats, propagate, links
        self._span = None
        self._context = None
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
            if rt.tracer is not None and _level_rank(self._level) <= rt.level_rank:
                self._start_span(rt)
            if rt.hooks:
                _call_hooks(rt.hooks, "phase_started", self)
        except Exception:  # telemetry never raises into the host program
            logger.exception("tracing: phase %s could not start its span", self.name)
            self._span = None
        return self

    def _enter_copy(self) -> Phase:
        entry = Phase(self.name, **self._arguments())
        entries = self._entries
        if not isinstance(entries, dict):
            entries = self._entries = {}
        entries.setdefault(get_ident(), []).append(entry)
        return entry.__enter__()

    def _arguments(self) -> dict[str, Any]:  # Phase's keywords, of their several types
        return {
            "level": self._level,
            "parent": self._parent,
            "start_time_ns": self._given_start_ns,
            "attributes": self._given_attributes,
            "device": self._device,
            "stats": self._stats,
            "propagate": self._propagate,
            "links": self._links,
        }

    def _enter_device(self, rt: Runtime) -> None:
        clock = rt.clock
        # (mypy ignore below) a device phase runs only where setup installed a clock
        if clock.applies_to(self._device):  # type: ignore[union-attr]
            self._mode = _DEVICE
            if rt.sync:
                # (mypy ignore below) a device phase runs only where setup installed a clock
                clock.synchronize(self._device)  # type: ignore[union-attr]
            else:
                # (mypy ignore below) a device phase runs only where setup installed a clock
                self._start_event = clock.record(self._device)  # type: ignore[union-attr]

    def _start_span(self, rt: Runtime) -> None:
        propagate = rt.propagate if self._propagate is None else self._propagate
        parent, start_ns = self._parent, self.start_time_ns
        if parent is None:
            parent = _current.get()
            if parent is None or (propagate and trace.get_current_span().is_recording()):
                parent = None  # the current OTel span: another tracer's inside this phase
        if isinstance(parent, SpanHandle) and parent._span is not None:
            # A wait begun before its parent existed starts with it in the span (a child
            # outside its parent confuses trace views); the stats keep all of it.
            start_ns = max(start_ns, parent.start_time_ns)
        context = None if parent is None else _parent_context(parent)
        attributes = self._given_attributes
        values = clean_attributes(attributes) if attributes else None
        if self._links:  # a branch, not a `links=None` argument on every phase's call
            links = to_links(self._links)
            self._span = rt.tracer.start_span(
                self.name, context, attributes=values, links=links, start_time=start_ns
            )
        else:
            self._span = rt.tracer.start_span(
                self.name, context, attributes=values, start_time=start_ns
            )
        self._token = _current.set(self)
        held = self.context if propagate else None  # never None: the span just started
        self._otel_token = otel_context.attach(held) if held is not None else None

    def _leave(self) -> None:
        """Undoes `_start_span`'s context changes; never raises."""
        try:
            if self._otel_token is not None:
                otel_context.detach(self._otel_token)
            _current.reset(self._token)
        except ValueError:  # exited in another context than it was entered in
            warn_once("context", f"phase {self.name} exited in another context")

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> bool:
        entries = self._entries
        if entries:  # copies exist: this thread's innermost one, if any, is exiting
            # (mypy ignore below) truthy entries are the dict (False/None are falsy)
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
            rt = self._rt
            if rt.hooks:
                _call_hooks(rt.hooks, "phase_ended", self, exc)
            end_event = None
            if mode is _DEVICE:
                if rt.sync:
                    # (mypy ignore below) a device phase runs only where setup installed a clock
                    rt.clock.synchronize(self._device)  # type: ignore[union-attr]
                else:
                    # (mypy ignore below) a device phase runs only where setup installed a clock
                    end_event = rt.clock.record(self._device)  # type: ignore[union-attr]
            end_ns = _time_ns()
            stats = self._stats if self._stats is not None else rt.stats
            stats.add(self.name, (end_ns - self.start_time_ns) / 1e9)
            span = self._span
            if span is not None:
                self._leave()
                if exc is not None and not isinstance(exc, rt.stop_exceptions):
                    self.record_exception(exc)
            if end_event is not None:
                self._submit_device_timing(end_event, end_ns, stats)
            elif span is not None:
                if mode is _DEVICE:
                    span.set_attribute(TIMING_MODE_ATTRIBUTE, "sync")
                self._ended = True
                span.end(end_time=end_ns)
        except Exception:  # telemetry never raises into the host program
            logger.exception("tracing: phase %s could not end its span", self.name)
        return False

    def _submit_device_timing(self, end_event: object, end_ns: int, stats: ProfileStats) -> None:
        """Hands the event pair to the resolver, which later ends the span at `end_ns`,
        with a child span where the device ran it (`_device_span`)."""
        name, thread, span, tracer = self.name, stats.thread_key(), self._span, self._rt.tracer

        def on_resolved(timing: DeviceTiming | None) -> None:
            if timing is not None:
                stats.add(name + DEVICE_SUFFIX, timing.seconds, thread=thread)
            if span is not None:
                if timing is not None:
                    span.set_attribute(DEVICE_DURATION_ATTRIBUTE, timing.seconds)
                    if timing.start_ns is not None and span.is_recording():
                        _device_span(tracer, name, self.context, timing)
                span.set_attribute(TIMING_MODE_ATTRIBUTE, "events")
                self._ended = True
                span.end(end_time=end_ns)

        # (mypy ignore below) events mode, the only caller, starts the resolver
        self._rt.resolver.submit(  # type: ignore[union-attr]
            self._start_event, end_event, on_resolved, self._device, self.start_time_ns
        )

    def end(self, end_time_ns: int | None = None) -> None:
        warn_once("phase.end", "a phase ends when its `with` block exits; end() ignored")

    def __call__(self, fn: F) -> F:
        """Decorator form: each call of `fn` runs inside a fresh phase with these arguments."""
        name, kwargs = self.name, self._arguments()

        @functools.wraps(fn)
        def wrapper(*a: Any, **kw: Any) -> Any:  # fn's own arguments and result, as F types them
            with Phase(name, **kwargs):
                return fn(*a, **kw)

        return wrapper  # type: ignore[return-value]  # functools.wraps: the wrapper answers as fn


def _device_span(
    tracer: PhaseTracer, name: str, parent: Context | None, timing: DeviceTiming
) -> None:
    """`<name>.device`, a child of the phase's span, from its first to its last device
    event on the host clock: the device runs a phase's kernels after the host queued
    them, so this span may start and end after its parent, as the device did."""
    child = tracer.start_span(
        name + DEVICE_SPAN_SUFFIX,
        parent,
        attributes={TRACK_ATTRIBUTE: "device", TIMING_MODE_ATTRIBUTE: "events"},
        start_time=timing.start_ns,
    )
    child.end(end_time=timing.end_ns)


# `phase(...)` is the class itself: one Python call less on the hot path than a factory.
phase = Phase


def current_phase() -> SpanHandle | None:
    """The innermost open phase with a span on this thread/task, if any."""
    return _current.get()
