"""Names the pipeline's bottleneck stage from where its threads spent their waits.

The pipeline has three places a thread can stall: target threads waiting for
input on `batch_queue`, target threads blocked on a full `hs_queue` (drafters
too slow), and drafter threads waiting on an empty `hs_queue` (targets too slow).
In a streamed run (--target-engine vllm) the target stage is the spool's reader,
whose `target.read` waits while the spool is empty: drafters waiting then means the
engine is the limit (engine-bound); the engine itself waits while the spool is full.
Shares are per thread (each thread's wait over its own wall time), averaged over
the threads of a stage: with eight target threads each idle 95 % of the time the
stage is idle 95 %, not 95 / 8.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from dflash import names
from tracing import StatsSnapshot

# Below this share of wall time a wait is noise, not a bottleneck.
DEFAULT_THRESHOLD = 0.15

BATCH_WAIT = names.BATCH_QUEUE_WAIT
HS_PUT = names.HS_QUEUE_PUT
HS_WAIT = names.HS_QUEUE_WAIT
# The entries that identify a thread as one of a stage's threads.
TARGET_PHASES = (BATCH_WAIT, names.TARGET_FORWARD, names.TARGET_READ, HS_PUT)
DRAFTER_PHASES = (HS_WAIT, names.DRAFTER_STEP)


@dataclass(frozen=True)
class WaitShares:
    """Each field is a share (0..1) of the stage threads' wall time in the interval."""

    target_input_wait: float  # target threads waiting on batch_queue.get
    target_output_wait: float  # target threads blocked on hs_queue.put (queue full)
    drafter_wait: float  # drafter threads waiting on hs_queue.get
    reads_cache: bool = False  # the target stage reads a hidden-state cache (target.read)
    streamed: bool = False  # what it reads, a vLLM engine writes meanwhile (the spool)


def wait_shares(snap: StatsSnapshot, streamed: bool = False) -> WaitShares:
    """The mean over each stage's threads of the share of its wall time in each wait;
    `streamed`: the target stage reads the spool a vLLM engine fills."""
    targets = snap.threads_of(*TARGET_PHASES)
    drafters = snap.threads_of(*DRAFTER_PHASES)

    def share(name: str, threads: set[str]) -> float:
        value = snap.share(name, threads) if threads else None
        return 0.0 if value is None else value

    return WaitShares(
        target_input_wait=share(BATCH_WAIT, targets),
        target_output_wait=share(HS_PUT, targets),
        drafter_wait=share(HS_WAIT, drafters),
        reads_cache=names.TARGET_READ in snap.phases and names.TARGET_FORWARD not in snap.phases,
        streamed=streamed,
    )


def shared_device(devices: Iterable[str]) -> str | None:
    """The one device every stage runs on (e.g. "cpu"), or None when they differ.

    Threads on one device share its compute: more threads there do not add any."""
    names = {_normalized(str(device)) for device in devices}
    return names.pop() if len(names) == 1 else None


def _normalized(device: str) -> str:
    name = device.strip().lower()
    return "cuda:0" if name == "cuda" else name


def snapshot_verdict(
    snap: StatsSnapshot,
    *,
    shared_device: str | None = None,
    threshold: float = DEFAULT_THRESHOLD,
    streamed: bool = False,
) -> str | None:
    """The verdict of one interval's snapshot; None when no stage ran in it.
    `streamed`: the target stage reads the spool of a vLLM engine (--target-engine vllm)."""
    if HS_WAIT not in snap.phases and BATCH_WAIT not in snap.phases:
        return None  # nothing trained in this interval (setup, evaluation)
    return verdict(wait_shares(snap, streamed), threshold, shared_device=shared_device)


def _pct(share: float) -> str:
    return f"{100 * share:.0f}%"


def _more_devices(kind: str, shared: str | None) -> str:
    if shared is None:
        return f"add {kind} devices"
    return (
        f"but every stage runs on {shared}, so {shared} itself is the limit: more {kind} "
        "threads on it will not help; give each stage its own device"
    )


def verdict(
    shares: WaitShares,
    threshold: float = DEFAULT_THRESHOLD,
    *,
    shared_device: str | None = None,
) -> str:
    """One line naming the bottleneck and what to do about it.

    `shared_device`: the device all stages share (see `shared_device()`); the advice
    then names it as the limit instead of advising more devices of one kind."""
    input_bound = (
        "input-bound; speed up data loading or raise --batch-queue-size"
        if shared_device is None
        else f"input-bound; speed up data loading (it shares {shared_device} with the stages)"
    )
    if shares.drafter_wait >= threshold:
        if shares.target_input_wait >= threshold:
            return (
                f"drafters waited {_pct(shares.drafter_wait)} on hs_queue and targets "
                f"{_pct(shares.target_input_wait)} on batch_queue: {input_bound}"
            )
        if shares.streamed:  # the reader waits on an empty spool: the engine writes it
            return (
                f"drafters waited {_pct(shares.drafter_wait)} on hs_queue: engine-bound; the "
                "vLLM engine fills the spool slower than the drafters train (give vLLM more "
                "or faster devices, --engine-args '--tensor-parallel-size N')"
            )
        if shares.reads_cache:  # no device helps: the disk or its reader is the limit
            return (
                f"drafters waited {_pct(shares.drafter_wait)} on hs_queue: reader-bound; the "
                "hidden-state cache is read slower than the drafters train (faster storage, "
                "or the cache on local disk of each node)"
            )
        return (
            f"drafters waited {_pct(shares.drafter_wait)} on hs_queue: target-bound; "
            + _more_devices("target", shared_device)
        )
    if shares.target_output_wait >= threshold:
        who = "the cache reader" if shares.reads_cache else "targets"
        who = "the spool reader" if shares.streamed else who
        engine = " (the vLLM engine waits on a full spool)" if shares.streamed else ""
        return (
            f"{who} waited {_pct(shares.target_output_wait)} on a full hs_queue{engine}: "
            "drafter-bound; " + _more_devices("drafter", shared_device)
        )
    if shares.target_input_wait >= threshold:
        return f"targets waited {_pct(shares.target_input_wait)} on batch_queue: {input_bound}"
    worst = max(shares.drafter_wait, shares.target_output_wait, shares.target_input_wait)
    return f"balanced: no stage waited more than {_pct(worst)} of the interval"
