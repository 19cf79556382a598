"""--shard-drafter: FSDP2 on 2 gloo ranks trains as the replicated drafter does, and its
checkpoint resumes on one rank.

Run as a script under torchrun this file is also the worker:
`torchrun --nproc-per-node 2 tests/dflash/run/test_sharded.py {ddp|fsdp} OUT_DIR`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash.run import pipelined as pipeline
from dflash.run.checkpoint import load_checkpoint, resolve_checkpoint
from dflash.run.estimate import EstimateError, dry_run_lines
from dflash.run.size_checks import check_sharding
from dflash.train.step import DrafterTrainer
from tests.dflash.app_fixtures import (  # noqa: F401 - fixture
    run_torchrun_script,
    script_env,
    small_cfg,
    small_target_everywhere,
    tiny_target,
)

STEPS = 4
# Measured on 2 gloo ranks, 4 steps of the small tiny LM in fp32: the losses were equal
# to the bit (max |difference| 0.0). The tolerance leaves room for a reduce-scatter that
# sums in another order than the one all-reduce of a flat buffer (fp32 rounding).
LOSS_TOLERANCE = 1e-5
WEIGHT_TOLERANCE = 1e-5


@pytest.mark.slow
@pytest.mark.usefixtures("tiny_target")
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_sharded_losses_equal_ddp_and_resume_on_one_rank(tmp_path: Path) -> None:
    for mode in ("ddp", "fsdp"):
        run_torchrun_script(__file__, mode, str(tmp_path / mode))
    losses = {m: json.loads((tmp_path / m / "losses0.json").read_text()) for m in ("ddp", "fsdp")}
    assert len(losses["ddp"]) == len(losses["fsdp"]) == STEPS
    diff = max(abs(a - b) for a, b in zip(losses["ddp"], losses["fsdp"], strict=True))
    print(f"losses ddp {losses['ddp']} fsdp {losses['fsdp']} max abs diff {diff:.3g}")
    assert diff <= LOSS_TOLERANCE
    # Both ranks saw the same global loss.
    assert json.loads((tmp_path / "fsdp" / "losses1.json").read_text()) == losses["fsdp"]

    saved = {m: load_checkpoint(resolve_checkpoint("latest", tmp_path / m / "out")) for m in losses}
    assert saved["fsdp"].step == STEPS and saved["fsdp"].next_batch_index == 2 * STEPS
    assert saved["fsdp"].weights.keys() == saved["ddp"].weights.keys()
    for name, tensor in saved["ddp"].weights.items():
        assert torch.allclose(saved["fsdp"].weights[name], tensor, atol=WEIGHT_TOLERANCE), name
    moments = [c.trainer_state["optimizer"]["state"] for c in (saved["ddp"], saved["fsdp"])]
    assert moments[0].keys() == moments[1].keys() and len(moments[0]) > 0
    for index, state in moments[0].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(moments[1][index][key], state[key], atol=WEIGHT_TOLERANCE)
    assert saved["fsdp"].trainer_state["step_count"] == STEPS
    assert (tmp_path / "fsdp" / "out" / "drafter" / "model.safetensors").is_file()

    # The sharded checkpoint resumes on one rank, unsharded, and trains on.
    resumed = tmp_path / "fsdp" / "out"
    cfg = small_cfg(tmp_path / "fsdp" / "data0", resumed, steps=STEPS + 2, resume="latest")
    pipeline.run_training(cfg, log=print)
    after = load_checkpoint(resolve_checkpoint("latest", resumed))
    assert after.step == STEPS + 2 and after.next_batch_index == 2 * STEPS + 2


def test_dry_run_shows_both_per_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    lines = dry_run_lines(small_cfg(tmp_path))
    per_rank = [line for line in lines if line.startswith("per rank of 4 on cpu")]
    assert len(per_rank) == 1, lines
    replicated, sharded = (
        float(part.split(" GiB")[0].split()[-1]) for part in per_rank[0].split(";")[:2]
    )
    assert sharded <= replicated


def test_shard_drafter_on_one_rank_is_one_error_line(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "dflash.cli", "train", "--target", "builtin:tiny"]
    command += ["--data", str(tmp_path / "none.txt"), "--output-dir", str(tmp_path / "out")]
    env = {k: v for k, v in script_env().items() if k not in ("WORLD_SIZE", "RANK")}
    proc = subprocess.run(
        [*command, "--shard-drafter"], env=env, capture_output=True, text=True, timeout=300
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(errors) == 1 and "--shard-drafter" in errors[0] and "WORLD_SIZE 1" in errors[0]
    assert not (tmp_path / "out" / "checkpoints").exists()


def _script(mode: str, out_dir: Path) -> None:
    small_target_everywhere()
    from dflash.pipeline.distributed import dist_info_from_env

    rank = dist_info_from_env().rank
    data_dir = out_dir / f"data{rank}"  # one corpus file per rank: no write race
    data_dir.mkdir(parents=True, exist_ok=True)
    losses: list[float] = []
    real_step = DrafterTrainer.step

    def step(self, batch, target_out, phase):
        result = real_step(self, batch, target_out, phase=phase)
        losses.append(float(result.loss))
        return result

    DrafterTrainer.step = step
    out = out_dir / "out" if rank == 0 else out_dir / f"out{rank}"
    options = {"steps": STEPS, "log_every": 1, "save_every": 2}
    cfg = small_cfg(data_dir, out, shard_drafter=mode == "fsdp", **options)
    pipeline.run_training(cfg, log=print)
    (out_dir / f"losses{rank}.json").write_text(json.dumps(losses))


if __name__ == "__main__":
    _script(sys.argv[1], Path(sys.argv[2]))


def test_shard_drafter_with_two_drafter_devices_per_rank_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = small_cfg(tmp_path, shard_drafter=True, drafter_devices=("cpu", "cpu"))
    with pytest.raises(EstimateError, match=r"--drafter-devices gives this rank 2 \(cpu,cpu\)"):
        check_sharding(cfg)
    check_sharding(small_cfg(tmp_path, shard_drafter=True))  # one device per rank: fine


def test_a_signal_between_gathers_keeps_the_newest_checkpoint(tmp_path):
    """Rank 0 cannot gather the shards alone after a signal: no checkpoint, one line, and
    the summary is still written (the newest checkpoint stands)."""
    from types import SimpleNamespace

    from dflash.pipeline.distributed import DistInfo
    from dflash.run.checkpoint import CheckpointError
    from dflash.run.outcome import _checkpoint_after_signal

    def not_gathered() -> dict:
        raise CheckpointError("step 7: the sharded drafter's state was last gathered at step 6")

    guard = SimpleNamespace(raise_if_diverged=lambda: None)
    trainer = SimpleNamespace(guard=guard, state_dict=not_gathered)
    run = SimpleNamespace(output_dir=tmp_path, trainer=trainer, step=7)
    lines: list[str] = []
    info = DistInfo(rank=0, world_size=2, local_rank=0)
    assert _checkpoint_after_signal(run, info, "SIGTERM", [], lines.append) is True
    assert lines == [
        "SIGTERM: no checkpoint written (step 7: the sharded drafter's state was last "
        "gathered at step 6); the newest checkpoint stands"
    ]
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())
