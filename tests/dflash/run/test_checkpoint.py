import json

import pytest
import torch

from dflash.run.checkpoint import (
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
    load_trainable_weights,
    resolve_checkpoint,
    save_checkpoint,
    trainable_weights,
)


def _module():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    module[0].requires_grad_(False)  # stands for the frozen, shared parts
    return module


def _save(directory, step, keep=3):
    contents = dict(weights=trainable_weights(_module()), trainer_state={"x": torch.ones(2)})
    progress = dict(step=step, next_batch_index=step + 10, config={"run": {"steps": 9}})
    return save_checkpoint(directory, **contents, **progress, keep=keep)


def test_round_trip_keeps_only_trainable_weights(tmp_path) -> None:
    path = _save(tmp_path, 5)
    ckpt = load_checkpoint(path)
    assert set(ckpt.weights) == {"1.weight", "1.bias"}
    assert (ckpt.step, ckpt.next_batch_index) == (5, 15)
    assert ckpt.config == {"run": {"steps": 9}}
    assert torch.equal(ckpt.trainer_state["x"], torch.ones(2))
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    fresh[0].requires_grad_(False)
    load_trainable_weights(fresh, ckpt.weights)
    assert torch.equal(fresh[1].weight, _module()[1].weight)


def test_keeps_the_newest_and_latest_resolves(tmp_path) -> None:
    for step in (1, 2, 3, 4):
        _save(tmp_path / "checkpoints", step, keep=2)
    names = [p.name for p in list_checkpoints(tmp_path / "checkpoints")]
    assert names == ["step-00000003", "step-00000004"]
    assert resolve_checkpoint("latest", tmp_path).name == "step-00000004"
    assert resolve_checkpoint(str(tmp_path / "checkpoints"), tmp_path).name == "step-00000004"


def test_a_run_resumed_from_an_earlier_checkpoint_keeps_and_resumes_its_own(tmp_path) -> None:
    """Resumed from step 2 of a run that reached step 6, the new checkpoints (3, 5) are
    the newest: pruning keeps them and `latest` is theirs, not the abandoned step 6."""
    ckpts = tmp_path / "checkpoints"
    for step in (2, 4, 6, 3, 5):
        _save(ckpts, step, keep=3)
    kept = [p.name for p in list_checkpoints(ckpts)]
    assert kept == ["step-00000006", "step-00000003", "step-00000005"]
    assert resolve_checkpoint("latest", tmp_path).name == "step-00000005"


def test_interrupted_write_is_invisible(tmp_path) -> None:
    ckpts = tmp_path / "checkpoints"
    _save(ckpts, 1)
    partial = ckpts / ".tmp-step-00000002-999"  # what a crash mid-write leaves
    partial.mkdir()
    (partial / "drafter.safetensors").write_bytes(b"half")
    assert resolve_checkpoint("latest", tmp_path).name == "step-00000001"


@pytest.mark.parametrize("damage", ["truncate_weights", "drop_manifest", "edit_state"])
def test_damaged_checkpoint_is_a_one_line_error(tmp_path, damage) -> None:
    path = _save(tmp_path, 1)
    if damage == "truncate_weights":
        data = (path / "drafter.safetensors").read_bytes()
        (path / "drafter.safetensors").write_bytes(data[: len(data) // 2])
    elif damage == "drop_manifest":
        (path / "manifest.json").unlink()
    else:
        (path / "trainer.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_missing_checkpoint_errors(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint"):
        resolve_checkpoint("latest", tmp_path)
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        resolve_checkpoint(str(tmp_path / "nope"), tmp_path)


def test_manifest_lists_every_file(tmp_path) -> None:
    path = _save(tmp_path, 3)
    manifest = json.loads((path / "manifest.json").read_text())
    assert set(manifest["sha256"]) == {"drafter.safetensors", "trainer.pt", "config.json"}


def test_a_draft_vocabulary_run_resumes_and_its_vocabulary_is_checked(tmp_path) -> None:
    """The checkpoint's drafter holds the draft head and d2t/t2d besides the trainable
    weights: a resume takes them as this run's own (equal), and refuses other ones."""
    from click.testing import CliRunner

    from dflash.cli import cli

    out = tmp_path / "run"
    common = ["--draft-vocab-size", "64", "--output-dir", str(out), "--save-every", "2"]
    common += "--eval-prompts 0 --trace-level off --seq-len 32 --batch-size 2".split()
    first = CliRunner().invoke(cli, ["train", "--steps", "2", *common], catch_exceptions=False)
    assert first.exit_code == 0, first.output
    more = ["train", "--steps", "4", "--resume", "latest", *common]
    resumed = CliRunner().invoke(cli, more, catch_exceptions=False)
    assert resumed.exit_code == 0, resumed.output
    assert "resumed from" in resumed.output
    assert json.loads((out / "summary.json").read_text())["steps"] == 4

    module = _module()
    weights = {**trainable_weights(module), "0.weight": torch.zeros(4, 3)}
    with pytest.raises(CheckpointError, match="differs from this run's"):
        load_trainable_weights(module, weights)
