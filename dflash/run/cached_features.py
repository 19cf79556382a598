"""Features read from --hidden-cache: a batch cache written by `cache-hidden`, or
per-sample hidden-state files (speculators' layout). The target's decoder never runs while
training; a run from sample files loads the whole target only to evaluate where it fits
(`evaluates_whole_target`). `cache_plan` tells which of the two a directory holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch

from dflash import names
from dflash.config.devices import Placement
from dflash.config.settings import DataConfig, TrainConfig
from dflash.data.datasets import PackedDataset, pad_id
from dflash.offline.hidden_cache import HiddenCacheReader, open_hidden_cache
from dflash.offline.sample_cache import cache_format, open_sample_cache, sample_datasets
from dflash.offline.sample_file import SampleCacheError
from dflash.offline.sample_reader import SampleCacheReader
from dflash.run.estimate import EstimateError, device_memory_bytes, geometry_for_spec
from dflash.run.progress import BufferedLog
from dflash.run.target_features import (
    FeaturePlan,
    FeatureSource,
    Forward,
    HeldRows,
    Log,
    resolve_layer_ids,
)
from dflash.summary import JSON
from dflash.target.model import TargetModel


def cache_plan(cfg: TrainConfig, directory: Path) -> FeaturePlan:
    """--hidden-cache `directory`: the target stays on the host, as loaded; per-sample
    files (refused unless --packing docs) hold the rows too, and load only the target's
    embedding, LM head and final norm unless it evaluates whole."""
    if cache_format(directory) != "speculators":
        return FeaturePlan(
            lambda target, _: BatchCache(cfg, directory, resolve_layer_ids(cfg, target.num_layers)),
            runs_target=False,
        )
    head_only = not evaluates_whole_target(cfg)
    if cfg.data.packing != "docs":
        raise SampleCacheError(
            f"--hidden-cache {directory} holds one file per sample: each is a document "
            "of its own, so --packing must be docs"
        )
    return FeaturePlan(
        lambda target, log: SampleFiles(cfg, directory, target, log),
        runs_target=False,
        head_only=head_only,
        has_rows=True,
    )


class _HiddenCacheSource(FeatureSource):
    """Features read from --hidden-cache by one reader thread: the target's decoder
    never runs while training, and its weights stay on the host."""

    runs_target = False
    target_phase = names.TARGET_READ

    def __init__(self, cfg: TrainConfig, directory: Path, layer_ids: list[int]) -> None:
        super().__init__(cfg, layer_ids)
        self.directory = directory
        self._reader: HiddenCacheReader | SampleCacheReader | None = None

    def bytes_counter(self) -> Callable[[], int] | None:
        return lambda: 0 if self._reader is None else self._reader.bytes_read


class BatchCache(_HiddenCacheSource):
    """--hidden-cache of `cache-hidden`: each batch's features as cached, refused before
    any thread starts for a cache of another run, or one too short."""

    def forwards(
        self,
        target: TargetModel,
        layer_ids: list[int],
        dataset: PackedDataset,
        placement: Placement,
        batches: tuple[int, int | None],
        all_devices: bool = True,
    ) -> list[tuple[torch.device, Forward]]:
        # Soft labels come from the cached final-norm states, as online: never logits.
        soft = self.cfg.loss.use_soft_labels
        reader = open_hidden_cache(
            self.directory,
            target=target,
            dataset=dataset,
            layer_ids=layer_ids,
            with_final_norm=soft,
        )
        first, last = batches
        if last is not None:
            reader.covers(last)
            reader.verify(first, last)
        self._reader = reader
        return [(torch.device("cpu"), reader.read)]


class SampleFiles(_HiddenCacheSource):
    """--hidden-cache of per-sample files (speculators' layout, or `cache-hidden
    --format speculators`): the samples are the rows and the target's decoder never runs
    while training. Only its embedding, LM head and final norm load, unless the run
    evaluates in process and the whole target fits in half the host's memory: then it
    loads whole, for the evaluations alone (τ while training, and the final one).
    Opened, it has checked the files against the target and read their rows."""

    def __init__(self, cfg: TrainConfig, directory: Path, target: TargetModel, log: Log) -> None:
        d, wanted = cfg.data, cfg.target.layer_ids
        self.cache = open_sample_cache(
            directory,
            target=target,
            layer_ids=None if wanted is None else list(wanted),
            soft_labels=cfg.loss.use_soft_labels,
            strict=d.strict_cache,
        )
        super().__init__(cfg, directory, self.cache.layer_ids)
        log(self.cache.describe())
        if target.head_only:
            log(
                f"target {target.spec}: only its embedding, LM head and final norm are loaded "
                "(the decoder stays unallocated); evaluation needs the whole target: run "
                "`dflash-train eval` where it fits"
            )
        elif cfg.run.eval_prompts:
            log(
                f"target {target.spec}: loaded whole for the evaluations alone (it fits in "
                "half the host's memory); its decoder never runs for training rows "
                "(--eval-prompts 0 loads only its embedding, LM head and final norm)"
            )
        if d.source != DataConfig.source:
            log(f"data: the rows are the samples of {directory}; --data {d.source} is not read")
        held = BufferedLog(log)  # the data's report, once dflash.run.rows has checked them
        train, heldout, self._sample_rows = sample_datasets(
            self.cache,
            seq_len=d.seq_len,
            batch_size=d.batch_size * cfg.optim.grad_accum,  # as the data file's rows
            seed=cfg.run.seed,
            heldout_fraction=d.heldout_fraction,
            pad_id=pad_id(target.tokenizer),
            log=held,
        )
        self.rows = HeldRows(train, heldout, held)

    def forwards(
        self,
        target: TargetModel,
        layer_ids: list[int],
        dataset: PackedDataset,
        placement: Placement,
        batches: tuple[int, int | None],
        all_devices: bool = True,
    ) -> list[tuple[torch.device, Forward]]:
        norm = target.final_norm() if self.cfg.loss.use_soft_labels else None
        self._reader = SampleCacheReader(self.cache, dataset, self._sample_rows, norm)
        return [(torch.device("cpu"), self._reader.read)]

    def eval_skipped(self, target: TargetModel) -> str | None:
        return "the target was loaded without its decoder" if target.head_only else None

    def summary(self) -> JSON:
        return {"hidden_cache_skipped": dataclasses.asdict(self.cache.skipped)}  # by why

    def skipped_counter(self) -> Callable[[], dict[str, int]] | None:
        def counts() -> dict[str, int]:  # every reason
            return dataclasses.asdict(self.cache.skipped)

        return counts


HOST_SHARE = 0.5  # of the host's memory a whole target may take beside the training


def evaluates_whole_target(cfg: TrainConfig) -> bool:
    """Whether a run from sample files loads its whole target: it evaluates in process
    and the target's weights (from its config) fit in HOST_SHARE of the host's memory.
    Without the whole target there is no τ while training and no final evaluation."""
    if not cfg.run.eval_prompts or cfg.run.eval_engine != "in-process":
        return False
    try:
        geometry, _ = geometry_for_spec(cfg.target.spec)
    except EstimateError:
        return False
    host = device_memory_bytes("cpu")
    width = 2 if cfg.pipeline.precision == "bf16" else 4
    return host is not None and geometry.params() * width <= HOST_SHARE * host
