"""The paper-scale step through the real trainer: accumulation, checkpointing, soft
labels from final-norm states, non-finite steps and the start-of-run estimate."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from test_step_metrics import count_host_syncs, syncs_per_step

from dflash.cli import cli
from dflash.run import estimate
from dflash.run import pipelined as pipeline
from dflash.run.checkpoint import resolve_checkpoint
from dflash.run.reference import train_reference
from dflash.run.replicas import target_forwards
from dflash.train.optim import DivergedError
from dflash.train.step import micro_batches
from tests.dflash.app_fixtures import cpu_run, small_cfg, small_options, tiny_target  # noqa: F401 - fixture


def train_steps(cfg, steps: int) -> tuple[list[float], list[torch.Tensor]]:
    """Losses of `steps` trainer steps on the run's batches, and the drafter's weights."""
    run = cpu_run(cfg)
    forward = target_forwards(run)[0][1]  # what the pipeline's target stage sends
    losses = []
    for i in range(steps):
        batch = run.train_data.batch(i)
        losses.append(float(run.trainer.step(batch, forward(batch)).loss))
    return losses, [p.detach().clone() for p in run.drafter.parameters()]


def test_micro_batches_cover_every_row_once() -> None:
    assert micro_batches(4, 1) == [slice(0, 4)]
    assert micro_batches(4, 2) == [slice(0, 2), slice(2, 4)]
    assert micro_batches(5, 2) == [slice(0, 3), slice(3, 5)]
    assert micro_batches(2, 8) == [slice(0, 1), slice(1, 2)]


@pytest.mark.usefixtures("tiny_target")
@pytest.mark.parametrize("soft", [False, True])
def test_grad_accum_equals_the_whole_batch_in_one_micro_batch(tmp_path, soft) -> None:
    opts = {"use_soft_labels": soft, "streak_alpha": 0.3, "warmup_steps": 0, "lr": 6e-4}
    ref_losses, ref_weights = train_steps(small_cfg(tmp_path, batch_size=4, **opts), 3)
    for rows, accum in ((2, 2), (1, 4)):  # every batch holds rows x accum = 4 rows
        cfg = small_cfg(tmp_path, batch_size=rows, grad_accum=accum, **opts)
        losses, weights = train_steps(cfg, 3)
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        for got, want in zip(weights, ref_weights, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert ref_losses[0] != ref_losses[-1]  # it trained


@pytest.mark.usefixtures("tiny_target")
def test_activation_checkpointing_trains_the_same_drafter(tmp_path) -> None:
    ref_losses, ref_weights = train_steps(small_cfg(tmp_path, drafter_layers=2), 3)
    cfg = small_cfg(tmp_path, drafter_layers=2, activation_checkpointing=True)
    losses, weights = train_steps(cfg, 3)
    assert losses == pytest.approx(ref_losses, abs=1e-6)
    for got, want in zip(weights, ref_weights, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.usefixtures("tiny_target")
def test_soft_labels_cross_the_queue_as_final_norm_states_not_logits(tmp_path) -> None:
    run = cpu_run(small_cfg(tmp_path, use_soft_labels=True))
    out = target_forwards(run)[0][1](run.train_data.batch(0))
    rows, seq = run.cfg.data.batch_size, run.cfg.data.seq_len
    assert out.logits is None
    assert out.final_hidden.shape == (rows, seq, run.target.hidden_size)
    plain = target_forwards(cpu_run(small_cfg(tmp_path)))[0][1](run.train_data.batch(0))
    assert plain.logits is None and plain.final_hidden is None


@pytest.mark.usefixtures("tiny_target")
def test_pipeline_with_accumulation_and_soft_labels_gives_the_reference_losses(tmp_path) -> None:
    opts = {"steps": 4, "log_every": 1, "grad_accum": 2, "use_soft_labels": True}
    curves = []
    for name, train in (("ref", train_reference), ("pipe", pipeline.run_pipeline)):
        train(small_cfg(tmp_path, tmp_path / name, **opts), log=lambda _: None)
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        curves.append([json.loads(line)["loss"] for line in lines])
    assert len(curves[0]) == 4 and curves[1] == pytest.approx(curves[0], abs=1e-6)


def diverging(tmp_path, **overrides):
    """AdamW at lr 1e30: the first update blows the weights up, later losses are NaN."""
    opts = {"lr": 1e30, "warmup_steps": 0, "max_bad_steps": 3, "log_every": 1}
    return small_cfg(tmp_path, **{**opts, **overrides})


@pytest.mark.usefixtures("tiny_target")
def test_a_diverging_run_stops_naming_the_step_and_saves_nothing_more(tmp_path) -> None:
    cfg = diverging(tmp_path, steps=12, save_every=1)
    with pytest.raises(DivergedError, match=r"^step (\d+): .* 3 steps in a row") as info:
        train_reference(cfg, log=lambda _: None)
    stopped_at = int(str(info.value).split()[1].rstrip(":"))
    saved = resolve_checkpoint("latest", tmp_path)
    assert int(saved.name.split("-")[1]) < stopped_at  # the last checkpoint before it
    assert not (tmp_path / "drafter").exists() and not (tmp_path / "summary.json").exists()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["bad_steps_in_a_row"] for r in records[-3:]] == [1, 2, 3]


@pytest.mark.usefixtures("tiny_target")
def test_non_finite_steps_are_skipped_without_host_syncs(tmp_path, monkeypatch) -> None:
    cfg = diverging(tmp_path, steps=7, log_every=3, max_bad_steps=100)
    events = count_host_syncs(monkeypatch)
    summary = train_reference(cfg, log=lambda _: None)
    for step, syncs in syncs_per_step(events).items():
        if step not in (1, 3, 6, 7):  # logged steps
            assert syncs == [], (step, syncs)
    assert 0 < summary["bad_steps"] < 7
    assert json.loads((tmp_path / "summary.json").read_text())["bad_steps"] == summary["bad_steps"]
    weights = torch.load(resolve_checkpoint("latest", tmp_path) / "trainer.pt", weights_only=False)
    assert weights["trainer"]["guard"]["bad_steps"] == summary["bad_steps"]


@pytest.mark.usefixtures("tiny_target")
def test_the_cli_stops_a_diverging_run_with_one_line(tmp_path) -> None:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in small_options(tmp_path).items()]
    diverging = "--lr 1e30 --warmup-steps 0 --max-bad-steps 2 --log-every 1 --steps 12".split()
    args = ["train", *flags, *diverging]  # --steps 12 after small_options' --steps=6
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1
    error = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(error) == 1 and "not finite for 2 steps in a row" in error[0]
    assert "skipped 1 non-finite" in result.output  # the progress line counts them


@pytest.mark.usefixtures("tiny_target")
def test_the_start_of_a_run_prints_the_estimate_and_warns_when_it_cannot_fit(
    tmp_path, monkeypatch
) -> None:
    lines: list[str] = []
    monkeypatch.setattr(estimate, "device_memory_bytes", lambda _device: 1024.0)
    refused = r"more than its 1\.0 KiB.*--allow-over-memory"
    with pytest.raises(estimate.EstimateError, match=refused):
        train_reference(small_cfg(tmp_path, tmp_path / "refused", steps=1), log=lines.append)
    train_reference(small_cfg(tmp_path, steps=1, allow_over_memory=True), log=lines.append)
    (warning,) = [line for line in lines if line.startswith("warning:")]
    assert "more than its 0.0 GiB" in warning and "estimated peak memory" in warning


@pytest.mark.parametrize("flag", ["--loss-chunk-size", "--grad-accum", "--max-bad-steps"])
def test_out_of_range_step_settings_are_one_line_and_exit_2(flag) -> None:
    result = CliRunner().invoke(cli, ["train", flag, "0"])
    assert result.exit_code == 2
    assert result.output.strip() == f"Error: {flag} 0 is invalid: must be at least 1"
