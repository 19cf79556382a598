"""The clock of every phase: monotonic, anchored once to the epoch.

Durations from the wall clock (`time.time_ns`) go negative or huge when NTP steps the
clock; a monotonic clock never steps. Spans need epoch timestamps, so the monotonic
reading is shifted by one offset taken at import: timestamps stay comparable with
other processes' to within the clocks' drift since then, durations are always exact.
"""

from __future__ import annotations

import time

_monotonic_ns = time.monotonic_ns
EPOCH_OFFSET_NS = time.time_ns() - time.monotonic_ns()


def now_ns() -> int:
    """Nanoseconds since the epoch on the monotonic clock (use for `start_time_ns`)."""
    return _monotonic_ns() + EPOCH_OFFSET_NS
