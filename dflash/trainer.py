"""The drafter training step and the single-threaded reference loop.

`DrafterTrainer.step` is the unit both this loop and the pipeline run; the loop
(`train_reference`) is the reference the pipeline is tested against. Building a
run and finishing it (save, evaluate, summary) are separate functions so the
pipeline reuses them unchanged.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dflash.checkpoint import (
    CheckpointError,
    load_checkpoint,
    load_trainable_weights,
    resolve_checkpoint,
    restore_rng_state,
    save_checkpoint,
    trainable_weights,
)
from dflash.config import TrainConfig
from dflash.data import Batch, PackedDataset, build_datasets, heldout_prompts
from dflash.progress import Progress, format_loss_config, format_run_config, format_summary

PhaseFn = Callable[[str], AbstractContextManager[Any]]


def null_phase(name: str) -> AbstractContextManager[None]:
    """A phase that records nothing (the default when no tracing is set up)."""
    return nullcontext()


def anchor_seed(seed: int, batch_id: int) -> int:
    """Seed of a batch's anchor/noise RNG: a function of (seed, batch id) only, so
    results do not depend on which thread or replica runs the batch."""
    return int(np.random.SeedSequence([seed, batch_id]).generate_state(1, np.uint64)[0] >> 1)


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine down to `min_ratio` at `total_steps`."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, progress))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class StepResult:
    loss: float
    num_tokens: int
    metrics: dict[str, float] = field(default_factory=dict)


class DrafterTrainer:
    """Optimizer, schedule and the five phases of one drafter step."""

    def __init__(self, drafter: nn.Module, cfg: TrainConfig, device: torch.device | str) -> None:
        from dflash.objective import LossConfig, NoiseSchedule

        self.drafter, self.cfg, self.device = drafter, cfg, torch.device(device)
        self.params = [p for p in drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=cfg.optim.lr, betas=(0.9, 0.95), weight_decay=cfg.optim.weight_decay
        )
        opt = cfg.optim
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_factor(s, opt.warmup_steps, cfg.run.steps, opt.min_lr_ratio),
        )
        obj = cfg.objective
        self.loss_cfg = LossConfig(
            gamma=cfg.gamma,
            use_soft_labels=obj.use_soft_labels,
            kl_temperature=obj.kl_temperature,
            kl_weight=obj.kl_weight,
            streak_alpha=obj.streak_alpha,
        )
        self.noise = NoiseSchedule()
        self.grad_sync: Callable[[], None] | None = None
        self.step_count = 0
        self.last_loss: float | None = None
        # bf16 autocast on GPU; CPU stays fp32 (CPU bf16 matmuls are slow and lossy).
        self.autocast_dtype = torch.bfloat16 if self.device.type == "cuda" else None

    def _autocast(self) -> AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def step(self, batch: Batch, target_out: Any, phase: PhaseFn = null_phase) -> StepResult:
        """One optimizer step on `batch` given the target's captured features."""
        from dflash.objective import (
            block_labels,
            build_blocks,
            dflash_loss,
            gather_target_logits,
            select_anchors,
        )

        drafter, bs = self.drafter, self.cfg.drafter.block_size
        drafter.train()
        with phase("drafter.anchor_selection"):
            gen = torch.Generator(device="cpu").manual_seed(
                anchor_seed(self.cfg.run.seed, batch.batch_id)
            )
            anchors, keep = select_anchors(batch.loss_mask, self.cfg.objective.num_anchors, gen)
            block_ids = build_blocks(
                batch.input_ids, anchors, bs, drafter.mask_id,
                self.noise, self.step_count, gen,
            )  # fmt: skip
            labels, valid = block_labels(batch.input_ids, batch.loss_mask, anchors, keep, bs)
        with phase("drafter.block_prediction"), self._autocast():
            logits = drafter(target_out.hidden, block_ids, anchors, keep)  # [B, N, Bs, V]
        with phase("drafter.loss"):
            target_logits = None
            if self.loss_cfg.use_soft_labels:
                target_logits = gather_target_logits(target_out.logits, anchors, bs)
            out = dflash_loss(logits.float(), labels, valid, self.loss_cfg, target_logits)
        with phase("drafter.backward"):
            self.optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
            if self.grad_sync is not None:
                self.grad_sync()  # replicas average gradients before anyone steps
        with phase("drafter.optimizer"):
            if self.cfg.optim.grad_clip > 0:
                grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.optim.grad_clip)
            else:
                grad_norm = torch.zeros(())
            self.optimizer.step()
            self.scheduler.step()
        self.step_count += 1
        self.last_loss = float(out.loss.detach())
        metrics = {k: float(v) for k, v in out.metrics.items()}
        metrics |= {"grad_norm": float(grad_norm), "lr": self.scheduler.get_last_lr()[0]}
        return StepResult(self.last_loss, batch.num_tokens, metrics)

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step_count": self.step_count,
            "last_loss": self.last_loss,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        # The restored lr came from the saved run's schedule; a resume with another
        # --steps follows the new cosine from here on.
        last = self.scheduler.last_epoch
        for group, base_lr, fn in zip(
            self.optimizer.param_groups,
            self.scheduler.base_lrs,
            self.scheduler.lr_lambdas,
            strict=True,
        ):
            group["lr"] = base_lr * fn(last)
        self.step_count = int(state["step_count"])
        self.last_loss = state["last_loss"]


# --------------------------------------------------------------------------- the run


@dataclass
class Run:
    """Everything a training run is built from, and where its loop stands."""

    cfg: TrainConfig
    target: Any  # dflash.target.TargetModel
    drafter: nn.Module
    trainer: DrafterTrainer
    train_data: PackedDataset
    heldout_data: PackedDataset
    layer_ids: list[int]
    target_device: torch.device
    drafter_device: torch.device
    output_dir: Path
    step: int = 0
    next_batch_index: int = 0
    setup_s: float = 0.0
    resumed_from: Path | None = None


@dataclass
class RunStats:
    """What the loop measured; `finish_run` turns it into the summary."""

    losses: list[float]
    num_tokens: int
    train_s: float


def _devices(cfg: TrainConfig) -> tuple[torch.device, torch.device]:
    from dflash.devices import resolve_devices

    targets, drafters = resolve_devices(
        ",".join(cfg.pipeline.target_devices), ",".join(cfg.pipeline.drafter_devices)
    )
    return targets[0], drafters[0]


def build_drafter(cfg: TrainConfig, target: Any, layer_ids: list[int], device: torch.device):
    """A freshly initialized drafter (seeded by --seed) sharing the target's frozen parts."""
    from dflash.drafter import DFlashDrafter, DrafterConfig

    dcfg = DrafterConfig.for_target(
        target,
        num_layers=cfg.drafter.num_layers,
        block_size=cfg.drafter.block_size,
        target_layer_ids=list(layer_ids),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.run.seed)
        drafter = DFlashDrafter(dcfg, target.embed_tokens, target.lm_head)
    return drafter.to(device)


def resolve_layer_ids(cfg: TrainConfig, num_layers: int) -> list[int]:
    from dflash.target import default_target_layers, validate_target_layers

    if cfg.target.layer_ids is None:
        return default_target_layers(num_layers, cfg.drafter.num_layers)
    ids = list(cfg.target.layer_ids)
    validate_target_layers(ids, num_layers)
    return ids


def _check_resume_compatible(cfg: TrainConfig, saved: dict[str, Any], path: Path) -> None:
    """A checkpoint continues only the same drafter on the same target."""
    current = cfg.to_dict()
    for section in ("target", "drafter"):
        for key, value in current[section].items():
            old = saved.get(section, {}).get(key)
            if old != value:
                raise CheckpointError(
                    f"--resume {path}: checkpoint has {section}.{key}={old!r}, this run {value!r}"
                )


def build_run(cfg: TrainConfig, log: Callable[[str], None] = print) -> Run:
    """Target, data, drafter and trainer for `cfg`; restores `--resume` if set."""
    from dflash.target import load_target

    start_s = time.perf_counter()
    target_device, drafter_device = _devices(cfg)
    output_dir = Path(cfg.run.output_dir)
    resume = None
    if cfg.run.resume:  # check the checkpoint before spending minutes on the target
        resume = load_checkpoint(resolve_checkpoint(cfg.run.resume, output_dir))
        _check_resume_compatible(cfg, resume.config, resume.path)
    dtype = torch.bfloat16 if target_device.type == "cuda" else torch.float32
    target = load_target(cfg.target.spec, target_device, dtype, log=log)
    layer_ids = resolve_layer_ids(cfg, target.num_layers)
    train, heldout = build_datasets(
        cfg.data.source, target.tokenizer, cfg.data.seq_len, cfg.data.batch_size,
        cfg.run.seed, cfg.data.heldout_fraction,
    )  # fmt: skip
    drafter = build_drafter(cfg, target, layer_ids, drafter_device)
    trainer = DrafterTrainer(drafter, cfg, drafter_device)
    run = Run(cfg, target, drafter, trainer, train, heldout, layer_ids,
              target_device, drafter_device, output_dir)  # fmt: skip
    if resume is not None:
        load_trainable_weights(drafter, resume.weights)
        trainer.load_state_dict(resume.trainer_state)
        restore_rng_state(resume.rng_state)
        run.step, run.next_batch_index = resume.step, resume.next_batch_index
        run.resumed_from = resume.path
        log(f"resumed from {resume.path} at step {resume.step}")
    run.setup_s = time.perf_counter() - start_s
    return run


def save_run_checkpoint(run: Run) -> Path:
    """Checkpoint of the run's current position (atomic; keeps the newest few)."""
    return save_checkpoint(
        run.output_dir / "checkpoints",
        weights=trainable_weights(run.drafter),
        trainer_state=run.trainer.state_dict(),
        step=run.step,
        next_batch_index=run.next_batch_index,
        config=run.cfg.to_dict(),
        keep=run.cfg.run.keep_checkpoints,
    )


def evaluate_run(run: Run) -> Any | None:
    """τ of the run's drafter on held-out prompts (None when --eval-prompts is 0)."""
    from dflash.evaluate import evaluate_tau

    rc = run.cfg.run
    if rc.eval_prompts == 0:
        return None
    prompts = heldout_prompts(run.heldout_data, rc.eval_prompts, rc.eval_prompt_tokens)
    run.drafter.eval()
    return evaluate_tau(run.target, run.drafter, prompts, rc.eval_new_tokens)


def eval_figures(result: Any | None) -> dict[str, Any]:
    """summary.json fields of an EvalResult (tau None when not evaluated)."""
    if result is None:
        return {"tau": None}
    return {
        "tau": float(result.tau),
        "acceptance_per_position": [float(a) for a in result.acceptance_per_position],
        "tokens_per_target_forward": float(result.tokens_per_target_forward),
    }


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(path)


def finish_run(
    run: Run,
    stats: RunStats,
    log: Callable[[str], None] = print,
    started_s: float | None = None,
    phase: PhaseFn = null_phase,
) -> dict[str, Any]:
    """Final checkpoint and drafter, τ on held-out, summary printed and in summary.json.

    `phase(name)` wraps the checkpoint save and the evaluation (spans of their own)."""
    from dflash.drafter import save_drafter

    with phase("checkpoint.save"):
        save_run_checkpoint(run)
        save_drafter(run.drafter, run.output_dir / "drafter")
    eval_start_s = time.perf_counter()
    with phase("eval"):
        result = evaluate_run(run)
    eval_s = time.perf_counter() - eval_start_s
    last = stats.losses[-1] if stats.losses else run.trainer.last_loss
    wall_s = time.perf_counter() - started_s if started_s is not None else float("nan")
    summary: dict[str, Any] = {
        "steps": run.step,
        "steps_this_run": len(stats.losses),
        "tokens_per_s": stats.num_tokens / stats.train_s if stats.train_s > 0 else 0.0,
        "final_loss": float(last) if last is not None else float("nan"),
        **eval_figures(result),
        "wall_s": wall_s,
        "train_s": stats.train_s,
        "setup_s": run.setup_s,
        "eval_s": eval_s,
        "block_size": run.cfg.drafter.block_size,
        "target": run.cfg.target.spec,
        "target_layer_ids": run.layer_ids,
        "drafter_dir": str(run.output_dir / "drafter"),
    }
    write_json_atomic(run.output_dir / "summary.json", summary)
    write_json_atomic(run.output_dir / "config.json", run.cfg.to_dict())
    log(format_summary(summary))
    return summary


def log_startup(run: Run, log: Callable[[str], None]) -> None:
    """Run line, then the loss line last: issue 5's telemetry line follows it."""
    target_desc = f"{run.cfg.target.spec} layers {run.layer_ids}"
    log(format_run_config(run.cfg, target_desc, str(run.drafter_device)))
    log(format_loss_config(run.cfg))


def train_reference(
    cfg: TrainConfig, log: Callable[[str], None] = print, progress_stream: Any = None
) -> dict[str, Any]:
    """Single-threaded training: target.capture then trainer.step, one batch a step."""
    started_s = time.perf_counter()
    run = build_run(cfg, log)
    log_startup(run, log)
    progress = Progress(cfg.run.steps, run.step, stream=progress_stream, log=None)
    losses: list[float] = []
    num_tokens, train_start_s = 0, time.perf_counter()
    soft = cfg.objective.use_soft_labels
    try:
        while run.step < cfg.run.steps:
            batch = run.train_data.batch(run.next_batch_index)
            with torch.no_grad():
                target_out = run.target.capture(
                    batch.input_ids.to(run.target_device), run.layer_ids, with_logits=soft
                )
            target_out = _to_device(target_out, run.drafter_device)
            result = run.trainer.step(batch.to(run.drafter_device), target_out)
            run.step, run.next_batch_index = run.step + 1, run.next_batch_index + 1
            losses.append(result.loss)
            num_tokens += result.num_tokens
            progress.update(run.step, result.loss, result.num_tokens)
            every = cfg.run.save_every
            if every and run.step % every == 0 and run.step < cfg.run.steps:
                save_run_checkpoint(run)
    finally:
        progress.close()
    stats = RunStats(losses, num_tokens, time.perf_counter() - train_start_s)
    return finish_run(run, stats, log, started_s)


def _to_device(target_out: Any, device: torch.device) -> Any:
    """Move a TargetOutput's tensors (hidden, optional logits) to the drafter device."""
    hidden = target_out.hidden.to(device, non_blocking=True)
    logits = target_out.logits
    if logits is not None:
        logits = logits.to(device, non_blocking=True)
    return type(target_out)(hidden=hidden, logits=logits)


# --------------------------------------------------------------------------- commands


def evaluate_drafter_dir(
    drafter_dir: Path,
    target_spec: str | None,
    data: str,
    num_prompts: int,
    new_tokens: int,
    prompt_tokens: int,
    device: str = "auto",
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """`dflash-train eval`: τ of a saved drafter on held-out prompts of `data`."""
    from dflash.devices import parse_device
    from dflash.drafter import load_drafter
    from dflash.evaluate import evaluate_tau
    from dflash.target import load_target

    if device == "auto":
        dev = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    else:
        dev = parse_device(device, "--device")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    target = load_target(target_spec, dev, dtype, log=log) if target_spec else None
    drafter, target = load_drafter(drafter_dir, target=target, device=dev)
    # Prompts come from the unpacked held-out stream: seq_len and seed do not matter here.
    _, heldout = build_datasets(data, target.tokenizer, max(prompt_tokens, 8), 1, 0)
    prompts = heldout_prompts(heldout, num_prompts, prompt_tokens)
    drafter.eval()
    start_s = time.perf_counter()
    result = evaluate_tau(target, drafter, prompts, new_tokens)
    figures = {
        **eval_figures(result),
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "block_size": drafter.config.block_size,
        "target": target.spec,
        "eval_s": time.perf_counter() - start_s,
    }
    rates = " ".join(f"{r:.2f}" for r in figures["acceptance_per_position"])
    log(f"eval: τ {figures['tau']:.3f} on {len(prompts)} held-out prompts; "
        f"tokens per target forward {figures['tokens_per_target_forward']:.2f}")  # fmt: skip
    log(f"eval: acceptance per block position {rates}")
    return figures


def prepare_target_spec(spec: str, log: Callable[[str], None] = print) -> Path | str:
    """`dflash-train prepare-target`: train/cache builtin:tiny, or load a HF target once."""
    from dflash.target import load_target, prepare_builtin_target

    if spec == "builtin:tiny":
        return prepare_builtin_target(log=log)  # the seed and cache `train` will look for
    target = load_target(spec, torch.device("cpu"), torch.float32)
    log(f"target {spec}: {target.num_layers} layers, hidden size {target.hidden_size}")
    return spec
