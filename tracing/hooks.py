"""Phase hooks: code that sees every phase start and end, sampled or not.

`setup(..., phase_hooks=[...])` installs them. A hook costs the hot path one method
call per event, and only while installed: with none, phases keep their minimal path.
`NvtxRanges` (below) and `tracing.timeline.Timeline` are the two hooks of this package.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tracing.spans import Phase, SpanHandle

logger = logging.getLogger("tracing")


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


class NvtxRanges:
    """Pushes an NVTX range named after each phase, so Nsight Systems shows phase
    names over the kernels they launched. Cross-thread spans (`start_span`) get none:
    an NVTX push/pop pair must stay on one thread.

    Build it with `nvtx_ranges()`, which returns None (after one log line) where CUDA is
    not available.
    """

    def __init__(self, push: object, pop: object) -> None:
        self._push = push
        self._pop = pop

    def phase_started(self, phase: Phase) -> None:
        self._push(phase.name)  # type: ignore[operator]

    def phase_ended(self, phase: Phase, exc: BaseException | None) -> None:
        self._pop()  # type: ignore[operator]

    def span_started(self, handle: SpanHandle) -> None:
        pass

    def span_ended(self, handle: SpanHandle, end_time_ns: int) -> None:
        pass


def nvtx_ranges(log: logging.Logger | None = None) -> NvtxRanges | None:
    """An NvtxRanges hook on CUDA machines; elsewhere None and one line saying so."""
    log = log or logger
    try:
        import torch
    except ImportError:
        log.warning("tracing: NVTX ranges off: torch is not installed")
        return None
    if not torch.cuda.is_available():
        log.warning("tracing: NVTX ranges off: CUDA is not available on this machine")
        return None
    return NvtxRanges(torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop)
