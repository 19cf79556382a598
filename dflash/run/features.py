"""Where a run's target features come from, chosen once: the live target, a batch cache
written by `cache-hidden`, per-sample hidden-state files (speculators' layout), or a vLLM
engine streaming them through a bounded spool (`--target-engine vllm`, dflash.run.streamed).

`feature_source(cfg)` is the one place that looks at `--hidden-cache`; the run asks the
`FeatureSource` it returns where the target loads, which layers feed the drafter, the
rows (per-sample files are their own rows), the target stage's forward, the bytes it
reads, whether the final evaluation can run, and what to say at start. Speculators
hides its online and offline data behind one dataset hook; this is the same idea for a
run whose target may never run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dflash import names
from dflash.config.devices import Placement
from dflash.config.settings import DataConfig, TrainConfig
from dflash.data.datasets import Batch, PackedDataset, pad_id
from dflash.files import write_text_atomic
from dflash.offline.hidden_cache import HiddenCacheReader, open_hidden_cache
from dflash.offline.sample_cache import (
    SampleCache,
    SampleCacheError,
    SampleRows,
    SkipCounts,
    cache_format,
    open_sample_cache,
    sample_datasets,
)
from dflash.offline.sample_reader import SampleCacheReader
from dflash.offline.spool import Spool, SpoolError, parse_size
from dflash.run import streamed
from dflash.run.estimate import EstimateError, device_memory_bytes, geometry_for_spec
from dflash.run.progress import BufferedLog
from dflash.target import load as target_load  # by module: tests swap load_target
from dflash.target.model import TargetModel, TargetOutput, choose_target_layers

Log = Callable[[str], None]
Forward = Callable[[Batch], TargetOutput]


def capture_fn(
    target: TargetModel, layer_ids: list[int], with_final_hidden: bool, device: torch.device
) -> Forward:
    """The target stage's forward: features, plus the final-norm states for soft labels
    (never logits: the drafter stage applies the frozen LM head per loss chunk)."""

    def forward(batch: Batch) -> TargetOutput:
        with torch.no_grad():
            ids = batch.input_ids.to(device, non_blocking=True)
            docs = None if batch.doc_ids is None else batch.doc_ids.to(device, non_blocking=True)
            return target.capture(
                ids,
                layer_ids,
                with_logits=False,
                with_final_hidden=with_final_hidden,
                doc_ids=docs,
            )

    return forward


def resolve_layer_ids(cfg: TrainConfig, num_layers: int) -> list[int]:
    """--target-layers, or the default spread over a target of `num_layers`."""
    return choose_target_layers(cfg.target.layer_ids, num_layers, cfg.drafter.num_layers)


class FeatureSource:
    """The live target: one target per target thread computes each batch's features.

    Thread contract: built and opened on the run's thread before any stage starts; the
    `bytes_counter` is read from the observer's thread."""

    runs_target = True
    """The target's decoder runs while training (its FLOPs count, its stage forwards)."""
    head_only = False
    """Only the target's embedding, LM head and final norm are ever used."""
    has_rows = False
    """The source holds the training rows itself (`rows`), not the data file."""
    target_phase = names.TARGET_FORWARD

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg

    def load_device(self, placement: Placement) -> torch.device:
        """Where the target's weights load."""
        return placement.target

    def open(self, target: TargetModel, log: Log) -> None:
        """Checks the source against the loaded target and says what it is."""

    def layer_ids(self, target: TargetModel) -> list[int]:
        return resolve_layer_ids(self.cfg, target.num_layers)

    def rows(
        self, target: TargetModel, rows_per_batch: int, held: BufferedLog
    ) -> tuple[PackedDataset, PackedDataset]:
        raise NotImplementedError(f"{type(self).__name__} has no rows of its own")

    def forwards(
        self,
        target: TargetModel,
        layer_ids: list[int],
        dataset: PackedDataset,
        placement: Placement,
        batches: tuple[int, int | None],
        all_devices: bool = True,
    ) -> list[tuple[torch.device, Forward]]:
        """The target stage's (device, forward) per thread: one target per target device
        (`capture` hooks the module, so threads cannot share one), the first alone when
        not `all_devices`. `batches`: the first and last batch index the run reads."""
        soft = self.cfg.loss.use_soft_labels
        first = placement.target
        forwards = [(first, capture_fn(target, layer_ids, soft, first))]
        if not all_devices:
            return forwards
        dtype = next(target.parameters()).dtype
        for device in placement.targets[1:]:
            other = target_load.load_target(self.cfg.target.spec, device, dtype, log=_quiet)
            forwards.append((device, capture_fn(other, layer_ids, soft, device)))
        return forwards

    def bytes_counter(self) -> Callable[[], int] | None:
        """Bytes of features read from disk so far, as a counter; None: none are read."""
        return None

    def spool_depth(self) -> dict[str, Callable[[], float]] | None:
        """A streamed run's spool, a reader of each of metrics.SPOOL_FIGURES; None: the
        source has no spool."""
        return None

    def eval_skipped(self, target: TargetModel) -> str | None:
        """Why the final in-process evaluation cannot run, or None."""
        return None

    def skipped_counter(self) -> Callable[[], dict[str, int]] | None:
        """The samples left out or cut so far, by reason; None: the source skips none."""
        return None

    def stop(self) -> None:
        """Ends what the source started (an engine), once the pipeline has stopped reading."""

    def summary(self) -> dict[str, Any]:
        """What summary.json records of the source."""
        return {}


def _quiet(_: str) -> None:
    pass


class _HiddenCacheSource(FeatureSource):
    """Features read from --hidden-cache by one reader thread: the target's decoder
    never runs while training, and its weights stay on the host."""

    runs_target = False
    target_phase = names.TARGET_READ

    def __init__(self, cfg: TrainConfig, directory: Path) -> None:
        super().__init__(cfg)
        self.directory = directory
        self._reader: HiddenCacheReader | SampleCacheReader | None = None

    def load_device(self, placement: Placement) -> torch.device:
        return torch.device("cpu")

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
        args = {"target": target, "dataset": dataset, "layer_ids": layer_ids}
        reader = open_hidden_cache(self.directory, **args, with_final_norm=soft)
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
    loads whole, for the evaluations alone (τ while training, and the final one)."""

    has_rows = True

    def __init__(self, cfg: TrainConfig, directory: Path) -> None:
        super().__init__(cfg, directory)
        self.head_only = not evaluates_whole_target(cfg)
        if cfg.data.packing != "docs":
            raise SampleCacheError(
                f"--hidden-cache {directory} holds one file per sample: each is a document "
                "of its own, so --packing must be docs"
            )
        self._cache: SampleCache | None = None
        self._rows: SampleRows | None = None

    @property
    def cache(self) -> SampleCache:
        if self._cache is None:
            raise RuntimeError("SampleFiles.open must run before the samples are read")
        return self._cache

    def open(self, target: TargetModel, log: Log) -> None:
        d = self.cfg.data
        self._cache = open_sample_cache(
            self.directory,
            target=target,
            layer_ids=self.cfg.target.layer_ids,
            soft_labels=self.cfg.loss.use_soft_labels,
            strict=d.strict_cache,
        )
        log(self._cache.describe())
        if target.head_only:
            log(
                f"target {target.spec}: only its embedding, LM head and final norm are loaded "
                "(the decoder stays unallocated); evaluation needs the whole target: run "
                "`dflash-train eval` where it fits"
            )
        elif self.cfg.run.eval_prompts:
            log(
                f"target {target.spec}: loaded whole for the evaluations alone (it fits in "
                "half the host's memory); its decoder never runs for training rows "
                "(--eval-prompts 0 loads only its embedding, LM head and final norm)"
            )
        if d.source != DataConfig.source:
            unread = f"--data {d.source} is not read"
            log(f"data: the rows are the samples of {self.directory}; {unread}")

    def layer_ids(self, target: TargetModel) -> list[int]:
        return self.cache.layer_ids

    def rows(
        self, target: TargetModel, rows_per_batch: int, held: BufferedLog
    ) -> tuple[PackedDataset, PackedDataset]:
        d = self.cfg.data
        train, heldout, self._rows = sample_datasets(
            self.cache,
            seq_len=d.seq_len,
            batch_size=rows_per_batch,
            seed=self.cfg.run.seed,
            heldout_fraction=d.heldout_fraction,
            pad_id=pad_id(target.tokenizer),
            log=held,
        )
        return train, heldout

    def forwards(
        self,
        target: TargetModel,
        layer_ids: list[int],
        dataset: PackedDataset,
        placement: Placement,
        batches: tuple[int, int | None],
        all_devices: bool = True,
    ) -> list[tuple[torch.device, Forward]]:
        if self._rows is None:
            raise RuntimeError("SampleFiles.rows must run before the target stage is built")
        norm = target.final_norm() if self.cfg.loss.use_soft_labels else None
        self._reader = SampleCacheReader(self.cache, dataset, self._rows, norm)
        return [(torch.device("cpu"), self._reader.read)]

    def eval_skipped(self, target: TargetModel) -> str | None:
        return "the target was loaded without its decoder" if target.head_only else None

    def summary(self) -> dict[str, Any]:
        if self._cache is None:
            return {}
        return {"hidden_cache_skipped": dataclasses.asdict(self._cache.skipped)}  # by why

    def skipped_counter(self) -> Callable[[], dict[str, int]] | None:
        def counts() -> dict[str, int]:  # every reason, zero before the cache opens
            return dataclasses.asdict(SkipCounts() if self._cache is None else self._cache.skipped)

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


class StreamedSamples(FeatureSource):
    """Features from a vLLM engine through the spool: the target's decoder never runs in
    this process (its embedding, LM head and final norm load, or the whole target for
    evaluations where it fits, as with per-sample files)."""

    runs_target = False
    target_phase = names.TARGET_READ

    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__(cfg)
        if cfg.data.packing != "docs":
            raise SpoolError(
                "--target-engine vllm streams one sample per document: --packing must be docs"
            )
        self.bound = parse_size(cfg.target.spool_size)
        one = streamed.smallest_sample_bytes(cfg)
        if one is not None and self.bound < 2 * one:
            raise SpoolError(
                f"--spool-size {cfg.target.spool_size} ({self.bound:,} bytes) is smaller than "
                f"one sample of --seq-len {cfg.data.seq_len}: {one:,} bytes, twice that while "
                "vLLM's file is converted"
            )
        self.output_dir = Path(cfg.run.output_dir)
        # Under torchrun: this rank's rows, engine, spool folder, plan and log.
        self.rank, self.world_size = streamed.rank_and_world()
        self.plan, self.log = streamed.rank_files(self.output_dir, self.rank, self.world_size)
        given = Path(cfg.target.spool_dir) if cfg.target.spool_dir else self.output_dir / "spool"
        self.spool = Spool(given, rank=self.rank if self.world_size > 1 else None)
        try:  # last: it starts a python (seconds)
            streamed.check_vllm_python(cfg.target.vllm_python)
        except SpoolError:
            self.spool.close()
            raise
        self.head_only = not evaluates_whole_target(cfg)
        self._reader: streamed.SpoolReader | None = None
        self._engine: streamed.Engine | None = None

    def load_device(self, placement: Placement) -> torch.device:
        return torch.device("cpu")

    def open(self, target: TargetModel, log: Log) -> None:
        log(
            f"target engine: vLLM ({self.cfg.target.vllm_python}) writes the hidden states "
            f"into {self.spool.directory}, at most {self.bound:,} bytes; its output in "
            f"{self.log}; the target's decoder layers never run here"
            + (f" (rank {self.rank}'s, one engine per rank)" if self.world_size > 1 else "")
        )

    def forwards(
        self,
        target: TargetModel,
        layer_ids: list[int],
        dataset: PackedDataset,
        placement: Placement,
        batches: tuple[int, int | None],
        all_devices: bool = True,
    ) -> list[tuple[torch.device, Forward]]:
        first, last = batches
        last = first if last is None else last
        order, lines = streamed.stream_plan(dataset, first, last, self.rank, self.world_size)
        plan = self.plan
        plan.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(plan, "".join(line + "\n" for line in lines))
        where = self.spool.directory
        command = streamed.engine_command(self.cfg, target, layer_ids, plan, where, self.bound)
        env = streamed.engine_env(placement.targets)
        self._engine = streamed.Engine(command, self.log, env)
        norm = target.final_norm() if self.cfg.loss.use_soft_labels else None
        dtype, width = target.embed_tokens.weight.dtype, target.hidden_size
        self._reader = streamed.SpoolReader(
            self.spool, self._engine, order, dataset, len(layer_ids), width, dtype, norm
        )
        return [(torch.device("cpu"), self._reader.read)]

    def stop(self) -> None:
        """Ends the engine's process group and releases the spool."""
        if self._engine is not None:
            self._engine.stop()
        self.spool.close()

    def bytes_counter(self) -> Callable[[], int] | None:
        return lambda: 0 if self._reader is None else self._reader.bytes_read

    def spool_depth(self) -> dict[str, Callable[[], float]] | None:
        depth = self.spool.depth
        return {"usage": lambda: depth()[0], "samples": lambda: depth()[1]}

    def eval_skipped(self, target: TargetModel) -> str | None:
        return "the target was loaded without its decoder" if target.head_only else None

    def summary(self) -> dict[str, Any]:
        reader = self._reader
        return {
            "spool_bytes_bound": self.bound,
            "spool_peak_bytes": self.spool.peak_bytes,
            "spool_samples_read": 0 if reader is None else reader.samples_read,
            "spool_bytes_read": 0 if reader is None else reader.bytes_read,
        }


def feature_source(cfg: TrainConfig) -> FeatureSource:
    """The one place that decides where the run's features come from (a directory
    holding neither kind of cache, or both, is one line)."""
    if cfg.target.engine == "vllm":
        return StreamedSamples(cfg)
    if cfg.data.hidden_cache is None:
        return FeatureSource(cfg)
    directory = Path(cfg.data.hidden_cache)
    if cache_format(directory) == "speculators":
        return SampleFiles(cfg, directory)
    return BatchCache(cfg, directory)
