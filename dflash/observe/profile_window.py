"""ProfileWindow: torch.profiler over a few chosen steps, its file named on their spans.

Training tooling on torch, not telemetry plumbing: it lives with the run's other
instruments (tracing imports torch only for device timing).

    window = ProfileWindow("200:205", "runs/x/profile", rank=0)   # steps 200..204
    for step in ...:
        window.before_step(step)             # starts the profiler at 200, stops at 205
        with phase("drafter.step") as p:
            if (path := window.path_for(step)) is not None:
                p.set_attribute("profile.file", path)
    window.close()                           # stops a window cut short by the run's end

The range is a half-open slice of step numbers, `START:STOP`; `START` alone is one step.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from dflash.config.checks import parse_steps

if TYPE_CHECKING:
    from torch.profiler import profile

logger = logging.getLogger("tracing")


class ProfileWindow:
    """Records torch.profiler for steps [start, stop) into one Chrome trace in `out_dir`.

    Thread contract: `before_step`/`close` on the training thread that runs the steps
    (torch.profiler is started and stopped there); `path_for` from any thread.
    """

    def __init__(self, steps: str, out_dir: str | os.PathLike[str], *, rank: int = 0) -> None:
        self.start, self.stop = parse_steps(steps)
        self.out_dir = Path(out_dir)
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(
                f"profile directory {str(self.out_dir)!r} cannot be created: {exc.strerror}"
            ) from None
        if not os.access(self.out_dir, os.W_OK):
            raise ValueError(f"profile directory {str(self.out_dir)!r} is not writable")
        name = f"steps-{self.start}-{self.stop - 1}.rank{rank}.pt.trace.json"
        self.path = self.out_dir / name
        self._profiler: profile | None = None
        self.done = False

    def path_for(self, step: int) -> str | None:
        """The trace file of `step` if the window covers it (for a span attribute)."""
        return str(self.path) if self.start <= step < self.stop else None

    def before_step(self, step: int) -> None:
        """Call before each step: starts at the first step of the window, stops after the last."""
        if self._profiler is None and not self.done and self.start <= step < self.stop:
            self._begin()
        elif self._profiler is not None and step >= self.stop:
            self._finish()

    def _begin(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._profiler = profile(activities=activities, record_shapes=True)
        self._profiler.start()

    def _finish(self) -> None:
        profiler, self._profiler = self._profiler, None
        self.done = True
        if profiler is None:  # never started: nothing to write
            return
        profiler.stop()
        try:
            profiler.export_chrome_trace(str(self.path))
        except OSError as exc:
            logger.warning("tracing: profile %s not written: %s", self.path, exc.strerror)

    def close(self) -> Path | None:
        """Stops a window still open (the run ended inside it); the file, if written."""
        if self._profiler is not None:
            self._finish()
        return self.path if self.path.exists() else None
