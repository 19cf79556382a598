"""Building a run: target, data, drafter and trainer on this process's `Placement`.

`open_target` is the opening `train` and `cache-hidden` share: the target loaded,
its chat-template arguments and its position limit; the rows are then
`dflash.run.rows.training_rows`'. `build_run` opens the run's feature source on it
(dflash.run.features), adds the drafter and its trainer, restores `--resume` or
warm-starts from `--init-from`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

import tracing
from dflash import names
from dflash.config.devices import Placement
from dflash.config.settings import TrainConfig
from dflash.data.datasets import PackedDataset
from dflash.drafter.init import start_from_target
from dflash.drafter.io import check_fits_target, init_drafter_from
from dflash.drafter.model import DFlashDrafter, DrafterConfig
from dflash.drafter.vocab import DraftVocab, check_draft_vocab_size, select_draft_vocab
from dflash.log import Log, say
from dflash.run.engine import check_vllm_command
from dflash.run.evaluations import TrainingEvals
from dflash.run.features import feature_plan
from dflash.run.progress import live_log
from dflash.run.resume import check_same_data, checkpoint_to_resume, restore, warm_start
from dflash.run.rows import rows_before_target, training_rows
from dflash.run.size_checks import check_seq_len, check_sizes_before_work
from dflash.run.target_features import FeatureSource
from dflash.target import load as target_load  # by module: tests swap load_target
from dflash.target.model import MaskToken, TargetModel, frozen_parts, last_layer_warning
from dflash.train.step import DrafterTrainer, PhaseFn, null_phase


@dataclass
class Run:
    """Everything a training run is built from, and where its loop stands."""

    cfg: TrainConfig
    target: TargetModel
    drafter: DFlashDrafter
    trainer: DrafterTrainer
    train_data: PackedDataset
    heldout_data: PackedDataset
    layer_ids: list[int]
    placement: Placement
    output_dir: Path
    features: FeatureSource  # where the target's features come from
    step: int = 0
    next_batch_index: int = 0
    setup_s: float = 0.0
    resumed_from: Path | None = None
    initialized_from: Path | None = None
    final_saved: bool = False  # the final checkpoint and OUTPUT_DIR/drafter are written
    evals: TrainingEvals | None = None  # τ while training (--eval-every)
    eval_target: TargetModel | None = None  # --eval-dtype's copy; None: `target` decodes
    _fingerprint: str | None = None

    @property
    def decoding_target(self) -> TargetModel:
        """The target evaluations decode with (--eval-dtype)."""
        return self.target if self.eval_target is None else self.eval_target

    @property
    def data_fingerprint(self) -> str:
        """The training rows' fingerprint (hashed once: it reads every row)."""
        if self._fingerprint is None:
            self._fingerprint = self.train_data.fingerprint()
        return self._fingerprint

    @property
    def mask_token(self) -> MaskToken:
        config = self.drafter.config
        chosen = self.target.data_mask_token
        if chosen is not None and chosen.token_id == config.mask_token_id:
            return chosen  # with its text
        return MaskToken(config.mask_token_id, config.mask_token_source)

    @property
    def drafter_device(self) -> torch.device:
        return self.placement.drafter


def build_drafter(
    cfg: TrainConfig,
    target: TargetModel,
    layer_ids: list[int],
    device: torch.device,
    draft_vocab: DraftVocab | None = None,
) -> DFlashDrafter:
    """A freshly initialized drafter (seeded by --seed) sharing the target's frozen parts."""
    dcfg = DrafterConfig.for_target(
        target,
        num_layers=cfg.drafter.num_layers,
        block_size=cfg.drafter.block_size,
        target_layer_ids=list(layer_ids),
        intermediate_size=cfg.drafter.intermediate_size,
        mask_token_id=cfg.drafter.mask_token_id,
        draft_vocab_size=draft_vocab.size if draft_vocab is not None else 0,
    )
    # The drafter's own copy of the frozen parts when the target sits elsewhere (another
    # GPU, or the CPU with --hidden-cache): its forward must not cross devices.
    parts = frozen_parts(target, device)
    return drafter_on(dcfg, parts, device, draft_vocab, seed=cfg.run.seed)


def drafter_on(
    config: DrafterConfig,
    frozen: tuple[torch.nn.Module, torch.nn.Module],
    device: torch.device,
    draft_vocab: DraftVocab | None = None,
    seed: int | None = None,
) -> DFlashDrafter:
    """The one construction of a drafter: `config` over the `frozen` (embedding, LM head)
    it shares, on `device`. Its initialization draws from a forked RNG (seeded by `seed`,
    else the current state), so building a replica never moves the run's random stream;
    replicas are then given replica 0's weights."""
    embed, head = frozen
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        drafter = DFlashDrafter(config, embed, head, draft_vocab)
    return drafter.to(device)


def eval_target_copy(
    cfg: TrainConfig, target: TargetModel, device: torch.device, log: Log
) -> TargetModel | None:
    """--eval-dtype other than the dtype the target trains in: a copy of it in that dtype,
    for the evaluations alone (None: the run's target decodes)."""
    wanted = cfg.run.eval_dtype
    if wanted == "auto" or not cfg.run.eval_prompts:
        return None
    dtype = getattr(torch, wanted)
    if target.embed_tokens.weight.dtype == dtype:
        return None
    copy = target_load.load_target(cfg.target.spec, device, dtype, log=lambda _: None)
    copy.use_chat_template_kwargs(target.chat_template_kwargs)
    log(
        f"evaluation: the target decodes in {wanted} (--eval-dtype; it trains in "
        f"{str(target.embed_tokens.weight.dtype).removeprefix('torch.')}): a second copy"
    )
    return copy


def check_draft_vocab(cfg: TrainConfig, target: TargetModel) -> None:
    """--draft-vocab-size against the loaded target, before the data."""
    size = cfg.drafter.draft_vocab_size
    if size is not None:
        # The mask token may be chosen from the data later: it counts as one more id.
        check_draft_vocab_size(size, target.embed_tokens.num_embeddings, target.stop_token_ids)


def choose_draft_vocab(
    cfg: TrainConfig, target: TargetModel, train: PackedDataset, log: Log
) -> DraftVocab | None:
    """--draft-vocab-size: the most frequent tokens of the training labels, said at start."""
    size = cfg.drafter.draft_vocab_size
    vocab_size = target.embed_tokens.num_embeddings
    if size is None or size == vocab_size:
        return None
    mask_id = target.mask_token(cfg.drafter.mask_token_id).token_id
    vocab = select_draft_vocab(
        train.ids, train.mask, size, vocab_size, (mask_id, *target.stop_token_ids)
    )
    log(vocab.describe())
    return vocab


def check_target_fits(cfg: TrainConfig, target: TargetModel) -> None:
    """The loaded target's position limit (a hub target's is known only now)."""
    check_seq_len(cfg, target.max_positions)


def open_target(
    cfg: TrainConfig,
    device: torch.device,
    log: Log,
    *,
    load_on: torch.device,
    head_only: bool = False,
    cast: bool = False,
    checks: Callable[[TargetModel], None] | None = None,
    phase: PhaseFn = null_phase,
) -> TargetModel:
    """The target as `train` and `cache-hidden` read rows with it. It loads on `load_on`
    (`head_only`: its embedding, LM head and final norm alone) in the dtype --precision
    gives on `device`, where it computes (`cast`: the dtype for its width, once loaded:
    a cache's states keep the dtype they were written in); then its chat-template
    arguments, its position limit and the caller's `checks` against it."""
    dtype = target_load.target_dtype(device, cfg.pipeline.precision)
    with phase(names.TARGET_LOAD):
        target = target_load.load_target(
            cfg.target.spec, load_on, dtype, log=live_log(log), head_only=head_only
        )
        if cast:
            target_load.run_precision(target, cfg.pipeline.precision, device)
    target.use_chat_template_kwargs(cfg.target.parsed_chat_template_kwargs, log)
    check_target_fits(cfg, target)
    if checks is not None:
        checks(target)
    return target


def build_run(cfg: TrainConfig, placement: Placement, log: Log = say) -> Run:
    """Target, data, drafter and trainer for `cfg` on `placement`; restores `--resume`
    or warm-starts from `--init-from`."""
    start_s = time.perf_counter()
    output_dir = Path(cfg.run.output_dir)
    resume = checkpoint_to_resume(cfg, output_dir)  # before minutes on the target
    init_from = warm_start(cfg, resuming=resume is not None)
    check_sizes_before_work(cfg, placement.drafter)
    if cfg.run.eval_engine == "vllm" and cfg.run.eval_prompts:
        check_vllm_command(cfg.run.vllm_command)  # not after hours of training
    plan = feature_plan(cfg)
    with tracing.phase(names.DATA_PREPARE):
        before_target = rows_before_target(cfg, plan, log)

    def checks(target: TargetModel) -> None:
        check_draft_vocab(cfg, target)
        # A bad explicit id fails here, before the data; none at all is chosen from the data.
        target.needs_mask_from_data(cfg.drafter.mask_token_id)
        if init_from is not None:
            check_fits_target(init_from[1], target, f"--init-from {init_from[0]}")

    # A target that never runs while training keeps its weights in host memory (the
    # drafter copies the embedding and LM head it shares) until the final evaluation.
    target = open_target(
        cfg,
        placement.target,
        log,
        load_on=plan.load_device(placement),
        head_only=plan.head_only,
        cast=plan.runs_target,
        checks=checks,
        phase=tracing.phase,
    )
    with tracing.phase(names.DATA_PREPARE):  # per-sample files read their rows as they open
        features = plan.open(target, log)
    layer_ids = features.layer_ids
    warning = last_layer_warning(layer_ids, target.num_layers)
    if warning is not None:
        log(warning)
    with tracing.phase(names.DATA_PREPARE):
        train, heldout = training_rows(cfg, target, log, features, before_target)
    with tracing.phase(names.DRAFTER_BUILD):
        vocab = choose_draft_vocab(cfg, target, train, log)
        drafter = build_drafter(cfg, target, layer_ids, placement.drafter, vocab)
        if cfg.drafter.init == "target" and init_from is None and resume is None:
            copied = start_from_target(drafter, target)
            which = f"layers {copied[0]}-{copied[-1]}" if len(copied) > 1 else f"layer {copied[0]}"
            log(
                f"drafter: starts as the target's {which} (of "
                f"{target.num_layers}), its final norm, and a fusion passing layer "
                f"{layer_ids[-1]} through (--drafter-init target)"
            )
        trainer = DrafterTrainer(drafter, cfg, placement.drafter)
    run = Run(
        cfg, target, drafter, trainer, train, heldout, layer_ids, placement, output_dir, features
    )
    skipped = features.eval_skipped(target)
    if skipped is None:
        run.eval_target = eval_target_copy(cfg, target, placement.target, log)
    evaluated = run.decoding_target
    run.evals = TrainingEvals.for_run(cfg.run, evaluated, drafter, heldout, skipped, layer_ids)
    log(run.mask_token.describe())
    if init_from is not None:
        init_drafter_from(drafter, init_from[0])
        run.initialized_from = init_from[0]
        log(f"drafter initialized from {init_from[0]}")
    if resume is not None:
        check_same_data(cfg, lambda: run.data_fingerprint, resume.path)
        run.step, run.next_batch_index = resume.step, resume.next_batch_index
        run.resumed_from = resume.path
        restore(resume, drafter, trainer, output_dir, log)
    run.setup_s = time.perf_counter() - start_s
    return run
