"""What each trained step leaves behind, the same in the reference loop and the pipeline.

`trainer_step` is the trainer's step both loops run: on a logged step it reads the
figures where the step ran (the pipeline's drafter thread, inside its drafter.step span).
`StepBookkeeping.after_step` then advances the run's step and next batch, evaluates while
training (--eval-every; --keep-best keeps the best weights), updates the progress line,
writes the metrics.jsonl line, stops a diverged run and saves the checkpoints that are due.
"""

from __future__ import annotations

import threading
import time

import torch
from opentelemetry.context import Context
from opentelemetry.trace import Link

import tracing
from dflash import names
from dflash.data.datasets import Batch
from dflash.observe.flops import drafter_flops, linear_params, mfu, target_flops_per_token
from dflash.observe.instruments import FlopsFigures, flops_figures
from dflash.observe.observer import Observer
from dflash.observe.profile_window import ProfileWindow
from dflash.observe.trackers import Reporting
from dflash.pipeline.distributed import DistInfo, GradAverager
from dflash.pipeline.stages import StepFn
from dflash.run.build import Run
from dflash.run.finish import RunStats, save_checkpoint_or_fail
from dflash.run.folder import METRICS_FILE
from dflash.run.progress import Progress
from dflash.target.model import TargetOutput
from dflash.train.step import DrafterTrainer, Figures, PhaseFn, StepResult
from dflash.train.step_metrics import StageRates, StepMetrics, span_attributes


def run_flops(run: Run) -> FlopsFigures:
    """FLOPs per trained token of the run's target forward (none where the features are
    read from disk) and drafter step, counting the configured anchors per row (an upper
    bound where rows have fewer valid anchors)."""
    cfg, target, drafter = run.cfg, run.target, run.drafter
    rows, seq_len, config = cfg.data.batch_size, cfg.data.seq_len, drafter.config
    per_target = 0.0
    if run.features.runs_target:
        weights = linear_params(target.model)
        if not cfg.loss.use_soft_labels and isinstance(target.lm_head, torch.nn.Linear):
            weights -= target.lm_head.weight.numel()  # hidden states only: no logits
        geo = target.geometry
        per_target = target_flops_per_token(
            weights, geo.num_layers, geo.num_heads, geo.head_dim, seq_len
        )
    step = drafter_flops(
        layer_weights=linear_params(drafter.layers),
        fusion_weights=linear_params(drafter.fc),
        lm_head_weights=drafter.lm_head.weight.numel(),
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        head_dim=config.head_dim,
        seq_len=seq_len,
        block_size=config.block_size,
    )
    block_tokens = rows * cfg.loss.num_anchors * config.block_size
    per_drafter = step.per_step(block_tokens, rows * seq_len) / (rows * seq_len)
    placement = run.placement
    return flops_figures(per_target, per_drafter, placement.targets, placement.drafters)


def step_metrics(run: Run) -> StepMetrics:
    """Which steps of the run are logged, and its metrics.jsonl."""
    cfg = run.cfg.run
    path = run.output_dir / METRICS_FILE
    return StepMetrics(cfg.log_every, run.step, cfg.steps, path, cfg.eval_every)


def trainer_step(
    trainer: DrafterTrainer,
    metrics: StepMetrics | None,
    window: ProfileWindow | None = None,
) -> StepFn:
    """`trainer`'s step. With `metrics` (replica 0's):
    on logged steps it reads the figures, inside the drafter.step span (after its last
    phase), and puts them on that span, and it links the step to its span. `window`: the
    --torch-profile window (dflash.observe.profile_window.ProfileWindow), replica 0's."""

    def step(batch: Batch, target_out: TargetOutput, phase: PhaseFn) -> StepResult:
        if window is not None:
            window.before_step(trainer.step_count)
            path = window.path_for(trainer.step_count)
            span = tracing.current_phase()
            if path is not None and span is not None:
                span.set_attribute(names.PROFILE_FILE, path)
        result = trainer.step(batch, target_out, phase=phase)
        if metrics is None:
            return result
        span = tracing.current_phase()  # drafter.step: the trainer's phases have ended
        if span is not None and span.span is not None:
            number = span.attributes.get(names.STEP, trainer.step_count - 1)
            result.link = Link(span.span.get_span_context(), {names.STEP: number})
        if metrics.due(trainer.step_count):
            result.figures = metrics.read(trainer.step_count, result)
            if span is not None:
                result.context = span.context
                for key, value in span_attributes(result.figures).items():
                    span.set_attribute(key, value)
        return result

    return step


class StepBookkeeping:
    """The run's record of its steps: the losses and tokens of every replica's steps, and
    after replica 0's the run's position, progress, metrics, evaluations and checkpoints.

    One per process. Replica threads call `after_step` at once: the losses are taken
    under a lock; the rest is replica 0's thread alone. Rank 0 (`info`) writes the files."""

    def __init__(
        self,
        run: Run,
        progress: Progress,
        metrics: StepMetrics,
        *,
        info: DistInfo | None = None,
        num_replicas: int = 1,
        averager: GradAverager | None = None,
        observer: Observer | None = None,
    ):
        self.run, self.progress, self.metrics = run, progress, metrics
        self.info = DistInfo() if info is None else info
        self.averager, self.observer = averager, observer
        self.reporting: Reporting | None = None  # --report-to (rank 0)
        self.rates: StageRates | None = None  # the pipeline's, once it exists
        self.flops = run_flops(run)
        self.start_step, self.start_index = run.step, run.next_batch_index
        self.batches_per_step = self.info.world_size * num_replicas
        self.losses: dict[int, list[torch.Tensor]] = {}  # device tensors, read at the end
        self.last_step: Link | None = None  # replica 0's last drafter.step span
        self.tokens = 0  # over all ranks: every rank trains batches of the same size
        self._lock = threading.Lock()
        self._started_s = time.perf_counter()

    def after_step(self, replica: int, step: int, batch: Batch, result: StepResult) -> None:
        """`replica`'s `step` (0-based, counted from this run's first) trained `batch`."""
        with self._lock:
            self.losses.setdefault(step, []).append(result.loss)
            self.tokens += batch.num_tokens * self.info.world_size
        if replica != 0:
            return
        if result.link is not None:
            self.last_step = result.link
        run, figures = self.run, result.figures
        run.step = self.start_step + step + 1
        run.next_batch_index = self.start_index + (step + 1) * self.batches_per_step
        if self.averager is not None:
            self.averager.after_step(may_read=figures is not None)
        if step == 0 and self.observer is not None:
            self.observer.first_step_done()
        if figures is not None:
            evals, train_s = run.evals, time.perf_counter() - self._started_s
            if self.info.is_main and evals is not None:  # other ranks wait in the next sync
                figures.update(evals.on_logged_step(run.step, train_s, self.step_links()))
        self.progress.update(run.step, batch.num_tokens * self.batches_per_step, figures)
        if figures is not None:
            self._log_step(figures, result.context)
            run.trainer.check_figures(figures)  # a diverged run stops before it saves
        if self.info.is_main and run.cfg.run.checkpoint_due(run.step):
            # replica 0's weights cannot move while it is here
            attributes = {names.STEP: run.step}
            links = self.step_links()
            phase = tracing.phase(
                names.CHECKPOINT_SAVE, level="step", attributes=attributes, links=links
            )
            with phase:
                save_checkpoint_or_fail(run)

    def step_links(self) -> list[Link]:
        """A link to the last step's drafter.step span (none before the first step, or
        without spans): checkpoint and eval spans, in traces of their own, point at the
        weights they saved or measured."""
        return [] if self.last_step is None else [self.last_step]

    def _log_step(self, figures: Figures, context: Context | None = None) -> None:
        """A logged step: metrics.jsonl (rank 0), the metrics signal and the step's event
        (every rank; `context`: its drafter.step span's, so the event names its trace)."""
        drafter_mfu = None
        if self.rates is not None:  # the pipeline's stage rates, and the drafter's MFU
            figures.update(self.rates.figures())
            rate = figures.get("tokens_per_s", {}).get("drafter", 0.0)
            drafter_mfu = mfu(self.flops.drafter_per_token, rate, self.flops.drafter_peak_tflops)
            if drafter_mfu is not None:
                figures["mfu"] = drafter_mfu
        if self.observer is not None:
            self.observer.record_step(figures, mfu=drafter_mfu, context=context)
        if self.info.is_main:
            self.metrics.write(figures)
            if self.reporting is not None:
                self.reporting.log_step(figures)

    def stats(self, train_s: float) -> RunStats:
        """The losses (each step's mean over the replicas), tokens and `train_s`."""
        with self._lock:
            losses = [sum(float(x) for x in v) / len(v) for _, v in sorted(self.losses.items())]
        return RunStats(losses, self.tokens, train_s)
