"""Names the pipeline's bottleneck stage from where its threads spent their waits.

The pipeline has three places a thread can stall: target threads waiting for
input on `batch_queue`, target threads blocked on a full `hs_queue` (drafters
too slow), and drafter threads waiting on an empty `hs_queue` (targets too slow).
"""

from __future__ import annotations

from dataclasses import dataclass

# Below this share of wall time a wait is noise, not a bottleneck.
DEFAULT_THRESHOLD = 0.15


@dataclass(frozen=True)
class WaitShares:
    """Each field is a share (0..1) of the stage threads' wall time in the interval."""

    target_input_wait: float  # target threads waiting on batch_queue.get
    target_output_wait: float  # target threads blocked on hs_queue.put (queue full)
    drafter_wait: float  # drafter threads waiting on hs_queue.get


def _pct(share: float) -> str:
    return f"{100 * share:.0f}%"


def verdict(shares: WaitShares, threshold: float = DEFAULT_THRESHOLD) -> str:
    """One line naming the bottleneck and what to do about it."""
    if shares.drafter_wait >= threshold:
        if shares.target_input_wait >= threshold:
            return (
                f"drafters waited {_pct(shares.drafter_wait)} on hs_queue and targets "
                f"{_pct(shares.target_input_wait)} on batch_queue: input-bound; "
                "speed up data loading or raise --batch-queue-size"
            )
        return (
            f"drafters waited {_pct(shares.drafter_wait)} on hs_queue: target-bound; "
            "add target devices"
        )
    if shares.target_output_wait >= threshold:
        return (
            f"targets waited {_pct(shares.target_output_wait)} on a full hs_queue: "
            "drafter-bound; add drafter devices"
        )
    if shares.target_input_wait >= threshold:
        return (
            f"targets waited {_pct(shares.target_input_wait)} on batch_queue: input-bound; "
            "speed up data loading or raise --batch-queue-size"
        )
    worst = max(shares.drafter_wait, shares.target_output_wait, shares.target_input_wait)
    return f"balanced: no stage waited more than {_pct(worst)} of the interval"
