"""Starting a run: where this process stands in it, decided once, and its start-up lines.

`start_run` is the one place a process decides its rank and devices, locks the output
folder and joins the process group; config.json is written by `RankSetup.begin_training`,
once every check has passed.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash.config.devices import Placement, decide_placement
from dflash.config.settings import TrainConfig
from dflash.log import Log
from dflash.pipeline.distributed import DistInfo, dist_info_from_env, init_distributed
from dflash.run.build import Run
from dflash.run.estimate import estimate_for_config
from dflash.run.folder import FolderLock, claim_output_dir, write_run_start
from dflash.run.outputs import check_run_folder
from dflash.run.progress import format_loss_config, format_run_config


@dataclass(frozen=True)
class RankSetup:
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


def start_run(cfg: TrainConfig, info: DistInfo | None = None) -> RankSetup:
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
    return RankSetup(info, placement, lock)


def log_startup(run: Run, log: Log, devices: str, telemetry_line: str | None = None) -> None:
    """The loss line, the telemetry line (when traced), then the run line."""
    log(format_loss_config(run.cfg))
    if telemetry_line is not None:
        log(telemetry_line)
    target = f"{run.cfg.target.spec} layers {run.layer_ids}"
    log(format_run_config(run.cfg, target, devices, rows_in_cache=run.features.rows is not None))
    log(run.trainer.precision_text)
    for line in estimate_for_config(run.cfg, run.target.geometry, run.placement.drafter):
        log(line)  # and a warning when it exceeds the device's memory: before the first step
