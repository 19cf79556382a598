"""The learning-rate schedule: linear warmup, then a cosine down to a floor."""

from __future__ import annotations

import math


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Factor of the peak rate at `step`: (step+1)/warmup during the warmup, then a
    cosine from 1 down to `min_ratio` at `total_steps` (and `min_ratio` after it)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, progress))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
