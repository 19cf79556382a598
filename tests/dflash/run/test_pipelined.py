"""run_pipeline with the real target and trainer: reference equality, replicas, signals.

Run as a script this file is also the subprocess of the SIGTERM and torchrun tests:
`python tests/dflash/run/test_pipelined.py {sigterm|torchrun} OUT_DIR`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dflash.config.devices import DeviceError
from dflash.pipeline.queues import PipelineError
from dflash.run import pipelined as pipeline
from dflash.run import wiring
from dflash.run.checkpoint import load_checkpoint, resolve_checkpoint
from dflash.run.reference import train_reference
from dflash.train.step import DrafterTrainer
from tests.dflash.app_fixtures import (  # noqa: F401 - fixture
    cpu_run,
    record_losses,
    script_env,
    small_cfg,
    small_target_everywhere,
    tiny_target,
    torchrun_command,
)


def capture_replicas(monkeypatch: pytest.MonkeyPatch) -> list:
    built: list = []
    real = wiring.build_replicas

    def build(run):
        built.extend(real(run))
        return built

    monkeypatch.setattr(wiring, "build_replicas", build)
    return built


def weights_digest(module: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for p in module.parameters():
        if p.requires_grad:
            digest.update(p.detach().cpu().numpy().tobytes())
    return digest.hexdigest()


@pytest.mark.slow
@pytest.mark.usefixtures("tiny_target")
def test_one_target_one_drafter_gives_the_reference_loss_curve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = record_losses(monkeypatch)
    ref = train_reference(small_cfg(tmp_path, tmp_path / "ref", steps=8), log=lambda _: None)
    ref_curve, seen[:] = list(seen), []
    cfg = small_cfg(tmp_path, tmp_path / "pipe", steps=8)
    summary = pipeline.run_pipeline(cfg, log=lambda _: None)
    assert [b for b, _ in seen] == list(range(8))
    assert [b for b, _ in ref_curve] == list(range(8))
    assert [loss for _, loss in seen] == pytest.approx([loss for _, loss in ref_curve], abs=1e-6)
    assert summary["final_loss"] == pytest.approx(ref["final_loss"], abs=1e-6)
    assert summary["steps"] == 8
    figures = summary["pipeline"]
    assert figures["target_tokens_per_s"] > 0 and figures["drafter_tokens_per_s"] > 0
    saved = json.loads((tmp_path / "pipe" / "summary.json").read_text())
    assert saved["pipeline"]["drafter_devices"] == ["cpu"]


@pytest.mark.usefixtures("tiny_target")
def test_two_drafter_threads_keep_identical_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    replicas = capture_replicas(monkeypatch)
    seen = record_losses(monkeypatch)
    cfg = small_cfg(tmp_path, steps=5, drafter_devices=["cpu", "cpu"], target_devices=["cpu"] * 2)
    before = weights_digest(cpu_run(cfg).drafter)
    summary = pipeline.run_pipeline(cfg, log=lambda _: None)
    assert len(replicas) == 2 and summary["steps"] == 5
    digests = {weights_digest(r.drafter) for r in replicas}
    assert len(digests) == 1 and before not in digests  # identical, and trained
    assert sorted(b for b, _ in seen) == list(range(10))  # 2 batches per step
    resume = load_checkpoint(resolve_checkpoint("latest", tmp_path))
    assert (resume.step, resume.next_batch_index) == (5, 10)


@pytest.mark.usefixtures("tiny_target")
def test_bad_devices_fail_before_any_work(tmp_path: Path) -> None:
    cfg = small_cfg(tmp_path, drafter_devices=["cuda:3"])
    started = time.monotonic()
    with pytest.raises(DeviceError, match="'cuda:3' in --drafter-devices is not available"):
        pipeline.run_pipeline(cfg, log=lambda _: None)
    assert time.monotonic() - started < 1.0
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.usefixtures("tiny_target")
def test_trainer_failure_is_one_line_with_a_traceback_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self, batch, target_out, phase=None):
        with phase("drafter.block_prediction"):
            raise RuntimeError("shape mismatch [2, 4] vs [2, 5]")

    monkeypatch.setattr(DrafterTrainer, "step", broken)
    start_s = time.monotonic()
    with pytest.raises(PipelineError) as info:
        pipeline.run_pipeline(small_cfg(tmp_path, steps=50), log=lambda _: None)
    assert time.monotonic() - start_s < 10
    log_path = tmp_path / "pipeline-error.log"
    assert str(info.value) == (
        "thread 'drafter-0' failed in drafter.block_prediction: "
        f"RuntimeError: shape mismatch [2, 4] vs [2, 5] (traceback in {log_path})"
    )
    assert "Traceback" in log_path.read_text()


def _run_script(mode: str, out_dir: Path, launcher: list[str]) -> subprocess.Popen:
    env = script_env(PYTHONUNBUFFERED="1")
    command = [*launcher, __file__, mode, str(out_dir)]
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.mark.slow
def test_sigterm_leaves_a_loadable_checkpoint_and_exits_143(tmp_path: Path) -> None:
    proc = _run_script("sigterm", tmp_path, [sys.executable])
    lines: list[str] = []
    deadline_s = time.monotonic() + 120
    while time.monotonic() < deadline_s:  # wait until training has really started
        line = proc.stdout.readline()
        lines.append(line)
        if line.startswith("step ") or not line:
            break
    assert lines[-1].startswith("step "), "".join(lines)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 143, "".join(lines) + output
    checkpoint = load_checkpoint(resolve_checkpoint("latest", tmp_path))
    assert 1 <= checkpoint.step < 100000
    assert checkpoint.next_batch_index == checkpoint.step
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["interrupted"] == "SIGTERM" and summary["steps"] == checkpoint.step
    assert "summary:" in output


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_torchrun_two_ranks_train_identical_weights(tmp_path: Path) -> None:
    proc = _run_script("torchrun", tmp_path, torchrun_command(2))
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-4000:]
    digests = [(tmp_path / f"rank{r}.sha256").read_text() for r in range(2)]
    assert digests[0] == digests[1]
    summary = json.loads((tmp_path / "out0" / "summary.json").read_text())
    assert summary["pipeline"]["world_size"] == 2 and summary["steps"] == 4
    assert load_checkpoint(resolve_checkpoint("latest", tmp_path / "out0")).step == 4
    assert not (tmp_path / "out1" / "checkpoints").exists()  # only rank 0 writes
    assert not (tmp_path / "out1" / "summary.json").exists()
    batches = [json.loads((tmp_path / f"batches-rank{r}.json").read_text()) for r in range(2)]
    assert batches == [[0, 2, 4, 6], [1, 3, 5, 7]]
    final = output.split("interval: total")[-1].splitlines()[0]
    assert "2 ranks" in final, output[-3000:]
    metrics = (tmp_path / "out0" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in metrics] == [1, 2, 3, 4]


def _script(mode: str, out_dir: Path) -> None:
    small_target_everywhere()
    if mode == "sigterm":
        cfg = small_cfg(out_dir, steps=100000)
        pipeline.run_pipeline(cfg, progress_stream=sys.stdout)
        return
    from dflash.pipeline.distributed import dist_info_from_env

    info = dist_info_from_env()
    data_dir = out_dir / f"data{info.rank}"  # one corpus file per rank: no write race
    data_dir.mkdir(parents=True, exist_ok=True)
    batches: list[int] = []
    real_step = DrafterTrainer.step

    def step(self, batch, target_out, phase):
        batches.append(batch.batch_id)
        return real_step(self, batch, target_out, phase=phase)

    DrafterTrainer.step = step
    replicas: list = []
    real_build = wiring.build_replicas
    wiring.build_replicas = lambda run: replicas.extend(real_build(run)) or replicas
    # Through the command's path: tracing, cross-rank interval tables, the final gather.
    out = out_dir / f"out{info.rank}"
    cfg = small_cfg(data_dir, out, steps=4, profile_interval=0.2, log_every=1)
    pipeline.run_training(cfg, log=print)
    (out_dir / f"rank{info.rank}.sha256").write_text(weights_digest(replicas[0].drafter))
    (out_dir / f"batches-rank{info.rank}.json").write_text(json.dumps(batches))


if __name__ == "__main__":
    _script(sys.argv[1], Path(sys.argv[2]))
