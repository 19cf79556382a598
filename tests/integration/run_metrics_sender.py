"""A short metrics run through the real library: dflash.observe.metrics over OTLP.

A module of its own (not conftest.py), shared by the collector and Prometheus tests.
The stage threads' phase durations follow given wait shares, so the bottleneck rule
has a known answer.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import tracing
from dflash.observe.bottleneck import WaitShares
from dflash.observe.metrics import MEMORY_FIGURES, NAMESPACE, record_step, start_run_metrics

TICK_S = 0.1


@contextmanager
def metrics_run(
    service: str, endpoint: str, run_id: str, shares: WaitShares, interval_s: float = 0.2
) -> Iterator[tracing.ProfileStats]:
    """Exports every dflash metric of one run while the block runs (then shuts down)."""
    cfg = tracing.TracingConfig(
        service_name=service,
        run_id=run_id,
        attribute_namespace=NAMESPACE,
        otlp_endpoint=endpoint,
        otlp_protocol="grpc",
    )
    stats = tracing.ProfileStats()
    tokens = {"target": 0.0, "drafter": 0.0}
    metrics = start_run_metrics(
        cfg,
        stats,
        tokens={k: (lambda k=k: tokens[k]) for k in tokens},
        steps={k: (lambda k=k: tokens[k] / 512) for k in tokens},
        queues={"batch_queue": lambda: 2, "hs_queue": lambda: 1},
        memory={"cpu": {figure: (lambda: 1 << 20) for figure in MEMORY_FIGURES}},
        skipped_steps=lambda: 0,
        skipped_samples={"nonfinite": lambda: 1},
        spans={"handed": lambda: 3, "exported": lambda: 3, "failed": lambda: 0},
        spool={"usage": lambda: 1 << 20, "samples": lambda: 2},
        exporter="otlp",
        export_interval_s=interval_s,
    )
    stop = threading.Event()

    def stage_threads() -> None:
        # One target and one drafter thread's time per tick, split by the shares.
        step = 0
        while not stop.wait(TICK_S / 4):
            for name, share in (
                ("batch_queue.wait", shares.target_input_wait),
                ("hs_queue.put", shares.target_output_wait),
                ("target.forward", 1 - shares.target_input_wait - shares.target_output_wait),
                ("hs_queue.wait", shares.drafter_wait),
                ("drafter.step", 1 - shares.drafter_wait),
            ):
                if share > 0:
                    stats.add(name, share * TICK_S)
            tokens["target"] += 512
            tokens["drafter"] += 512
            step += 1
            loss, tau = 5.0 / step**0.5, 1.0 + step / 100
            held_out = tau + 2.0 if step % 5 == 1 else None  # on evaluated steps only
            figures = {"loss": loss, "tau": tau, "eval_tau": held_out, "lr": 1e-3}
            record_step(metrics, **figures, grad_norm=0.5, mfu=0.01)

    thread = threading.Thread(target=stage_threads, name="fake-stages", daemon=True)
    thread.start()
    try:
        yield stats
    finally:
        stop.set()
        thread.join(5)
        report = metrics.shutdown(timeout_s=5.0)
        assert report.exports_failed == 0, report.summary()
