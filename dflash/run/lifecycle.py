"""The life of a training run: start, build (and resume), checkpoints, the end.

`start_run` is the one place a process decides its rank and devices, locks the output
folder and joins the process group (config.json is written by `Start.begin_training`,
once every check has passed); `build_run` assembles target, data, drafter and trainer
on that `Placement`, the features from the one `FeatureSource` (dflash.run.features);
`complete_run` saves and evaluates at the end; `build_summary` is the one place the
summary (summary.json) is made, for a finished run and for an interrupted one alike.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import tracing
from dflash import names
from dflash.config.devices import Placement, decide_placement
from dflash.config.settings import TrainConfig
from dflash.data.chat import use_template_kwargs as use_chat_kwargs
from dflash.data.corpus import EMBEDDED
from dflash.data.datasets import (
    PackedDataset,
    build_datasets,
    datasets_from_corpus,
    heldout_prompts,
)
from dflash.data.sources import DataError
from dflash.data.tokenizer import Tokenizer
from dflash.drafter.io import (
    METADATA_FILE,
    check_fits_target,
    init_drafter_from,
    pruned_head_note,
    read_drafter_config,
    save_drafter,
)
from dflash.drafter.model import DFlashDrafter, DrafterConfig, DrafterError
from dflash.drafter.vocab import DraftVocab, check_draft_vocab_size, select_draft_vocab
from dflash.eval.evaluate import eval_figures, evaluate_run
from dflash.files import write_json_atomic
from dflash.log import Log, say
from dflash.offline.regenerate import embedded_regeneration, regenerated_corpus
from dflash.pipeline.distributed import DistInfo, dist_info_from_env, init_distributed
from dflash.run.checkpoint import (
    SAVE_FAILURES,
    CheckpointError,
    checkpoint_step,
    list_checkpoints,
    load_checkpoint,
    load_trainable_weights,
    replace_dir,
    resolve_checkpoint,
    restore_rng_state,
    save_checkpoint,
    save_failure,
)
from dflash.run.engine import check_vllm_command, measure_with_vllm
from dflash.run.estimate import check_seq_len, check_sizes_before_work, estimate_for_config
from dflash.run.evaluations import TrainingEvals, eval_keys, trainable_weights
from dflash.run.features import FeatureSource, feature_source
from dflash.run.folder import METRICS_FILE, FolderLock, claim_output_dir, write_run_start
from dflash.run.outputs import check_run_folder
from dflash.run.progress import (
    HeldLog,
    format_loss_config,
    format_run_config,
    format_summary,
    live_log,
)
from dflash.target import load as target_load  # by module: tests swap load_target
from dflash.target.geometry import TargetError
from dflash.target.model import (
    MaskToken,
    TargetModel,
    check_mask_token_unused,
    frozen_parts,
    last_layer_warning,
)
from dflash.target.served import TokenizerTarget
from dflash.train.optim import DivergedError
from dflash.train.step import DrafterTrainer, PhaseFn, null_phase
from dflash.train.step_metrics import amend_line


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
    _fingerprint: str | None = None

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
    def target_device(self) -> torch.device:
        return self.placement.target

    @property
    def drafter_device(self) -> torch.device:
        return self.placement.drafter


@dataclass
class RunStats:
    """What the loop measured; `build_summary` turns it into the summary."""

    losses: list[float]
    num_tokens: int
    train_s: float


@dataclass(frozen=True)
class Start:
    """Where this process stands in a run, decided once: its rank, its devices and (rank
    0) the lock on the output folder, held until `end`."""

    info: DistInfo
    placement: Placement
    lock: FolderLock | None = None

    def begin_training(self, cfg: TrainConfig, log: Log) -> None:
        """Every check has passed: rank 0 writes the run's start into its folder."""
        if self.info.is_main:
            write_run_start(cfg, log)

    def end(self) -> None:
        if self.lock is not None:
            self.lock.release()


def start_run(cfg: TrainConfig, info: DistInfo | None = None) -> Start:
    """Once per run and process: the rank (torchrun's variables unless `info` is given),
    the rank's devices, the output folder's lock (rank 0: a folder that cannot be written,
    is in use or holds another run is named before anything else; nothing is written into
    it yet) and the process group."""
    info = dist_info_from_env() if info is None else info
    placement = decide_placement(cfg.pipeline, info.local_rank, info.local_world_size)
    if info.is_main:
        check_run_folder(cfg)  # no input, and inside no other run, before anything is made
    lock = claim_output_dir(cfg) if info.is_main else None
    try:
        init_distributed(info, placement.drafter)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return Start(info, placement, lock)


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
    embed, head = frozen_parts(target, device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.run.seed)
        drafter = DFlashDrafter(dcfg, embed, head, draft_vocab)
    return drafter.to(device)


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


def use_template_kwargs(target: TargetModel, kwargs: dict[str, Any], log: Log) -> None:
    """--chat-template-kwargs for every rendering of a conversation, said at start."""
    if not kwargs:
        return
    target.use_chat_template_kwargs(kwargs)
    if getattr(target.tokenizer, "chat_template", None):
        log(f"chat template arguments: {json.dumps(kwargs, sort_keys=True)}")
    else:
        why = "no chat template (conversations are rendered as documented)"
        log(f"chat template arguments {json.dumps(kwargs)} unused: target {target.spec} has {why}")


def check_target_fits(cfg: TrainConfig, target: TargetModel) -> None:
    """The loaded target's position limit (a hub target's is known only now)."""
    check_seq_len(cfg, target.max_positions)


# What batch i is made of: a resume with another value would continue on other batches.
_RESUMED_DATA_KEYS = (
    "source",
    "seq_len",
    "batch_size",
    "heldout_fraction",
    "packing",
    "chat_rendering",
)


def _check_resume_compatible(cfg: TrainConfig, saved: dict[str, Any], path: Path) -> None:
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


def _check_same_data(cfg: TrainConfig, run: Run, checkpoint: Path) -> None:
    """The same data settings may still read other rows (a file edited since): the
    checkpoint's fingerprint of its training rows must match this run's."""
    if cfg.run.allow_data_change:
        return
    try:
        meta = json.loads((checkpoint / "drafter" / METADATA_FILE).read_text())
        saved = meta.get("data_fingerprint")
    except (OSError, ValueError, AttributeError):
        return  # an older checkpoint without one: its settings were checked
    if isinstance(saved, str) and saved != run.data_fingerprint:
        raise CheckpointError(
            f"--resume {checkpoint}: the training rows changed since the checkpoint (data "
            f"fingerprint {saved[:12]}, now {run.data_fingerprint[:12]}): "
            "--allow-data-change continues on the new data"
        )


def check_init_settings(cfg: TrainConfig, saved: DrafterConfig, where: str) -> None:
    """Before the target loads: a warm start's drafter against what this run's flags name."""
    pairs: list[tuple[str, str, Any, Any]] = [
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


def _warm_start(cfg: TrainConfig, resuming: bool) -> tuple[Path, DrafterConfig] | None:
    """The --init-from directory and its config, read before the target loads. A resumed
    run continues its checkpoint, whose weights already descend from the warm start."""
    if cfg.run.init_from is None or resuming:
        return None
    where = Path(cfg.run.init_from).expanduser()
    saved = read_drafter_config(where)
    check_init_settings(cfg, saved, str(where))
    return where, saved


@dataclass
class EarlyRows:
    """A data file's rows, built from the target's tokenizer before its weights load."""

    train: PackedDataset
    heldout: PackedDataset
    held: HeldLog  # the data's report, printed once the mask token is chosen too


def rows_before_target(
    cfg: TrainConfig, features: FeatureSource, log: Log = say
) -> EarlyRows | None:
    """Data that cannot train (no learnable tokens, most conversations dropped, an
    explicit mask id it uses) is refused before the target's weights load, minutes for a
    large one: a data file's rows need only the tokenizer. None where the rows need the
    target itself (`--data embedded`: its own continuations; per-sample hidden states) or
    its tokenizer does not load alone (the target's own load then says why)."""
    d = cfg.data
    if d.source == EMBEDDED or features.has_rows:
        return None
    try:
        tokenizer = target_load.load_tokenizer(cfg.target.spec)
    except TargetError:
        return None
    use_chat_kwargs(tokenizer, cfg.target.template_kwargs)
    held = HeldLog(log)
    train, heldout = _file_rows(cfg, tokenizer, held)
    if cfg.drafter.mask_token_id is not None:
        check_mask_token_unused(cfg.drafter.mask_token_id, (train.ids, heldout.ids, heldout.stream))
    check_trainable(train, cfg)
    return EarlyRows(train, heldout, held)


def run_datasets(
    cfg: TrainConfig,
    target: TargetModel,
    log: Log = say,
    features: FeatureSource | None = None,
    early: EarlyRows | None = None,
) -> tuple[PackedDataset, PackedDataset]:
    """Train and held-out rows of a run (`cache-hidden` cuts its batches the same way);
    an explicit mask token the data uses is refused here. `--data embedded` trains on
    the target's own continuations of the corpus (regenerated once, cached); `features`
    that hold rows (per-sample hidden-state files) give them; `early` rows were built
    before the target loaded (`rows_before_target`)."""
    d, tok = cfg.data, target.tokenizer
    rows = d.batch_size * cfg.optim.grad_accum  # the step splits it into micro-batches
    held = HeldLog(log)  # the data's report, once the data can train: else the Error alone
    if early is not None:
        train, heldout, held = early.train, early.heldout, early.held
    elif features is not None and features.has_rows:
        train, heldout = features.rows(target, rows, held)
    elif d.source == EMBEDDED:
        with tracing.phase(names.DATA_REGENERATE):
            path = embedded_regeneration(target, d.heldout_fraction, live_log(log))
        corpus = regenerated_corpus(path, tok, d.heldout_fraction)
        seed = cfg.run.seed
        train, heldout = datasets_from_corpus(
            corpus, tok, d.seq_len, rows, seed, d.heldout_fraction, packing=d.packing, log=held
        )
    else:
        train, heldout = _file_rows(cfg, tok, held)
    if cfg.drafter.mask_token_id is not None:
        check_mask_token_unused(cfg.drafter.mask_token_id, (train.ids, heldout.ids, heldout.stream))
    elif target.needs_mask_from_data(None):
        target.choose_mask_from_data((train.ids, heldout.ids, heldout.stream))
    check_trainable(train, cfg)
    held.release()
    return train, heldout


def _file_rows(
    cfg: TrainConfig, tokenizer: Tokenizer, log: Log
) -> tuple[PackedDataset, PackedDataset]:
    """The data file's (train, held-out) rows, in batches of --batch-size x --grad-accum."""
    d = cfg.data
    rows = d.batch_size * cfg.optim.grad_accum  # the step splits it into micro-batches
    options = {"packing": d.packing, "keep_cut": d.keep_cut_replies, "rendering": d.chat_rendering}
    return build_datasets(
        d.source, tokenizer, d.seq_len, rows, cfg.run.seed, d.heldout_fraction, log=log, **options
    )


def check_trainable(train: PackedDataset, cfg: TrainConfig) -> None:
    """Data that cannot train stops the run before step 1: a run whose rows hold no
    position to learn from trains with loss 0 and exits 0; one that dropped most of its
    conversations learns from a few."""
    pack, seq_len = train.report.pack, cfg.data.seq_len
    if pack.documents and pack.dropped_chats / pack.documents > cfg.data.max_dropped_share:
        raise DataError(
            f"--seq-len {seq_len} drops {pack.dropped_chats} of {pack.documents} conversations "
            "(their first reply does not fit a row): raise --seq-len, or --max-dropped-share "
            f"{pack.dropped_chats / pack.documents:.2f} to train on the rest"
        )
    mask = train.mask
    if not (mask[:, :-1] & mask[:, 1:]).any():  # an anchor and its next token both learnable
        raise DataError(
            f"no training row has two learnable tokens in a row at --seq-len {seq_len}: every "
            "loss position is masked (prompts only, or replies cut off); check the data "
            "or raise --seq-len"
        )


def build_run(cfg: TrainConfig, placement: Placement, log: Log = say) -> Run:
    """Target, data, drafter and trainer for `cfg` on `placement`; restores `--resume`
    or warm-starts from `--init-from`."""
    start_s = time.perf_counter()
    output_dir = Path(cfg.run.output_dir)
    resume = None
    if cfg.run.resume:  # check the checkpoint before spending minutes on the target
        with tracing.phase(names.RUN_RESUME):
            resume = load_checkpoint(resolve_checkpoint(cfg.run.resume, output_dir))
            _check_resume_compatible(cfg, resume.config, resume.path)
    warm = _warm_start(cfg, resuming=resume is not None)
    check_sizes_before_work(cfg, placement.drafter)
    if cfg.run.eval_engine == "vllm" and cfg.run.eval_prompts:
        check_vllm_command(cfg.run.vllm_command)  # not after hours of training
    dtype = target_load.target_dtype(placement.target, cfg.pipeline.precision)
    features = feature_source(cfg)
    with tracing.phase(names.DATA_PREPARE):
        early = rows_before_target(cfg, features, log)
    # A target that never runs while training keeps its weights in host memory (the
    # drafter copies the embedding and LM head it shares) until the final evaluation.
    load_on, head_only = features.load_device(placement), features.head_only
    with tracing.phase(names.TARGET_LOAD):
        target = target_load.load_target(
            cfg.target.spec, load_on, dtype, log=live_log(log), head_only=head_only
        )
        if features.runs_target:  # a cache's states keep the dtype they were written in
            target_load.run_precision(target, cfg.pipeline.precision, placement.target)
    use_template_kwargs(target, cfg.target.template_kwargs, log)
    check_target_fits(cfg, target)
    check_draft_vocab(cfg, target)
    # A bad explicit id fails here, before the data; none at all is chosen from the data.
    target.needs_mask_from_data(cfg.drafter.mask_token_id)
    if warm is not None:
        check_fits_target(warm[1], target, f"--init-from {warm[0]}")
    features.open(target, log)
    layer_ids = features.layer_ids(target)
    warning = last_layer_warning(layer_ids, target.num_layers)
    if warning is not None:
        log(warning)
    with tracing.phase(names.DATA_PREPARE):
        train, heldout = run_datasets(cfg, target, log, features, early)
    with tracing.phase(names.DRAFTER_BUILD):
        vocab = choose_draft_vocab(cfg, target, train, log)
        drafter = build_drafter(cfg, target, layer_ids, placement.drafter, vocab)
        trainer = DrafterTrainer(drafter, cfg, placement.drafter)
    run = Run(
        cfg, target, drafter, trainer, train, heldout, layer_ids, placement, output_dir, features
    )
    skipped = features.eval_skipped(target)
    run.evals = TrainingEvals.for_run(cfg.run, target, drafter, heldout, skipped, layer_ids)
    log(run.mask_token.describe())
    if warm is not None:
        init_drafter_from(drafter, warm[0])
        run.initialized_from = warm[0]
        log(f"drafter initialized from {warm[0]}")
    if resume is not None:
        _check_same_data(cfg, run, resume.path)
        load_trainable_weights(drafter, resume.weights)
        trainer.load_state_dict(resume.trainer_state)
        restore_rng_state(resume.rng_state)
        run.step, run.next_batch_index = resume.step, resume.next_batch_index
        run.resumed_from = resume.path
        log(f"resumed from {resume.path} at step {resume.step}")
        checkpoints = list_checkpoints(output_dir / "checkpoints")
        later = [p.name for p in checkpoints if checkpoint_step(p) > resume.step]
        if later:
            log(
                f"checkpoints of later steps ({', '.join(later)}) are of the continuation "
                "abandoned here: this run's own replace them as it writes them"
            )
    run.setup_s = time.perf_counter() - start_s
    return run


def save_drafter_dir(run: Run, directory: Path, dtype: torch.dtype | None = None) -> Path:
    """The standard DFlash directory of the run's drafter, with the run's metadata;
    weights in `dtype` (None: as trained)."""
    extra: dict[str, Any] = {"step": run.step}
    if run.initialized_from is not None:
        extra["initialized_from"] = str(run.initialized_from)
    provenance = {"training_config": run.cfg.to_dict(), "data_fingerprint": run.data_fingerprint}
    return save_drafter(run.drafter, directory, **provenance, extra=extra, dtype=dtype)


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


def complete_run(
    run: Run, phase: PhaseFn = null_phase, log: Log = say
) -> tuple[dict[str, Any], float]:
    """Final checkpoint and drafter, then τ on held-out: (its figures, seconds spent).
    The evaluation joins the last step's metrics.jsonl line; with --keep-best a better
    drafter of an evaluation while training then replaces OUTPUT_DIR/drafter."""
    with phase(names.CHECKPOINT_SAVE):
        save_final(run, log)
    figures, eval_s = _final_evaluation(run, phase, log)
    if run.evals is not None:
        final = eval_keys(figures)
        if final:
            run.evals.record(run.step, final, final=True)
            amend_line(run.output_dir / METRICS_FILE, run.step, final)
        keep_best(run, log)
    return figures, eval_s


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


def _final_evaluation(run: Run, phase: PhaseFn, log: Log) -> tuple[dict[str, Any], float]:
    """τ on the held-out prompts at the end: in process or by vLLM."""
    eval_start_s = time.perf_counter()
    if run.cfg.run.eval_engine == "vllm" and run.cfg.run.eval_prompts:
        with phase(names.EVAL):
            figures = _measure_with_vllm(run, log)
        return figures, time.perf_counter() - eval_start_s
    skipped = run.features.eval_skipped(run.target)
    if skipped is not None:
        return {"tau": None, "eval_skipped": skipped}, 0.0
    with phase(names.EVAL):
        if run.cfg.run.eval_prompts and run.target.device != run.placement.target:
            run.target.to(run.placement.target)  # kept on the host while training from a cache
        result = evaluate_run(run.target, run.drafter, run.heldout_data, run.cfg.run)
    return eval_figures(result), time.perf_counter() - eval_start_s


def _measure_with_vllm(run: Run, log: Log) -> dict[str, Any]:
    """--eval-engine vllm: τ on the held-out prompts as vLLM serves the saved drafter."""
    cfg = run.cfg.run
    prompts = heldout_prompts(run.heldout_data, cfg.eval_prompts, cfg.eval_prompt_tokens)
    target = TokenizerTarget(run.cfg.target.spec, run.target.tokenizer)
    engine = {
        "drafter_dir": run.output_dir / "drafter",
        "block_size": run.drafter.config.block_size,
        "max_new_tokens": cfg.eval_new_tokens,
        "stop_token_ids": tuple(run.target.stop_token_ids),
        "log_dir": run.output_dir,
    }
    served = measure_with_vllm(cfg.vllm_command, target, prompts=prompts, log=log, **engine)
    figures = {key: served[key] for key in ("tau", "tau_pooled", "acceptance_per_position")}
    return {**figures, "speedup": None, "served": served}


def build_summary(
    run: Run,
    stats: RunStats,
    started_s: float,
    *,
    evaluation: tuple[dict[str, Any], float] | None = None,
    interrupted: str | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """summary.json of a finished (`evaluation` given) or interrupted run."""
    last = stats.losses[-1] if stats.losses else run.trainer.last_loss
    figures, eval_s = evaluation if evaluation is not None else ({"tau": None}, None)
    summary: dict[str, Any] = {
        "steps": run.step,
        "steps_this_run": len(stats.losses),
        "tokens_per_s": stats.num_tokens / stats.train_s if stats.train_s > 0 else 0.0,
        # None (JSON null), not NaN, when no step finished or the loss is not finite:
        # summary.json stays JSON.
        "final_loss": _finite_or_none(last),
        **figures,
        **_while_training(run, stats),
        "wall_s": time.perf_counter() - started_s,
        "train_s": stats.train_s,
        "setup_s": run.setup_s,
        "eval_s": eval_s,
        "bad_steps": run.trainer.guard.bad_steps,  # non-finite steps skipped (no update)
        "block_size": run.drafter.config.block_size,
        "target": run.cfg.target.spec,
        "target_layer_ids": run.layer_ids,
        "mask_token_id": run.mask_token.token_id,
        "mask_token_source": run.mask_token.source,
        "packing": run.cfg.data.packing,
        "initialized_from": None if run.initialized_from is None else str(run.initialized_from),
        "drafter_dir": str(run.output_dir / "drafter") if run.final_saved else None,
        "tau_estimate": _last_tau_estimate(run.output_dir / METRICS_FILE),
    }
    summary.update(run.features.summary())
    if interrupted is not None:
        summary["interrupted"] = interrupted
    return {**summary, **(extra or {})}


def _while_training(run: Run, stats: RunStats) -> dict[str, Any]:
    """summary.json's record of the evaluations while training, and which step's drafter
    OUTPUT_DIR/drafter holds."""
    if run.evals is None:
        return {}
    out = {"evaluations_while_training": run.evals.summary(stats.train_s)}
    best = run.evals.best
    if run.cfg.run.keep_best and best is not None:
        out["drafter_step"] = best.step if best.weights is not None else run.step
    return out


def _last_tau_estimate(path: Path) -> float | None:
    """The τ estimate of the last logged step (metrics.jsonl), to set beside the eval τ."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
        value = json.loads(lines[-1]).get("tau_estimate") if lines else None
    except (OSError, ValueError, AttributeError):
        return None
    return _finite_or_none(value) if isinstance(value, (int, float)) else None


def _finite_or_none(value: Any) -> float | None:
    if value is None:
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def write_summary(run: Run, summary: dict[str, Any], log: Log) -> None:
    write_json_atomic(run.output_dir / "summary.json", summary)
    log(format_summary(summary))


def finish_run(
    run: Run,
    stats: RunStats,
    log: Log = say,
    started_s: float | None = None,
    phase: PhaseFn = null_phase,
) -> dict[str, Any]:
    """complete_run, then the summary printed and in summary.json."""
    evaluation = complete_run(run, phase, log)
    started = started_s if started_s is not None else time.perf_counter()
    summary = build_summary(run, stats, started, evaluation=evaluation)
    write_summary(run, summary, log)
    return summary


def log_startup(run: Run, log: Log, devices: str, telemetry_line: str | None = None) -> None:
    """The loss line, the telemetry line (when traced), then the run line."""
    log(format_loss_config(run.cfg))
    if telemetry_line is not None:
        log(telemetry_line)
    log(format_run_config(run.cfg, f"{run.cfg.target.spec} layers {run.layer_ids}", devices))
    log(run.trainer.precision_text)
    for line in estimate_for_config(run.cfg, run.target.geometry, run.placement.drafter):
        log(line)  # and a warning when it exceeds the device's memory: before the first step
