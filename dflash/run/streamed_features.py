"""Features streamed by a vLLM engine through a bounded spool (`--target-engine vllm`):
the engine and the spool's reader are dflash.run.streamed; this is the feature source
that starts them and answers the run's questions about them (`streamed_plan`: its
checks, and its spool taken, before the target loads).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from dflash import names
from dflash.config.checks import parse_size
from dflash.config.devices import Placement
from dflash.config.settings import TrainConfig
from dflash.data.datasets import PackedDataset
from dflash.files import write_text_atomic
from dflash.offline.spool import Spool, SpoolError
from dflash.run import streamed
from dflash.run.cached_features import evaluates_whole_target
from dflash.run.target_features import FeaturePlan, FeatureSource, Forward, Log, resolve_layer_ids
from dflash.summary import JSON
from dflash.target.model import TargetModel


def streamed_plan(cfg: TrainConfig) -> FeaturePlan:
    """--target-engine vllm, checked before the target loads (--packing, --spool-size,
    the engine's python) with its spool taken: the target stays on the host, its
    embedding, LM head and final norm alone unless it evaluates whole."""
    if cfg.data.packing != "docs":
        raise SpoolError(
            "--target-engine vllm streams one sample per document: --packing must be docs"
        )
    bound = parse_size(cfg.target.spool_size)
    one = streamed.smallest_sample_bytes(cfg)
    if one is not None and bound < 2 * one:
        raise SpoolError(
            f"--spool-size {cfg.target.spool_size} ({bound:,} bytes) is smaller than "
            f"one sample of --seq-len {cfg.data.seq_len}: {one:,} bytes, twice that while "
            "vLLM's file is converted"
        )
    # Under torchrun: this rank's rows, engine, spool folder, plan and log.
    rank, world_size = streamed.rank_and_world()
    output_dir = Path(cfg.run.output_dir)
    given = Path(cfg.target.spool_dir) if cfg.target.spool_dir else output_dir / "spool"
    spool = Spool(given, rank=rank if world_size > 1 else None)
    try:  # last: it starts a python (seconds)
        streamed.check_vllm_python(cfg.target.vllm_python)
    except SpoolError:
        spool.close()
        raise
    return FeaturePlan(
        lambda target, log: StreamedSamples(cfg, spool, bound, target, log),
        runs_target=False,
        head_only=not evaluates_whole_target(cfg),
    )


class StreamedSamples(FeatureSource):
    """Features from a vLLM engine through the spool: the target's decoder never runs in
    this process (its embedding, LM head and final norm load, or the whole target for
    evaluations where it fits, as with per-sample files). `forwards` starts the engine."""

    runs_target = False
    target_phase = names.TARGET_READ

    def __init__(
        self, cfg: TrainConfig, spool: Spool, bound: int, target: TargetModel, log: Log
    ) -> None:
        super().__init__(cfg, resolve_layer_ids(cfg, target.num_layers))
        self.spool, self.bound = spool, bound
        self.rank, self.world_size = streamed.rank_and_world()
        self.plan, self.log = streamed.rank_files(
            Path(cfg.run.output_dir), self.rank, self.world_size
        )
        self._reader: streamed.SpoolReader | None = None
        self._engine: streamed.Engine | None = None
        log(
            f"target engine: vLLM ({cfg.target.vllm_python}) writes the hidden states "
            f"into {spool.directory}, at most {bound:,} bytes; its output in "
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

    def summary(self) -> JSON:
        reader = self._reader
        return {
            "spool_bytes_bound": self.bound,
            "spool_peak_bytes": self.spool.peak_bytes,
            "spool_samples_read": 0 if reader is None else reader.samples_read,
            "spool_bytes_read": 0 if reader is None else reader.bytes_read,
        }
