"""Telemetry of a training run: tracing setup from the config, interval tables with
throughput and a bottleneck verdict, cross-rank tables, and the bounded shutdown.

The pipeline records its phases through the `tracing` API directly; the `Observer`
only sets tracing up and reports: it reads a read-only snapshot of the pipeline's
counters and queue depths, and gathers the other ranks' tables through the gradient
averager's cross-rank hook, between steps.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

import tracing
from dflash import names
from dflash.bottleneck import WaitShares, verdict
from dflash.errors import DFlashError
from dflash.queues import CounterSnapshot
from tracing import Reporter, StatsSnapshot, TracingConfig, TracingConfigError


class ObserveError(DFlashError):
    """A telemetry setting that tracing rejects (one line naming the flag)."""


def tracing_config(tel: Any, rank: int, run_id: str) -> TracingConfig:
    """TracingConfig from cfg.telemetry: flags win over OTEL_* variables, which win over
    the defaults. No endpoint (flag or OTEL_EXPORTER_OTLP_ENDPOINT) sends nothing."""
    exporters: list[str] = []
    if tel.otlp_endpoint:
        exporters.append("otlp")
    if tel.trace_file:
        exporters.append("file")
    try:
        return TracingConfig.from_env(
            service_name=tel.service_name,
            exporter=tuple(exporters) or None,
            otlp_endpoint=tel.otlp_endpoint,
            otlp_protocol=tel.otlp_protocol,
            trace_file=tel.trace_file,
            level=tel.trace_level,
            sample_ratio=tel.trace_sample_ratio,
            cuda_timing=tel.cuda_timing,
            rank=rank,
            run_id=run_id,
            report_interval_s=tel.profile_interval_s,
        )
    except TracingConfigError as exc:
        raise ObserveError(f"telemetry: {exc}") from None


def describe(cfg: TracingConfig) -> str:
    """The startup line: where traces go, level, sampling, timing mode, interval."""
    sinks = []
    if "otlp" in cfg.exporter:
        sinks.append(f"OTLP/{cfg.otlp_protocol} {cfg.otlp_endpoint}")
    if "file" in cfg.exporter:
        sinks.append(f"file {cfg.trace_file}")
    if "console" in cfg.exporter:
        sinks.append("console")
    where = " + ".join(sinks) if sinks else "nowhere (tables only; set --otlp-endpoint)"
    return (
        f"telemetry: traces -> {where}; level {cfg.level}; sample ratio {cfg.sample_ratio:g}; "
        f"cuda timing {cfg.cuda_timing}; tables every {cfg.report_interval_s:g}s; "
        f"service {cfg.service_name} ({cfg.service_instance_id}, run {cfg.run_id})"
    )


def wait_shares(snap: StatsSnapshot) -> WaitShares:
    """Shares of the stage threads' wall time spent in each queue wait."""

    def share(name: str) -> float:
        value = snap.share(name)
        return 0.0 if value is None else value

    return WaitShares(
        target_input_wait=share(names.BATCH_QUEUE_WAIT),
        target_output_wait=share(names.HS_QUEUE_PUT),
        drafter_wait=share(names.HS_QUEUE_WAIT),
    )


def pipeline_verdict(snap: StatsSnapshot) -> str | None:
    if names.HS_QUEUE_WAIT not in snap.phases and names.BATCH_QUEUE_WAIT not in snap.phases:
        return None  # nothing trained in this interval (setup, evaluation)
    return verdict(wait_shares(snap))


class RankTables:
    """Per-rank snapshots for rank 0's interval tables, gathered in step with training.

    A `dflash.distributed.CrossRankHook`: rank 0's reporter asks (`collect`), the
    request rides on the next gradient all-reduce, and every rank's training thread
    then runs `run` (one small all_gather) after the same step, outside any phase.
    """

    def __init__(self, stats: tracing.ProfileStats, timeout_s: float) -> None:
        self._stats = stats
        self._timeout_s = timeout_s
        self._wanted = False
        self._ready = threading.Event()
        self._result: list[StatsSnapshot] | None = None

    def wanted(self) -> bool:
        return self._wanted

    def run(self) -> None:
        local = self._stats.take_interval().to_dict()
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, local)
        self._result = [StatsSnapshot.from_dict(d) for d in out]
        self._wanted = False
        self._ready.set()

    def collect(self) -> tuple[StatsSnapshot, list[StatsSnapshot]] | None:
        """Rank 0's reporter thread: ask, then wait for the training thread's gather."""
        self._ready.clear()
        self._result = None
        self._wanted = True
        if not self._ready.wait(self._timeout_s) or self._result is None:
            self._wanted = False
            return None  # training is stalled or finishing: print this rank alone
        return StatsSnapshot.merge(self._result), self._result


class Observer:
    """The run's telemetry: setup, the interval reporter, the final tables, shutdown."""

    def __init__(self, cfg: TracingConfig, telemetry: tracing.Telemetry, world_size: int) -> None:
        self.cfg = cfg
        self.telemetry = telemetry
        self.stats = telemetry.stats
        self.ranks = RankTables(self.stats, timeout_s=min(10.0, cfg.report_interval_s))
        self.is_main = cfg.rank == 0
        self.world_size = world_size
        self.reporter: Reporter | None = None
        self._final_ranks: list[StatsSnapshot] | None = None
        self._closed: dict[str, Any] | None = None

    def describe(self) -> str:
        return describe(self.cfg)

    def attach(self, snapshot: Callable[[], CounterSnapshot]) -> None:
        """Starts the interval reporter on the pipeline's `snapshot` (rank 0 prints)."""
        # Shares are of training time: setup (target preparation can take minutes)
        # must not dilute the cumulative table. Nothing was timed before this point.
        self.stats.reset()
        if not self.is_main:
            return
        reporter = Reporter(self.stats, interval_s=self.cfg.report_interval_s, title="interval")
        w = self.world_size
        reporter.add_rate("target", lambda: snapshot().target_tokens * w, "tok/s")
        reporter.add_rate("drafter", lambda: snapshot().drafter_tokens * w, "tok/s")
        reporter.add_gauge("batch_queue", lambda: snapshot().queued_now.get("batch_queue", 0))
        reporter.add_gauge("hs_queue", lambda: snapshot().queued_now.get("hs_queue", 0))
        reporter.set_verdict(pipeline_verdict)
        if w > 1:
            reporter.set_interval_source(self.ranks.collect)
        reporter.install_exit_hooks()
        self.reporter = reporter.start()

    def gather_final(self) -> None:
        """Every rank, right after training (before rank 0 saves and evaluates, which
        other ranks would otherwise wait out in a collective): the cumulative tables."""
        if self.world_size < 2 or self._final_ranks is not None:
            return
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, self.stats.snapshot().to_dict())
        self._final_ranks = [StatsSnapshot.from_dict(d) for d in out]

    def close(self, log: Callable[[str], None]) -> dict[str, Any]:
        """Final cumulative table, then the bounded shutdown; figures for summary.json.

        Idempotent: the failure and signal paths may call it after the normal one.
        After `gather_final`, rank 0's final table shows each phase's min and max
        across ranks.
        """
        if self._closed is not None:
            return self._closed
        reporter, finals = self.reporter, self._final_ranks
        if reporter is not None:
            reporter.stop(final=finals is None)
            reporter.uninstall_exit_hooks()
            if finals is not None:
                merged = StatsSnapshot.merge(finals)
                title = f"interval: total {merged.wall_s:.1f}s, {len(finals)} ranks"
                log(reporter.render(merged, title, cumulative=True, rank_snapshots=finals))
        report = self.telemetry.shutdown()
        if self.is_main:
            log(f"telemetry: {report.summary()}")
        self._closed = {
            "spans_exported": report.spans_exported,
            "spans_dropped": report.spans_dropped,
            "spans_not_delivered": report.spans_not_delivered,
            "shutdown_s": round(report.duration_s, 3),
        }
        return self._closed


def start_observer(tel: Any, rank: int, world_size: int) -> Observer:
    """Sets tracing up for this process from cfg.telemetry (call once, before training)."""
    # torchrun gives every rank the same id; alone, a fresh one.
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if run_id == "none":
        run_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
    cfg = tracing_config(tel, rank, run_id)
    try:
        telemetry = tracing.setup(cfg)
    except TracingConfigError as exc:
        raise ObserveError(f"telemetry: {exc}") from None
    return Observer(cfg, telemetry, world_size)
