"""The end of a run: its checkpoints, the final evaluation and the summary.

`save_checkpoint_or_fail` writes a checkpoint while training and at the end;
`complete_run` saves the final checkpoint and drafter and evaluates it (in process or
served by vLLM); `build_summary` is the one place the summary (summary.json) is made,
for a finished run and for an interrupted one alike; `finish_run` does all of it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash import names
from dflash.data.datasets import heldout_prompts
from dflash.drafter.io import pruned_head_note, save_drafter
from dflash.eval.evaluate import evaluate_run, held_out_figures
from dflash.files import write_json_atomic, write_text_atomic
from dflash.log import Log, say
from dflash.run.build import Run
from dflash.run.checkpoint import (
    SAVE_FAILURES,
    list_checkpoints,
    load_trainable_weights,
    replace_dir,
    save_checkpoint,
    save_failure,
)
from dflash.run.engine import measure_with_vllm
from dflash.run.evaluations import eval_keys, trainable_weights
from dflash.run.folder import EVAL_PROMPTS_FILE, METRICS_FILE
from dflash.run.progress import format_summary
from dflash.summary import JSON, Evaluation, ServedFigures, Summary
from dflash.target import load as target_load  # by module: tests swap load_target
from dflash.target.served import TokenizerTarget
from dflash.train.optim import DivergedError
from dflash.train.step import PhaseFn, null_phase
from dflash.train.step_metrics import amend_line


@dataclass
class RunStats:
    """What the loop measured; `build_summary` turns it into the summary."""

    losses: list[float]
    num_tokens: int
    train_s: float


def save_drafter_dir(run: Run, directory: Path, dtype: torch.dtype | None = None) -> Path:
    """The standard DFlash directory of the run's drafter, with the run's metadata;
    weights in `dtype` (None: as trained)."""
    extra: JSON = {"step": run.step}
    if run.initialized_from is not None:
        extra["initialized_from"] = str(run.initialized_from)
    return save_drafter(
        run.drafter,
        directory,
        training_config=run.cfg.to_dict(),
        data_fingerprint=run.data_fingerprint,
        extra=extra,
        dtype=dtype,
    )


def save_run_checkpoint(run: Run) -> Path:
    """Checkpoint of the run's current position (atomic; keeps the newest few).

    A diverged run (DivergedError) writes none: its weights are those that gave
    --max-bad-steps non-finite steps in a row."""
    run.trainer.guard.raise_if_diverged()
    return save_checkpoint(
        run.output_dir / "checkpoints",
        write_drafter=lambda directory: save_drafter_dir(run, directory),
        trainer_state=run.trainer.state_dict(),
        step=run.step,
        next_batch_index=run.next_batch_index,
        config=run.cfg.to_dict(),
        keep=run.cfg.run.keep_checkpoints,
    )


def save_checkpoint_or_fail(run: Run) -> Path:
    """`save_run_checkpoint`, a failed write (a full disk) being one SaveError naming the
    path, the space left and the last complete checkpoint: the same line and exit code
    (2) at a checkpoint during training, after a signal and at the final save."""
    checkpoints = run.output_dir / "checkpoints"
    try:
        return save_run_checkpoint(run)
    except DivergedError:
        raise
    except SAVE_FAILURES as exc:
        earlier = list_checkpoints(checkpoints)
        complete = "no checkpoint of this run is complete"
        if earlier:
            complete = (
                f"the last complete checkpoint is {earlier[-1]} (--resume latest continues "
                "from it once there is room)"
            )
        raise save_failure(exc, checkpoints / f"step-{run.step:08d}", complete) from None


def save_final(run: Run, log: Log = say) -> None:
    """The final checkpoint, then OUTPUT_DIR/drafter/, each written aside and renamed into
    place: a full disk leaves the last complete checkpoint and drafter as they were, and
    is one SaveError naming the path, the space left and what is complete. What the
    engines make of the saved drafter (a pruned head) is said once, here."""
    final = save_checkpoint_or_fail(run)
    _write_drafter(
        run, f"the final checkpoint {final} is complete; its drafter/ is the trained drafter"
    )
    run.final_saved = True
    note = pruned_head_note(run.drafter.config)
    if note is not None:
        log(note)


def _write_drafter(run: Run, complete: str) -> None:
    """OUTPUT_DIR/drafter/ from the drafter's weights now, written aside and renamed into
    place; a failed write is a SaveError that says what is `complete`."""
    drafter_dir = run.output_dir / "drafter"
    tmp = run.output_dir / f".tmp-drafter-{os.getpid()}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        save_drafter_dir(run, tmp, save_dtype(run))
        replace_dir(tmp, drafter_dir)
    except SAVE_FAILURES as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise save_failure(exc, drafter_dir, complete) from None


def save_dtype(run: Run) -> torch.dtype:
    """--save-dtype: `auto` is the target's precision (bf16 on a GPU, fp32 on the CPU)."""
    name = run.cfg.run.save_dtype
    if name == "auto":
        return target_load.target_dtype(run.placement.target)
    return getattr(torch, name)


def complete_run(run: Run, phase: PhaseFn = null_phase, log: Log = say) -> tuple[Evaluation, float]:
    """Final checkpoint and drafter, then τ on held-out: (its figures, seconds spent).
    The evaluation joins the last step's metrics.jsonl line; with --keep-best a better
    drafter of an evaluation while training then replaces OUTPUT_DIR/drafter."""
    with phase(names.CHECKPOINT_SAVE):
        save_final(run, log)
    evaluation, eval_s = _final_evaluation(run, phase, log)
    if run.evals is not None:
        final = eval_keys(evaluation.to_dict())
        if final:
            run.evals.record(run.step, final, final=True)
            amend_line(run.output_dir / METRICS_FILE, run.step, final)
        keep_best(run, log)
    return evaluation, eval_s


def keep_best(run: Run, log: Log) -> None:
    """--keep-best: OUTPUT_DIR/drafter from the best evaluation's weights, when it is not
    the last step's (whose weights stay in the final checkpoint)."""
    best = run.evals.best if run.evals is not None else None
    if not run.cfg.run.keep_best or best is None or best.weights is None:
        return
    last = trainable_weights(run.drafter)
    load_trainable_weights(run.drafter, best.weights)
    try:
        complete = "the final checkpoint is complete; its drafter/ is the last step's"
        _write_drafter(run, complete)
    finally:
        load_trainable_weights(run.drafter, last)
    log(
        f"keep-best: {run.output_dir / 'drafter'} is step {best.step}'s drafter (held-out τ "
        f"{best.tau:.3f}); the last step's is in the final checkpoint"
    )


def _final_evaluation(run: Run, phase: PhaseFn, log: Log) -> tuple[Evaluation, float]:
    """τ on the held-out prompts at the end: in process or by vLLM."""
    eval_start_s = time.perf_counter()
    if run.cfg.run.eval_engine == "vllm" and run.cfg.run.eval_prompts:
        write_eval_prompts(run)
        with phase(names.EVAL):
            served = _measure_with_vllm(run, log)
        return Evaluation(served=served), time.perf_counter() - eval_start_s
    skipped = run.features.eval_skipped(run.target)
    if skipped is not None:
        return Evaluation(skipped=skipped), 0.0
    write_eval_prompts(run)
    with phase(names.EVAL):
        target = run.decoding_target
        if run.cfg.run.eval_prompts and target.device != run.placement.target:
            target.to(run.placement.target)  # kept on the host while training from a cache
        result = evaluate_run(target, run.drafter, run.heldout_data, run.cfg.run)
    held_out = held_out_figures(result) if result is not None else None
    return Evaluation(held_out=held_out), time.perf_counter() - eval_start_s


def write_eval_prompts(run: Run) -> None:
    """OUTPUT_DIR/eval_prompts.json: the token ids of the held-out prompts the run's τ is
    measured on, so that an engine judges the drafter on the very same ones
    (`bench/learning_run.py --judge heldout`): rebuilding them from the data file takes
    every data option the run had (a hidden cache's rows, kept cut replies, ...)."""
    cfg = run.cfg.run
    if not cfg.eval_prompts:
        return
    prompts = heldout_prompts(run.heldout_data, cfg.eval_prompts, cfg.eval_prompt_tokens)
    record = {
        "what": f"the held-out prompts of {run.cfg.data.source}, as token ids",
        "max_new_tokens": cfg.eval_new_tokens,
        "prompts": prompts,
    }
    # One line: the ids would take a line each indented.
    write_text_atomic(run.output_dir / EVAL_PROMPTS_FILE, json.dumps(record) + "\n")


def _measure_with_vllm(run: Run, log: Log) -> ServedFigures:
    """--eval-engine vllm: τ on the held-out prompts as vLLM serves the saved drafter."""
    cfg = run.cfg.run
    prompts = heldout_prompts(run.heldout_data, cfg.eval_prompts, cfg.eval_prompt_tokens)
    target = TokenizerTarget(run.cfg.target.spec, run.target.tokenizer)
    return measure_with_vllm(
        cfg.vllm_command,
        target,
        drafter_dir=run.output_dir / "drafter",
        block_size=run.drafter.config.block_size,
        prompts=prompts,
        max_new_tokens=cfg.eval_new_tokens,
        stop_token_ids=tuple(run.target.stop_token_ids),
        log_dir=run.output_dir,
        log=log,
    )


def build_summary(
    run: Run,
    stats: RunStats,
    started_s: float,
    *,
    evaluation: tuple[Evaluation, float] | None = None,
    interrupted: str | None = None,
    extra: JSON | None = None,
) -> JSON:
    """summary.json of a finished (`evaluation` given) or interrupted run, as written.
    `extra`: the pipeline's blocks (`pipeline`, `verdict`, `telemetry`)."""
    return make_summary(
        run, stats, started_s, evaluation=evaluation, interrupted=interrupted, extra=extra
    ).to_dict()


def make_summary(
    run: Run,
    stats: RunStats,
    started_s: float,
    *,
    evaluation: tuple[Evaluation, float] | None = None,
    interrupted: str | None = None,
    extra: JSON | None = None,
) -> Summary:
    """The typed summary of a finished or interrupted run (see build_summary)."""
    last = stats.losses[-1] if stats.losses else run.trainer.last_loss
    final, eval_s = evaluation if evaluation is not None else (Evaluation(), None)
    blocks = dict(extra or {})
    source = run.features.summary()
    summary = Summary(
        steps=run.step,
        steps_this_run=len(stats.losses),
        tokens_per_s=stats.num_tokens / stats.train_s if stats.train_s > 0 else 0.0,
        # None (JSON null), not NaN, when no step finished or the loss is not finite:
        # summary.json stays JSON.
        final_loss=_finite_or_none(last),
        evaluation=final,
        wall_s=time.perf_counter() - started_s,
        train_s=stats.train_s,
        setup_s=run.setup_s,
        eval_s=eval_s,
        bad_steps=run.trainer.guard.bad_steps,
        block_size=run.drafter.config.block_size,
        target=run.cfg.target.spec,
        target_layer_ids=list(run.layer_ids),
        mask_token_id=run.mask_token.token_id,
        mask_token_source=run.mask_token.source,
        packing=run.cfg.data.packing,
        initialized_from=None if run.initialized_from is None else str(run.initialized_from),
        drafter_dir=str(run.output_dir / "drafter") if run.final_saved else None,
        tau_estimate=_last_tau_estimate(run.output_dir / METRICS_FILE),
        hidden_cache_skipped=source.pop("hidden_cache_skipped", None),
        feature_source=source,
        interrupted=interrupted,
        pipeline=blocks.pop("pipeline", None),
        verdict=blocks.pop("verdict", None),
        telemetry=blocks.pop("telemetry", None),
        extra=blocks,
    )
    _while_training(run, stats, summary)
    return summary


def _while_training(run: Run, stats: RunStats, summary: Summary) -> None:
    """summary.json's record of the evaluations while training, and which step's drafter
    OUTPUT_DIR/drafter holds."""
    if run.evals is None:
        return
    summary.evaluations_while_training = run.evals.summary(stats.train_s)
    best = run.evals.best
    if run.cfg.run.keep_best and best is not None:
        summary.drafter_step = best.step if best.weights is not None else run.step


def _last_tau_estimate(path: Path) -> float | None:
    """The τ estimate of the last logged step (metrics.jsonl), to set beside the eval τ."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
        value = json.loads(lines[-1]).get("tau_estimate") if lines else None
    except (OSError, ValueError, AttributeError):
        return None
    return _finite_or_none(value) if isinstance(value, (int, float)) else None


def _finite_or_none(value: float | torch.Tensor | None) -> float | None:
    if value is None:
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def write_summary(run: Run, summary: JSON, log: Log) -> None:
    write_json_atomic(run.output_dir / "summary.json", summary)
    log(format_summary(summary))


def finish_run(
    run: Run,
    stats: RunStats,
    log: Log = say,
    started_s: float | None = None,
    phase: PhaseFn = null_phase,
) -> JSON:
    """complete_run, then the summary printed and in summary.json."""
    evaluation = complete_run(run, phase, log)
    started = started_s if started_s is not None else time.perf_counter()
    summary = build_summary(run, stats, started, evaluation=evaluation)
    write_summary(run, summary, log)
    return summary
