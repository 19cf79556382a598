"""Pipeline efficiency with synthetic stages of known cost.

Runs the real pipeline classes (`dflash.pipeline.Pipeline`: prefetch thread,
TargetForwardLoop and DrafterTrainLoop threads, bounded stop-aware queues) with
stages whose cost is known and releases the GIL (sleep, or a calibrated matmul),
and compares the measured throughput with the ideal 1 / max(stage time), where a
stage served by k threads takes cost / k.

    python bench/pipeline_efficiency.py                # sleeps, 25 ms base cost
    python bench/pipeline_efficiency.py --work matmul  # single-threaded matmuls

Bar: efficiency >= 0.95 for target:drafter cost ratios 1:1, 1:2, 2:1, and for two
target threads when the target is the slow stage. Sleep-based figures are robust on
a shared machine; matmul figures are not (other processes steal the cores).
Exit status 1 when a case misses the bar.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import torch

from dflash.pipeline.stages import Pipeline

BAR = 0.95


@dataclass(frozen=True)
class FakeBatch:
    batch_id: int
    num_tokens: int = 512


def sleep_work(cost_s: float):
    def work() -> None:
        time.sleep(cost_s)

    return work


def matmul_work(cost_s: float, size: int = 256):
    """A loop of single-threaded matmuls calibrated to take about `cost_s`."""
    a = torch.randn(size, size)
    start_s = time.perf_counter()
    for _ in range(20):
        a @ a
    per_matmul_s = (time.perf_counter() - start_s) / 20
    repeats = max(1, round(cost_s / per_matmul_s))

    def work() -> None:
        for _ in range(repeats):
            a @ a

    return work


@dataclass(frozen=True)
class Case:
    name: str
    target_cost_s: float
    drafter_cost_s: float
    target_threads: int = 1
    drafter_threads: int = 1

    @property
    def ideal_batches_per_s(self) -> float:
        slowest_s = max(
            self.target_cost_s / self.target_threads, self.drafter_cost_s / self.drafter_threads
        )
        return 1.0 / slowest_s


def run_case(case: Case, num_batches: int, work_kind: str, queue_size: int) -> float:
    """Measured batches/s of the real pipeline on `case`."""
    make = sleep_work if work_kind == "sleep" else matmul_work
    target_work, drafter_work = make(case.target_cost_s), make(case.drafter_cost_s)

    def forward(batch: FakeBatch) -> int:
        target_work()
        return batch.batch_id

    def step(batch: FakeBatch, target_out: int, phase) -> float:
        with phase("drafter.block_prediction"):
            drafter_work()
        return 0.0

    pipe = Pipeline.build(
        make_batch=FakeBatch,
        indices=range(num_batches),
        forwards=[("cpu", forward)] * case.target_threads,
        steps=[("cpu", step, None)] * case.drafter_threads,
        on_step=lambda *_: None,
        batch_queue_size=queue_size,
        hs_queue_size=queue_size,
    )
    start_s = time.perf_counter()
    stuck = pipe.run()
    wall_s = time.perf_counter() - start_s
    pipe.raise_if_failed()
    assert not stuck, f"threads did not stop: {stuck}"
    snap = pipe.counters.snapshot()
    assert snap.drafter_steps == num_batches, snap
    return num_batches / wall_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-ms", type=float, default=25.0, help="cost of the 1 in a ratio")
    parser.add_argument("--batches", type=int, default=120, help="batches per case")
    parser.add_argument("--work", choices=("sleep", "matmul"), default="sleep")
    parser.add_argument("--queue-size", type=int, default=4, help="both queue sizes")
    parser.add_argument(
        "--tracing", action="store_true", help="time phases with the tracing library (no export)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # one core per stage: the cost of a matmul stays known
    if args.tracing:  # the stages record through the tracing API: set it up, export nowhere
        import tracing

        tracing.setup(tracing.TracingConfig())
    base_s = args.base_ms / 1000
    cases = [
        Case("1:1", base_s, base_s),
        Case("1:2", base_s, 2 * base_s),
        Case("2:1", base_s * 2, base_s),
        Case("2:1, 2 target threads", 2 * base_s, base_s, target_threads=2),
    ]
    print(f"work={args.work} base={args.base_ms:g} ms batches/case={args.batches} "
          f"queues={args.queue_size} tracing={'on' if args.tracing else 'off'}")  # fmt: skip
    print(f"{'case (target:drafter)':<24} {'ideal b/s':>10} {'measured b/s':>13} {'eff':>6}")
    failed = 0
    for case in cases:
        measured = run_case(case, args.batches, args.work, args.queue_size)
        efficiency = measured / case.ideal_batches_per_s
        ok = efficiency >= BAR
        failed += not ok
        print(f"{case.name:<24} {case.ideal_batches_per_s:>10.2f} {measured:>13.2f} "
              f"{efficiency:>6.3f} {'ok' if ok else f'BELOW {BAR}'}")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
