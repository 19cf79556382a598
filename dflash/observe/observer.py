"""Telemetry of a training run: tracing and metrics set up from the config, interval
tables with throughput and a bottleneck verdict, cross-rank tables, and the bounded
shutdown that leaves stats.json, the timeline and the export counts.

The pipeline records its phases through the `tracing` API directly; the `Observer`
only sets tracing up and reports: it reads a read-only snapshot of the pipeline's
counters and queue depths, and gathers the other ranks' tables through the gradient
averager's cross-rank hook, between steps.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from opentelemetry import context as otel_context
from opentelemetry.context import Context

import tracing
from dflash import __version__
from dflash.config.settings import TelemetryConfig
from dflash.files import write_text_atomic
from dflash.log import NOT_PRINTED, Log, get_logger, say
from dflash.observe import bottleneck
from dflash.observe.flops import _cpu_name
from dflash.observe.instruments import (
    TIMELINE_SAMPLE_S,
    FlopsFigures,
    Instruments,
    ObserveError,
    PeakMemory,
    build_instruments,
)
from dflash.observe.metrics import NAMESPACE, record_step, start_run_metrics
from dflash.pipeline.queues import CounterSnapshot, Stopped
from dflash.summary import JSON
from tracing import Reporter, StatsSnapshot, TracingConfig, TracingConfigError
from tracing.logs import Logs, LogsReport, start_logs
from tracing.metrics import Metrics, MetricsReport, shutdown_all

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

    from dflash.observe.profile_window import ProfileWindow

# Where the rank runs, by TracingConfig's keyword (world_size=, device_model=, ...): Any,
# as `**` hands each to a field of its own type (int, str or None).
Placement = dict[str, Any]

__all__ = [
    "ObserveError",
    "Observer",
    "describe",
    "rank_placement",
    "shared_run_id",
    "start_observer",
]

SERVICE_NAME = "dflash-train"
STATS_FILE = "stats.json"
STEP_EVENT = "dflash.step"
"""The event (a log record of that name) of each logged step: the metrics.jsonl line."""
BRIDGED_LOGGERS = ("dflash", "tracing")
"""The loggers whose warnings and errors become OTLP log records while a run exports logs."""
logger = get_logger("observe")
# A logged step's figures in the metrics: record_step's keyword -> the figure's key.
_RECORDED = {
    "loss": "loss",
    "tau": "tau_estimate",
    "eval_tau": "eval_tau",  # on evaluated steps only
    "lr": "lr",
    "grad_norm": "grad_norm",
}
_Readers = dict[str, Callable[[], int]]  # {name: a counter, read when called}


def tracing_config(
    tel: TelemetryConfig,
    rank: int,
    run_id: str,
    **placement: Any,  # Any: Placement's values
) -> TracingConfig:
    """TracingConfig from cfg.telemetry: a flag left unset (None) leaves the choice to
    the OTEL_* variables, which the SDK reads; no endpoint (flag or variable) sends
    nothing over the network. `placement`: where the rank runs, for the resource
    (world_size=, local_rank=, node_rank=, device_model=, config_hash=; `rank_placement`)."""
    try:
        return TracingConfig(
            default_service_name=SERVICE_NAME,
            service_name=tel.service_name,
            service_version=__version__,
            attribute_namespace=NAMESPACE,
            otlp_endpoint=tel.otlp_endpoint,
            otlp_protocol=tel.otlp_protocol,
            protocol_setting="--otlp-protocol",
            trace_file=tel.trace_file,
            level=tel.trace_level,
            sample_ratio=tel.trace_sample_ratio,
            cuda_timing=tel.cuda_timing,
            rank=rank,
            run_id=run_id,
            report_interval_s=tel.profile_interval_s,
            **placement,
        )
    except TracingConfigError as exc:
        raise ObserveError(f"telemetry: {exc}") from None


def describe(cfg: TracingConfig, telemetry: tracing.Telemetry) -> str:
    """The start-up line: where traces go, level, sampling, the device timing in force
    (off after a fallback), the interval, and the resource's service and instance."""
    where = " + ".join(telemetry.sinks) or "nowhere (tables only; set --otlp-endpoint)"
    if telemetry.disabled_by:
        where = f"nowhere ({telemetry.disabled_by}: no spans, metrics or export; tables only)"
    elif not telemetry.own_provider and telemetry.provider is not None:
        where = "the application's TracerProvider"
    ratio = cfg.sample_ratio
    # ParentBased{root:X,...}: the root's sampler says what is sampled; children follow.
    sampler = telemetry.sampler.split(",")[0] + ("}" if "{" in telemetry.sampler else "")
    sampling = f"sample ratio {ratio:g}" if ratio is not None else f"sampler {sampler}"
    resource = telemetry.resource.attributes
    return (
        f"telemetry: traces -> {where}; level {cfg.level}; {sampling}; "
        f"cuda timing {telemetry.cuda_timing}; tables every {cfg.report_interval_s:g}s; "
        f"service {resource.get('service.name')} ({resource.get('service.instance.id')}, "
        f"run {cfg.run_id})"
    )


def cuda_timing_note(trace_level: str, cuda_timing: str, device_types: Iterable[str]) -> str | None:
    """The start-up line of a run that records spans of phases on a CUDA device (a
    `device_types` entry "cuda") with device timing off: those spans time the host's
    kernel launches, which return before the GPU has done the work. None otherwise."""
    if trace_level == "off" or cuda_timing != "off" or "cuda" not in set(device_types):
        return None
    return (
        "warning: --cuda-timing off: the spans of CUDA phases time the kernel launches, "
        "not the GPU's work; --cuda-timing events adds each phase's device time as a child "
        "span (no synchronization), sync makes the phase spans wait for the GPU"
    )


def rank_placement(
    world_size: int,
    local_rank: int | None = None,
    devices: Sequence[torch.device | str] = (),
    config: Mapping[str, object] | None = None,
    env: Mapping[str, str] | None = None,
) -> Placement:
    """The resource's account of where this rank runs (tracing_config's `placement`):
    world size, local rank, the node's rank (torchrun's GROUP_RANK, else NODE_RANK; the
    node's name is the resource's host.name), the model of `devices` (the rank's drafter
    devices: the CUDA device's name, which the run initializes anyway, or the CPU's) and
    the first 16 hex digits of the SHA-256 of `config` (the run's config.json) as JSON."""
    env = os.environ if env is None else env
    node = next((env[k] for k in ("GROUP_RANK", "NODE_RANK") if env.get(k, "").isdigit()), None)
    models = dict.fromkeys(_device_model(torch.device(d)) for d in devices)
    digest = None
    if config is not None:
        text = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return {
        "world_size": world_size,
        "local_rank": local_rank,
        "node_rank": None if node is None else int(node),
        "device_model": ", ".join(models) or None,
        "config_hash": digest,
    }


def _device_model(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return _cpu_name() if device.type == "cpu" else device.type


def shared_run_id(world_size: int) -> str:
    """One run id for every rank: rank 0's, broadcast at start-up (torchrun's
    TORCHELASTIC_RUN_ID is "none" under static rendezvous, so it cannot be trusted)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if run_id == "none":
        run_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
    if world_size > 1 and dist.is_initialized():
        box = [run_id]
        dist.broadcast_object_list(box, src=0)
        run_id = str(box[0])
    return run_id


class RankTables:
    """Per-rank snapshots for rank 0's interval tables, gathered in step with training.

    A `dflash.pipeline.distributed.CrossRankHook`: rank 0's reporter asks (`collect`), the
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
        out: list[Any] = [None] * dist.get_world_size()  # Any: all_gather_object's dicts
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


class ExportProblems:
    """Prints the line tracing tells a failing export with (its probe thread calls it):
    above the progress bar once the reporter has its stream, else to the live log; and
    a WARNING record of it for telemetry (the logs, when their endpoint is not the one
    that fails)."""

    def __init__(self, log: Log, rank: int = 0) -> None:
        self.log = getattr(log, "live", log)  # a BufferedLog would hold it until the run starts
        self.prefix = "telemetry: " if rank == 0 else f"telemetry (rank {rank}): "
        self.stream: IO[str] | None = None

    def __call__(self, line: str) -> None:
        stream = self.stream
        logger.warning("%s", self.prefix + line, extra=NOT_PRINTED)
        if stream is not None:
            print(self.prefix + line, file=stream, flush=True)
        else:
            self.log(self.prefix + line)


class Observer:
    """The run's telemetry: setup, the interval reporter, the final tables, shutdown."""

    def __init__(
        self,
        cfg: TracingConfig,
        telemetry: tracing.Telemetry,
        world_size: int,
        *,
        instruments: Instruments | None = None,
        output_dir: Path | None = None,
        problems: ExportProblems | None = None,
        logs: Logs | None = None,
    ) -> None:
        self.cfg = cfg
        self.logs = logs  # tracing.logs: the bridge and the step events (None: no logs)
        self.problems = problems or ExportProblems(print, cfg.rank)
        self.telemetry = telemetry
        self.stats = telemetry.stats
        self.ranks = RankTables(self.stats, timeout_s=min(10.0, cfg.report_interval_s))
        self.is_main = cfg.rank == 0
        self.world_size = world_size
        self.instruments = instruments or Instruments()
        self.output_dir = output_dir
        # A run sets it once its folder holds the run (dflash.run.folder): a run refused
        # before that leaves no stats.json or timeline behind.
        self.folder_written = True
        self.reporter: Reporter | None = None
        self.metrics: Metrics | None = None
        self.verdict: Callable[[StatsSnapshot], str | None] = bottleneck.snapshot_verdict
        self.bad_steps: int | None = None
        self._final_ranks: list[StatsSnapshot] | None = None
        self._stream: IO[str] | None = None
        self._closed: JSON | None = None

    @property
    def profile(self) -> ProfileWindow | None:
        """The --torch-profile window (dflash.observe.profile_window.ProfileWindow), or None."""
        return self.instruments.profile

    def describe(self) -> str:
        return describe(self.cfg, self.telemetry)

    def attach(
        self,
        snapshot: Callable[[], CounterSnapshot],
        devices: Sequence[torch.device | str] = (),
        flops: FlopsFigures | None = None,
        stream: IO[str] | None = None,
        read_bytes: Callable[[], int] | None = None,
        skipped_samples: Callable[[], Mapping[str, int]] | None = None,
        spool: Mapping[str, Callable[[], float]] | None = None,
    ) -> None:
        """Starts the reporter (rank 0 prints to `stream`), the metrics and the timeline's
        counters on the pipeline's `snapshot`; `devices`: every stage's device;
        `read_bytes`: bytes a hidden-state cache reader has read (its rate is a column);
        `skipped_samples`: the samples it left out so far, by reason (a metric);
        `spool`: a streamed run's spool depth, a reader of each of SPOOL_FIGURES."""
        # The start-up phases timed before this point (run.startup) stay in the stats:
        # the first table, printed when the first step ends, shows them. Shares are per
        # thread, so they do not dilute the stage threads' shares or the verdict.
        shared = bottleneck.shared_device(str(d) for d in devices) if devices else None
        streamed = spool is not None  # the target stage reads a vLLM engine's spool
        self.verdict = lambda s: bottleneck.snapshot_verdict(
            s, shared_device=shared, streamed=streamed
        )
        memory = PeakMemory([torch.device(d) for d in devices])
        self._start_metrics(snapshot, memory, skipped_samples, spool)
        self._watch_timeline(snapshot)
        if self.is_main:
            self._start_reporter(snapshot, memory, flops, stream, read_bytes)

    def _start_reporter(
        self,
        snapshot: Callable[[], CounterSnapshot],
        memory: PeakMemory,
        flops: FlopsFigures | None,
        stream: IO[str] | None,
        read_bytes: Callable[[], int] | None = None,
    ) -> None:
        interval_s = self.cfg.report_interval_s
        reporter = Reporter(self.stats, interval_s=interval_s, title="interval", stream=stream)
        w = self.world_size
        reporter.add_rate("target", lambda: snapshot().target_tokens * w, "tok/s")
        reporter.add_rate("drafter", lambda: snapshot().drafter_tokens * w, "tok/s")
        if read_bytes is not None:  # the target stage reads a cache: how fast, per rank
            reporter.add_rate("cache read", lambda: read_bytes() / 2**20, "MiB/s")
        reporter.add_gauge("batch_queue", lambda: snapshot().queued_now.get("batch_queue", 0))
        reporter.add_gauge("hs_queue", lambda: snapshot().queued_now.get("hs_queue", 0))
        if flops is not None:
            _add_flops(reporter, snapshot, flops, w)
        if memory.enabled:
            reporter.add_gauge(memory.TABLE_LABEL, memory.table_gib)
        skipped = lambda: "-" if self.bad_steps is None else self.bad_steps
        reporter.add_gauge("skipped steps", skipped)
        reporter.set_verdict(self.verdict)
        if w > 1:
            reporter.set_interval_source(self.ranks.collect)
        reporter.install_exit_hooks()
        self.reporter = reporter.start()
        self._stream = stream
        self.problems.stream = stream

    def _start_metrics(
        self,
        snapshot: Callable[[], CounterSnapshot],
        memory: PeakMemory,
        skipped_samples: Callable[[], Mapping[str, int]] | None = None,
        spool: Mapping[str, Callable[[], float]] | None = None,
    ) -> None:
        delivery = self.telemetry.delivery_counts
        spans = {
            outcome: (lambda o=outcome: getattr(delivery(), o))
            for outcome in ("handed", "exported", "failed")
        }
        by_reason: dict[str, Callable[[], float]] = {}
        if skipped_samples is not None:
            read = skipped_samples
            by_reason = {reason: (lambda r=reason: read()[r]) for reason in read()}
        self.metrics = start_run_metrics(
            self.cfg,
            self.stats,
            tokens=_readers(snapshot, target="target_tokens", drafter="drafter_tokens"),
            steps=_readers(snapshot, target="target_batches", drafter="drafter_steps"),
            queues=_queue_depths(snapshot),
            memory=memory.metric_readers(),
            skipped_steps=lambda: self.bad_steps or 0,
            skipped_samples=by_reason,
            spans=spans,
            spool=spool,
            on_export_problem=self.problems,
        )

    def _watch_timeline(self, snapshot: Callable[[], CounterSnapshot]) -> None:
        timeline = self.instruments.timeline
        if timeline is None:
            return
        timeline.watch("queue depth", _queue_depths(snapshot))
        tokens = _readers(snapshot, target="target_tokens", drafter="drafter_tokens")
        timeline.watch_rate("tokens/s", tokens)
        timeline.start_sampling(TIMELINE_SAMPLE_S)

    def first_step_done(self) -> None:
        """The first table now: the start-up and the first step, without waiting an
        interval (training thread; the reporter thread prints it)."""
        if self.reporter is not None:
            self.reporter.report_soon()

    def record_step(
        self, figures: JSON, mfu: float | None = None, context: Context | None = None
    ) -> None:
        """A logged step's figures into the metrics, and as one `dflash.step` event (its
        attributes the metrics.jsonl line's figures, its body that line) tied to
        `context`, the step's span (SpanHandle.context); a step skipped as non-finite
        since the last logged one is a WARNING record (the training thread, off the
        hot path)."""
        bad = figures.get("bad_steps")
        if isinstance(bad, int):
            if bad > (self.bad_steps or 0):
                step, now = figures.get("step"), bad - (self.bad_steps or 0)
                with _current(context):  # the record names the step's trace
                    logger.warning(
                        "step %s: %d steps skipped since the last logged step (loss or "
                        "gradient norm not finite: no update), %d in the run",
                        step,
                        now,
                        bad,
                        extra={**NOT_PRINTED, "dflash.step": step, "dflash.bad_steps": bad},
                    )
            self.bad_steps = bad
        if self.metrics is not None:
            recorded = {name: figures.get(key) for name, key in _RECORDED.items()}
            record_step(self.metrics, **recorded, mfu=mfu)
        if self.logs is not None:
            line = json.dumps(figures)
            self.logs.event(STEP_EVENT, figures, context=context, body=line)

    def gather_final(self) -> None:
        """Every rank, right after training (before rank 0 saves and evaluates, which
        other ranks would otherwise wait out in a collective): the cumulative tables."""
        if self.world_size < 2 or self._final_ranks is not None:
            return
        out: list[Any] = [None] * dist.get_world_size()  # Any: all_gather_object's dicts
        dist.all_gather_object(out, self.stats.snapshot().to_dict())
        self._final_ranks = [StatsSnapshot.from_dict(d) for d in out]

    def final_snapshot(self) -> StatsSnapshot:
        """The cumulative snapshot: merged over the ranks after `gather_final`."""
        finals = self._final_ranks
        return StatsSnapshot.merge(finals) if finals is not None else self.stats.snapshot()

    def close(self, log: Log, table: bool = True) -> JSON:
        """Final cumulative table (`table` False: none, for a refusal that is one line),
        then the bounded shutdown; figures for summary.json.

        Idempotent: the failure and signal paths may call it after the normal one.
        After `gather_final`, rank 0's final table shows each phase's min and max
        across ranks. Rank 0 writes OUTPUT_DIR/stats.json (the final snapshot).
        """
        if self._closed is not None:
            return self._closed
        reporter, finals = self.reporter, self._final_ranks
        final = self.final_snapshot()
        if reporter is None and self.is_main and table:  # stopped in the start-up: its table
            reporter = Reporter(self.stats, self.cfg.report_interval_s, verdict=self.verdict)
        if reporter is not None:
            # The final table and summary.json's verdict come from the same snapshot.
            reporter.stop(final=False)
            reporter.uninstall_exit_hooks()
            if table and finals is None:
                title = f"interval: total {final.wall_s:.1f}s"
                print(
                    reporter.render(final, title, cumulative=True),
                    file=self._stream or sys.stderr,
                    flush=True,
                )
            elif table:
                title = f"interval: total {final.wall_s:.1f}s, {len(finals)} ranks"
                log(reporter.render(final, title, cumulative=True, rank_snapshots=finals))
        files = self.instruments.close(write=self.folder_written)
        # Traces, metrics and logs end side by side, within the one bound of the traces.
        report, metrics = shutdown_all(self.telemetry, self.metrics, logs=self.logs)
        logs = self.logs.report() if self.logs is not None and self.logs.enabled else None
        if self.is_main:
            line = f"telemetry: {report.summary()}" + (f"; {metrics.summary()}" if metrics else "")
            log(line + (f"; {logs.summary()}" if logs else ""))
            if self.folder_written:
                files.update(self._write_stats(final))
        self._closed = {
            "spans_exported": report.spans_exported,
            "spans_dropped": report.spans_dropped,
            "spans_not_delivered": report.spans_not_delivered,
            "shutdown_s": round(report.duration_s, 3),
            **_metrics_counts(metrics),
            **_logs_counts(logs),
            "files": files,
            "verdict": self.verdict(final),
        }
        return self._closed

    def _write_stats(self, final: StatsSnapshot) -> dict[str, str]:
        if self.output_dir is None:
            return {}
        path = self.output_dir / STATS_FILE
        try:
            write_text_atomic(path, json.dumps(final.to_dict()) + "\n")
        except OSError:
            return {}
        return {"stats": str(path)}


@contextlib.contextmanager
def _current(context: Context | None) -> Iterator[None]:
    """`context` (an OTel Context, e.g. a phase's) is the current one inside the block."""
    token = None if context is None else otel_context.attach(context)
    try:
        yield
    finally:
        if token is not None:
            otel_context.detach(token)


def _readers(snapshot: Callable[[], CounterSnapshot], **fields: str) -> _Readers:
    """{name: a reader of snapshot().<field>} for each name=field (a stage's counter)."""
    return {name: (lambda f=field: getattr(snapshot(), f)) for name, field in fields.items()}


def _queue_depths(snapshot: Callable[[], CounterSnapshot]) -> _Readers:
    """{queue: a reader of its depth now} for the pipeline's two queues."""
    return {q: (lambda q=q: snapshot().queued_now.get(q, 0)) for q in ("batch_queue", "hs_queue")}


def _add_flops(
    reporter: Reporter,
    snapshot: Callable[[], CounterSnapshot],
    flops: FlopsFigures,
    world_size: int,
) -> None:
    """Achieved TFLOP/s per stage (model FLOPs), and MFU where the devices' peak is known;
    on a CPU the GFLOP/s and their share of its measured fp32 and bf16 matmul peaks."""
    sides = (
        ("target", flops.target_per_token, flops.target_peak_tflops, flops.target_cpu_peaks),
        ("drafter", flops.drafter_per_token, flops.drafter_peak_tflops, flops.drafter_cpu_peaks),
    )
    for side, per_token, peak, cpu_peaks in sides:
        if per_token == 0:  # the target stage reads a cache: it computes nothing
            continue

        def tera(side: str = side, per_token: float = per_token) -> float:
            tokens = getattr(snapshot(), f"{side}_tokens") * world_size
            return tokens * per_token / 1e12

        if peak is None:  # CPUs: achieved GFLOP/s, beside the CPU's measured peaks
            reporter.add_rate(f"{side} FLOPs", lambda t=tera: 1e3 * t(), "GFLOP/s")
            for dtype, gflops in (cpu_peaks or {}).items():
                share = f"% of {gflops:,.0f} GFLOP/s peak"
                rate = lambda t=tera, p=gflops: 1e5 * t() / p  # noqa: E731 - bound now
                reporter.add_rate(f"{side} {dtype} share", rate, share)
            continue
        reporter.add_rate(f"{side} FLOPs", tera, "TFLOP/s")
        reporter.add_rate(f"{side} MFU", lambda t=tera, p=peak: 100 * t() / p, "%")


def _metrics_counts(report: MetricsReport | None) -> dict[str, int]:
    if report is None:
        return {}
    return {
        "metric_exports_ok": report.exports_ok,
        "metric_exports_failed": report.exports_failed,
        "metric_exports_in_flight": report.exports_in_flight,
        "metric_points_lost": report.points_lost,
    }


def _logs_counts(report: LogsReport | None) -> dict[str, int]:
    if report is None:
        return {}
    return {
        "log_records_exported": report.records_exported,
        "log_records_failed": report.records_failed,
        "log_records_dropped": report.records_dropped,
    }


def start_observer(
    tel: TelemetryConfig,
    rank: int,
    world_size: int,
    *,
    run_id: str,
    output_dir: Path,
    log: Log = say,
    local_rank: int | None = None,
    devices: Sequence[torch.device | str] = (),
    config: Mapping[str, object] | None = None,
    exporters: Sequence[SpanExporter] = (),
) -> Observer:
    """Sets tracing up for this process from cfg.telemetry (call once, before training),
    with the logs beside it: the bridge on BRIDGED_LOGGERS while they export.
    `local_rank`, `devices` (the rank's drafter devices) and `config` (the run's config
    as a dict) go to the resource (`rank_placement`); `exporters` are more span exporters
    (--report-to mlflow's, dflash.observe.trackers).

    The timeline and profiler paths are checked first: a bad one is one ObserveError."""
    instruments = build_instruments(tel, output_dir, rank, log)
    placement = rank_placement(world_size, local_rank, devices, config)
    cfg = tracing_config(tel, rank, run_id, **placement)
    problems = ExportProblems(log, rank)
    telemetry = setup_tracing(
        cfg, phase_hooks=instruments.hooks, on_export_problem=problems, exporters=exporters
    )
    logs = start_logs(cfg, resource=telemetry.resource, on_export_problem=problems)
    logs.attach(*BRIDGED_LOGGERS)
    level = cfg.level if telemetry.tracing_spans else "off"  # OTEL_SDK_DISABLED: no spans
    note = cuda_timing_note(level, cfg.cuda_timing, (torch.device(d).type for d in devices))
    if note is not None and rank == 0:  # a WARNING record, so an OTLP log record too
        log(note)
    observer = Observer(
        cfg,
        telemetry,
        world_size,
        instruments=instruments,
        output_dir=output_dir,
        problems=problems,
        logs=logs,
    )
    observer.folder_written = False  # until the run has passed its checks
    return observer


def setup_tracing(cfg: TracingConfig, **options: Any) -> tracing.Telemetry:  # Any: setup's keywords
    """`tracing.setup` as a run needs it: a stop of the pipeline (Stopped, Ctrl-C) ends
    phases without marking them ERROR. `options` go to tracing.setup."""
    try:
        return tracing.setup(cfg, stop_exceptions=(Stopped, KeyboardInterrupt), **options)
    except TracingConfigError as exc:
        raise ObserveError(f"telemetry: {exc}") from None
