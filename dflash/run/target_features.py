"""The features of the live target, and the contract every feature source keeps.

A source comes in two steps, each a type: a `FeaturePlan`, decided from the config
before the target loads (how it loads), whose `open` gives the `FeatureSource` once it
has loaded, opened: its layers and any rows of its own are known, and the target
stage's `forwards` is all that is left to build.

`FeatureSource` is the live target: one target per target thread computes each batch's
features (`capture_fn`). The sources that never run the target's decoder while training
(dflash.run.cached_features, dflash.run.streamed_features) override what differs; the
choice among them is dflash.run.features.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dflash import names
from dflash.config.devices import Placement
from dflash.config.settings import TrainConfig
from dflash.data.datasets import Batch, PackedDataset
from dflash.run.progress import BufferedLog
from dflash.summary import JSON
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


@dataclass
class HeldRows:
    """Train and held-out rows, and the data's report held until they are checked
    (dflash.run.rows prints it then)."""

    train: PackedDataset
    heldout: PackedDataset
    held: BufferedLog


class FeatureSource:
    """The live target, opened: one target per target thread computes each batch's
    features.

    Thread contract: opened on the run's thread before any stage starts; the
    `bytes_counter` is read from the observer's thread."""

    runs_target = True
    """The target's decoder runs while training (its FLOPs count, its stage forwards)."""
    target_phase = names.TARGET_FORWARD
    rows: HeldRows | None = None
    """The training rows when the source holds them itself (per-sample files), read
    as it opened; None: the data file's."""

    def __init__(self, cfg: TrainConfig, layer_ids: list[int]) -> None:
        self.cfg = cfg
        self.layer_ids = layer_ids  # those that feed the drafter

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

    def summary(self) -> JSON:
        """What summary.json records of the source."""
        return {}


@dataclass(frozen=True)
class FeaturePlan:
    """Where a run's features will come from, decided from its config before the target
    loads (dflash.run.features.feature_plan): how the target loads, and `open`, the
    source opened on the loaded target (it checks itself against it and says what it
    is)."""

    open: Callable[[TargetModel, Log], FeatureSource]
    runs_target: bool = True
    """The target's decoder runs while training: it loads where it computes, cast to
    the dtype --precision gives there; else on the host, as loaded."""
    head_only: bool = False
    """Only the target's embedding, LM head and final norm load."""
    has_rows: bool = False
    """The opened source holds the training rows itself (`FeatureSource.rows`)."""

    def load_device(self, placement: Placement) -> torch.device:
        """Where the target's weights load."""
        return placement.target if self.runs_target else torch.device("cpu")


def live_target(cfg: TrainConfig) -> FeaturePlan:
    """The live target's plan: it loads where it computes, and its decoder runs."""
    return FeaturePlan(
        lambda target, _: FeatureSource(cfg, resolve_layer_ids(cfg, target.num_layers))
    )


def _quiet(_: str) -> None:
    pass
