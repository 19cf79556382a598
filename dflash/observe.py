"""Telemetry of a training run: tracing setup from the config, interval tables with
throughput and a bottleneck verdict, cross-rank tables, and the bounded shutdown.

The pipeline talks to an `Observer` through the small Telemetry protocol of
dflash.queues (`phase`, `start_span`, `record`); everything OTel lives in `tracing`.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import tracing
from dflash.bottleneck import WaitShares, verdict
from tracing import Reporter, StatsSnapshot, TracingConfig, TracingConfigError

# Stats-only entry (no span): time target threads spent blocked on a full hs_queue.
HS_PUT = "hs_queue.put"


class ObserveError(ValueError):
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
        target_input_wait=share("batch_queue.wait"),
        target_output_wait=share(HS_PUT),
        drafter_wait=share("hs_queue.wait"),
    )


def pipeline_verdict(snap: StatsSnapshot) -> str | None:
    if "hs_queue.wait" not in snap.phases and "batch_queue.wait" not in snap.phases:
        return None  # nothing trained in this interval (setup, evaluation)
    return verdict(wait_shares(snap))


class RankTables:
    """Per-rank snapshots for rank 0's tables, gathered in step with training.

    Rank 0's reporter asks for a gather; the request rides on the next gradient
    all-reduce (one extra element), so every rank learns it at the same step and
    then takes part in one small all_gather: one collective per interval, never a
    collective from a thread that training does not wait for.
    """

    def __init__(self, stats: tracing.ProfileStats, timeout_s: float) -> None:
        self._stats = stats
        self._timeout_s = timeout_s
        self._wanted = False
        self._ready = threading.Event()
        self._result: list[StatsSnapshot] | None = None

    def request_flag(self) -> float:
        """Called on the training thread before the all-reduce (rank 0's vote counts)."""
        return 1.0 if self._wanted else 0.0

    def gather(self) -> None:
        """Called on every rank's training thread when the all-reduce carried a request."""
        import torch.distributed as dist

        local = self._stats.take_interval().to_dict()
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, local)
        self._result = [StatsSnapshot.from_dict(d) for d in out]
        self._wanted = False
        self._ready.set()

    def collect(self) -> list[StatsSnapshot] | None:
        """Rank 0's reporter thread: ask, then wait for the training thread's gather."""
        self._ready.clear()
        self._result = None
        self._wanted = True
        if not self._ready.wait(self._timeout_s):
            self._wanted = False
            return None  # training is stalled or finishing: print this rank alone
        return self._result


class _RankReporter(Reporter):
    """Reporter whose interval tables hold every rank (min/max per phase across ranks)."""

    def __init__(self, stats: tracing.ProfileStats, ranks: RankTables, **kw: Any) -> None:
        super().__init__(stats, **kw)
        self._ranks = ranks

    def report_interval(self) -> str:
        snaps = self._ranks.collect()
        if snaps is None:
            return super().report_interval()
        merged = StatsSnapshot.merge(snaps)
        title = f"{self._title}: last {merged.wall_s:.1f}s, {len(snaps)} ranks"
        return self._emit(self.render_ranks(merged, snaps, title))

    def render_ranks(self, merged: StatsSnapshot, snaps: list[StatsSnapshot], title: str) -> str:
        text = self.render(merged, title)
        table = tracing.format_table(merged, title=title, rank_snapshots=snaps)
        _, _, rest = text.partition("\nthroughput:")
        return table + ("\nthroughput:" + rest if rest else "")


class Observer:
    """The run's telemetry: what the pipeline calls, and the reporter around it."""

    def __init__(self, cfg: TracingConfig, telemetry: tracing.Telemetry, world_size: int) -> None:
        self.cfg = cfg
        self.telemetry = telemetry
        self.stats = telemetry.stats
        self.ranks = RankTables(self.stats, timeout_s=min(10.0, cfg.report_interval_s))
        self.is_main = cfg.rank == 0
        self.world_size = world_size
        self.reporter: Reporter | None = None
        self._closed: dict[str, Any] | None = None

    # -- the pipeline's Telemetry protocol ---------------------------------------
    def phase(self, name: str, **kw: Any) -> AbstractContextManager[Any]:
        return tracing.phase(name, **kw)

    def start_span(
        self, name: str, attributes: Mapping[str, Any] | None = None, **kw: Any
    ) -> tracing.SpanHandle:
        return tracing.start_span(name, attributes, **kw)

    def record(self, name: str, seconds: float) -> None:
        self.stats.add(name, seconds)

    # -- reporting ------------------------------------------------------------------
    def describe(self) -> str:
        return describe(self.cfg)

    def attach(self, pipe: Any) -> None:
        """Starts the interval reporter on the pipeline's counters (rank 0 prints)."""
        # Shares are of training time: setup (target preparation can take minutes)
        # must not dilute the cumulative table. Nothing was timed before this point.
        self.stats.reset()
        if not self.is_main:
            return
        counters = pipe.counters
        kw: dict[str, Any] = {"interval_s": self.cfg.report_interval_s, "title": "interval"}
        if self.world_size > 1:
            reporter: Reporter = _RankReporter(self.stats, self.ranks, **kw)
        else:
            reporter = Reporter(self.stats, **kw)
        w = self.world_size
        reporter.add_rate("target", lambda: counters.snapshot().target_tokens * w, "tok/s")
        reporter.add_rate("drafter", lambda: counters.snapshot().drafter_tokens * w, "tok/s")
        reporter.add_gauge("batch_queue", pipe.batch_queue.qsize)
        reporter.add_gauge("hs_queue", pipe.hs_queue.qsize)
        reporter.set_verdict(pipeline_verdict)
        reporter.install_exit_hooks()
        self.reporter = reporter.start()

    def close(self, log: Callable[[str], None], gather_ranks: bool) -> dict[str, Any]:
        """Final cumulative table, then the bounded shutdown; figures for summary.json.

        Idempotent: the failure and signal paths may call it after the normal one. With
        `gather_ranks` (every rank calls it at the same point) rank 0's final table
        shows each phase's min and max across ranks.
        """
        if self._closed is not None:
            return self._closed
        final_ranks = self._gather_final() if gather_ranks and self.world_size > 1 else None
        reporter = self.reporter
        if reporter is not None:
            reporter.stop(final=final_ranks is None)
            reporter.uninstall_exit_hooks()
        if final_ranks is not None and self.is_main:
            merged = StatsSnapshot.merge(final_ranks)
            title = f"total {merged.wall_s:.1f}s, {len(final_ranks)} ranks"
            log(tracing.format_table(merged, title=title, rank_snapshots=final_ranks))
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

    def _gather_final(self) -> list[StatsSnapshot]:
        import torch.distributed as dist

        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, self.stats.snapshot().to_dict())
        return [StatsSnapshot.from_dict(d) for d in out]


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
