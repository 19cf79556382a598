"""Phase hooks: code that sees every phase start and end, sampled or not.

`setup(..., phase_hooks=[...])` installs them. A hook costs the hot path one method
call per event, and only while installed: with none, phases keep their minimal path.
A Perfetto timeline and NVTX ranges around each phase are two such hooks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tracing.spans import Phase, SpanHandle


class PhaseHook(Protocol):
    """Thread contract: `phase_started`/`phase_ended` run on the phase's own thread,
    inside the `with` block's enter and exit; `span_started` on the thread calling
    `start_span`, `span_ended` on the thread ending the handle. None of them may block:
    they run on the training path. One that raises is logged once per method and
    counted (`ShutdownReport.hook_errors`); the phase still counts and its span ends."""

    def phase_started(self, phase: Phase) -> None: ...
    def phase_ended(self, phase: Phase, exc: BaseException | None) -> None: ...
    def span_started(self, handle: SpanHandle) -> None: ...
    def span_ended(self, handle: SpanHandle, end_time_ns: int) -> None: ...
