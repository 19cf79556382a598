"""Continuing a run: `--resume` from a checkpoint and `--init-from` a drafter directory.

Both are checked before the target loads (minutes for a large one): a checkpoint
continues only the same drafter on the same target and data, a warm start only a
drafter of the shape this run's flags name. What needs the built run (the training
rows' fingerprint, the weights to restore) is checked and done once it exists.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import tracing
from dflash import names
from dflash.config.settings import TrainConfig
from dflash.drafter.io import METADATA_FILE, read_drafter_config
from dflash.drafter.model import DFlashDrafter, DrafterConfig, DrafterError
from dflash.log import Log
from dflash.run.checkpoint import (
    Checkpoint,
    CheckpointError,
    checkpoint_step,
    list_checkpoints,
    load_checkpoint,
    load_trainable_weights,
    resolve_checkpoint,
    restore_rng_state,
)
from dflash.summary import JSON
from dflash.train.step import DrafterTrainer

# What batch i is made of: a resume with another value would continue on other batches.
_RESUMED_DATA_KEYS = (
    "source",
    "seq_len",
    "batch_size",
    "heldout_fraction",
    "packing",
    "chat_rendering",
)


def checkpoint_to_resume(cfg: TrainConfig, output_dir: Path) -> Checkpoint | None:
    """--resume's checkpoint, loaded and checked against this run's settings before
    minutes are spent on the target; None without --resume."""
    if not cfg.run.resume:
        return None
    with tracing.phase(names.RUN_RESUME):
        resume = load_checkpoint(resolve_checkpoint(cfg.run.resume, output_dir))
        _check_resume_compatible(cfg, resume.config, resume.path)
    return resume


def _check_resume_compatible(cfg: TrainConfig, saved: JSON, path: Path) -> None:
    """A checkpoint continues only the same drafter on the same target and data (the
    hidden-state cache may come or go: it holds the same batches' features). A key the
    checkpoint lacks predates its option, whose default keeps the behaviour of then."""
    current, defaults = cfg.to_dict(), TrainConfig().to_dict()
    keys = [(section, key) for section in ("target", "drafter") for key in current[section]]
    if not cfg.run.allow_data_change:
        keys += [("data", key) for key in _RESUMED_DATA_KEYS]
    for section, key in keys:
        value = current[section][key]
        old = saved.get(section, {}).get(key, defaults[section][key])
        if old != value:
            hint = " (--allow-data-change continues on the new data)" if section == "data" else ""
            raise CheckpointError(
                f"--resume {path}: checkpoint has {section}.{key}={old!r}, this run {value!r}"
                + hint
            )


def check_same_data(cfg: TrainConfig, fingerprint: Callable[[], str], checkpoint: Path) -> None:
    """The same data settings may still read other rows (a file edited since): the
    checkpoint's fingerprint of its training rows must match this run's (`fingerprint`:
    hashed only when the checkpoint holds one to compare, since it reads every row)."""
    if cfg.run.allow_data_change:
        return
    try:
        meta = json.loads((checkpoint / "drafter" / METADATA_FILE).read_text())
        saved = meta.get("data_fingerprint")
    except (OSError, ValueError, AttributeError):
        return  # an older checkpoint without one: its settings were checked
    if isinstance(saved, str) and saved != (now := fingerprint()):
        raise CheckpointError(
            f"--resume {checkpoint}: the training rows changed since the checkpoint (data "
            f"fingerprint {saved[:12]}, now {now[:12]}): "
            "--allow-data-change continues on the new data"
        )


def restore(
    resume: Checkpoint, drafter: DFlashDrafter, trainer: DrafterTrainer, output_dir: Path, log: Log
) -> None:
    """The checkpoint's drafter weights, trainer state and random state; said, with the
    later checkpoints this continuation replaces."""
    load_trainable_weights(drafter, resume.weights)
    trainer.load_state_dict(resume.trainer_state)
    restore_rng_state(resume.rng_state)
    log(f"resumed from {resume.path} at step {resume.step}")
    checkpoints = list_checkpoints(output_dir / "checkpoints")
    later = [p.name for p in checkpoints if checkpoint_step(p) > resume.step]
    if later:
        log(
            f"checkpoints of later steps ({', '.join(later)}) are of the continuation "
            "abandoned here: this run's own replace them as it writes them"
        )


def check_init_settings(cfg: TrainConfig, saved: DrafterConfig, where: str) -> None:
    """Before the target loads: a warm start's drafter against what this run's flags name."""
    pairs: list[tuple[str, str, object, object]] = [
        ("--drafter-layers", "num_hidden_layers", saved.num_layers, cfg.drafter.num_layers)
    ]
    named = (  # (flag, the saved config's key and attribute, this run's value or None)
        ("--target-layers", "target_layer_ids", cfg.target.layer_ids),
        ("--drafter-intermediate-size", "intermediate_size", cfg.drafter.intermediate_size),
        ("--mask-token-id", "mask_token_id", cfg.drafter.mask_token_id),
        ("--draft-vocab-size", "draft_vocab_size", cfg.drafter.draft_vocab_size),
    )
    for flag, key, value in named:
        if value is not None:
            pairs.append((flag, key, getattr(saved, key), value))
    for flag, key, theirs, ours in pairs:
        ours = list(ours) if isinstance(ours, tuple) else ours
        if theirs != ours:
            shown = ",".join(map(str, ours)) if isinstance(ours, list) else ours
            raise DrafterError(
                f"--init-from {where}: it has {key} {theirs}, this run {flag} {shown}"
            )


def warm_start(cfg: TrainConfig, resuming: bool) -> tuple[Path, DrafterConfig] | None:
    """The --init-from directory and its config, read before the target loads. A resumed
    run continues its checkpoint, whose weights already descend from the warm start."""
    if cfg.run.init_from is None or resuming:
        return None
    where = Path(cfg.run.init_from).expanduser()
    saved = read_drafter_config(where)
    check_init_settings(cfg, saved, str(where))
    return where, saved
