"""The features of the live target, and the contract every feature source keeps.

`FeatureSource` is the live target: one target per target thread computes each batch's
features (`capture_fn`). The sources that never run the target's decoder while training
(dflash.run.cached_features, dflash.run.streamed_features) override what differs; the
choice among them is dflash.run.features.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dflash import names
from dflash.config.devices import Placement
from dflash.config.settings import TrainConfig
from dflash.data.datasets import Batch, PackedDataset
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
