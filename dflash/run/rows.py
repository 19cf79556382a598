"""A run's training rows: `training_rows`, the one way `train` and `cache-hidden` cut
their batches, so that a cache's batch i is the run's batch i.

The rows come from the data file, from the target's own continuations (`--data
embedded`) or from per-sample hidden-state files, in batches of --batch-size x
--grad-accum; data that cannot train is refused before step 1. A data file's rows need
only the target's tokenizer: `rows_before_target` reads and checks them before the
target's weights load, and `training_rows` then takes them as they are.
"""

from __future__ import annotations

import tracing
from dflash import names
from dflash.config.settings import TrainConfig
from dflash.data.chat import use_chat_template_kwargs
from dflash.data.corpus import EMBEDDED
from dflash.data.datasets import PackedDataset, datasets_from_corpus, load_corpus
from dflash.data.sources import DataError
from dflash.data.tokenizer import Tokenizer
from dflash.log import Log, say
from dflash.offline.regenerate import embedded_regeneration, regenerated_corpus
from dflash.run.progress import BufferedLog, live_log
from dflash.run.target_features import FeaturePlan, FeatureSource, HeldRows
from dflash.target import load as target_load  # by module: tests swap load_target
from dflash.target.geometry import TargetError
from dflash.target.model import TargetModel, check_mask_token_unused


def rows_before_target(cfg: TrainConfig, features: FeaturePlan, log: Log = say) -> HeldRows | None:
    """Data that cannot train (no learnable tokens, most conversations dropped, an
    explicit mask id it uses) is refused before the target's weights load, minutes for a
    large one: a data file's rows need only the tokenizer. None where the rows need the
    target itself (`--data embedded`: its own continuations; per-sample hidden states) or
    its tokenizer does not load alone (the target's own load then says why)."""
    if cfg.data.source == EMBEDDED or features.has_rows:
        return None
    try:
        tokenizer = target_load.load_tokenizer(cfg.target.spec)
    except TargetError:
        return None
    use_chat_template_kwargs(tokenizer, cfg.target.parsed_chat_template_kwargs)
    held = BufferedLog(log)
    train, heldout = _read_rows(cfg, tokenizer, held, log)
    _check_rows(cfg, train, heldout, None)
    return HeldRows(train, heldout, held)  # the report printed once the mask token is chosen


def training_rows(
    cfg: TrainConfig,
    target: TargetModel,
    log: Log = say,
    features: FeatureSource | None = None,
    before_target: HeldRows | None = None,
) -> tuple[PackedDataset, PackedDataset]:
    """Train and held-out rows of a run (`cache-hidden` cuts its batches here too); an
    explicit mask token the data uses is refused, none at all is chosen from the data.
    `--data embedded` trains on the target's own continuations of the corpus
    (regenerated once, cached); `features` that hold rows (per-sample hidden-state
    files) read them as they opened; `before_target` rows were read and checked before
    the target loaded (`rows_before_target`): only the mask token is left to choose."""
    own = None if features is None else features.rows
    if before_target is not None:
        train, heldout, held = before_target.train, before_target.heldout, before_target.held
        _mask_from_data(cfg, target, train, heldout)
    else:
        if own is not None:
            train, heldout, held = own.train, own.heldout, own.held
        else:
            held = BufferedLog(log)  # the data's report, once it can train: else the Error alone
            train, heldout = _read_rows(cfg, target.tokenizer, held, log, target)
        _check_rows(cfg, train, heldout, target)
    held.release()
    return train, heldout


def _read_rows(
    cfg: TrainConfig,
    tokenizer: Tokenizer,
    held: BufferedLog,
    log: Log,
    target: TargetModel | None = None,
) -> tuple[PackedDataset, PackedDataset]:
    """The (train, held-out) rows, unchecked, in batches of --batch-size x --grad-accum:
    the `target`'s continuations (--data embedded) or, before the target loads (`target`
    None) or after, the data file's."""
    d = cfg.data
    rows = d.batch_size * cfg.optim.grad_accum  # the step splits it into micro-batches
    if target is not None and d.source == EMBEDDED:
        with tracing.phase(names.DATA_REGENERATE):
            path = embedded_regeneration(target, d.heldout_fraction, live_log(log))
        corpus = regenerated_corpus(path, tokenizer, d.heldout_fraction)
    else:  # --packing was checked with the config
        rendering = d.chat_rendering
        corpus = load_corpus(d.source, tokenizer, d.heldout_fraction, d.keep_cut_replies, rendering)
    return datasets_from_corpus(
        corpus,
        tokenizer,
        d.seq_len,
        rows,
        cfg.run.seed,
        d.heldout_fraction,
        packing=d.packing,
        log=held,
    )


def _check_rows(
    cfg: TrainConfig, train: PackedDataset, heldout: PackedDataset, target: TargetModel | None
) -> None:
    """The rows can train: an explicit mask token they use is refused; without one the
    `target`'s is chosen from them (None: before the target loads, `training_rows`
    chooses it)."""
    mask_id = cfg.drafter.mask_token_id
    if mask_id is not None:
        check_mask_token_unused(mask_id, (train.ids, heldout.ids, heldout.stream))
    elif target is not None:
        _mask_from_data(cfg, target, train, heldout)
    check_trainable(train, cfg)


def _mask_from_data(
    cfg: TrainConfig, target: TargetModel, train: PackedDataset, heldout: PackedDataset
) -> None:
    """No --mask-token-id and none of the target's own: the first special token the rows
    never hold."""
    if cfg.drafter.mask_token_id is None and target.needs_mask_from_data(None):
        target.choose_mask_from_data((train.ids, heldout.ids, heldout.stream))


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
