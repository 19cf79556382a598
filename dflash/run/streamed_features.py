"""Features streamed by a vLLM engine through a bounded spool (`--target-engine vllm`):
the engine and the spool's reader are dflash.run.streamed; this is the feature source
that starts them and answers the run's questions about them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dflash import names
from dflash.config.devices import Placement
from dflash.config.settings import TrainConfig
from dflash.data.datasets import PackedDataset
from dflash.files import write_text_atomic
from dflash.offline.spool import Spool, SpoolError, parse_size
from dflash.run import streamed
from dflash.run.cached_features import evaluates_whole_target
from dflash.run.target_features import FeatureSource, Forward, Log
from dflash.target.model import TargetModel


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
