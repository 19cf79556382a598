"""Damaged targets are refused before training, each in one line naming the target and
what is wrong: a weights file with a tensor missing or one too many, weights that hold
NaN, a folder without a tokenizer, a saved drafter given as the target, and a cached tiny
target cut short (prepared again)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash.target import tiny
from dflash.target.geometry import TargetError
from dflash.target.load import load_target, load_tokenizer
from tests.dflash.app_fixtures import SMALL_LM, write_corpus
from tests.dflash.cli.test_output_checks import invoke, train_args
from tests.dflash.hf_fixtures import save_hf_target

DOWN = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def good_target(tmp_path_factory) -> Path:
    return save_hf_target(tmp_path_factory.mktemp("target"))


def _copy(good: Path, tmp_path: Path, name: str, change=None) -> Path:
    """A copy of the target whose weights `change(state)` edits in place."""
    copy = tmp_path / name
    shutil.copytree(good, copy)
    if change is not None:
        state = load_file(copy / "model.safetensors")
        change(state)
        save_file(state, str(copy / "model.safetensors"), metadata={"format": "pt"})
    return copy


def _one_error(result) -> str:
    """The command's Error: line: exit 2, one such line, the last, no traceback."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and result.output.strip().endswith(errors[0]), result.output
    return errors[0]


def test_a_missing_and_an_unexpected_tensor_are_refused_naming_them(good_target, tmp_path):
    def change(state: dict) -> None:
        del state[DOWN]
        state["model.extra.weight"] = torch.zeros(2)

    damaged = _copy(good_target, tmp_path, "damaged", change)
    with pytest.raises(TargetError) as caught:
        load_target(str(damaged))
    assert str(caught.value) == (
        f"target {damaged}: its weights do not match its config: 1 missing ({DOWN}); "
        "1 unexpected (model.extra.weight); the weights file is damaged or of another model "
        "(transformers would fill what is missing at random)"
    )
    assert load_target(str(good_target)).num_layers == 4  # the whole file loads as before


def test_nan_weights_are_refused_before_any_work_naming_the_layer(good_target, tmp_path):
    def change(state: dict) -> None:
        for name in state:
            if name.startswith("model.layers.1.") and name.endswith("proj.weight"):
                state[name].fill_(float("nan"))

    nan = _copy(good_target, tmp_path, "nan", change)
    with pytest.raises(TargetError) as caught:
        load_target(str(nan))
    line = str(caught.value)
    assert line.startswith(f"target {nan}: its hidden states are NaN or inf from layer 2 of 4 on")
    assert "7 weight tensors hold NaN or inf (model.layers.1.self_attn.q_proj.weight, " in line
    output = tmp_path / "run"
    result = invoke(train_args(tmp_path, output, "--target", nan, "--steps", 3))
    assert "its hidden states are NaN or inf from layer 2 of 4" in _one_error(result)
    assert not (output / "drafter").exists()


def test_a_folder_without_a_tokenizer_is_told_before_its_weights_load(good_target, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy(good_target / name, bare / name)
    said = (
        f"target {bare} has no usable tokenizer (it encodes text to no tokens; 1 in its "
        "vocabulary): its folder has no tokenizer files (tokenizer.json, tokenizer.model, "
        "vocab.json, ...); copy them from the model it came from"
    )
    for load in (load_tokenizer, load_target):
        with pytest.raises(TargetError) as caught:
            load(str(bare))
        assert str(caught.value) == said
    result = invoke(train_args(tmp_path, tmp_path / "run", "--target", bare))
    assert _one_error(result) == f"Error: {said}"  # not "corpus is empty"


def _saved_drafter(folder: Path, target: Path) -> Path:
    """A drafter's config.json (a Qwen3 config naming the drafter architecture) and the
    dflash_train.json naming its target."""
    folder.mkdir(parents=True)
    config = json.loads((target / "config.json").read_text())
    config |= {"architectures": ["DFlashDraftModel"], "num_hidden_layers": 1, "block_size": 4}
    (folder / "config.json").write_text(json.dumps(config))
    meta = {"format_version": 1, "target": str(target)}
    (folder / "dflash_train.json").write_text(json.dumps(meta))
    return folder


def test_a_saved_drafter_as_the_target_is_named_as_one(good_target, tmp_path):
    drafter = _saved_drafter(tmp_path / "run" / "drafter", good_target)
    said = (
        f"target {drafter} is a saved DFlash drafter (DFlashDraftModel), not a target model: "
        f"give the model it drafts for as --target ({good_target}, its dflash_train.json "
        "says), and this folder as --drafter"
    )
    for load in (load_tokenizer, load_target):
        with pytest.raises(TargetError) as caught:
            load(str(drafter))
        assert str(caught.value) == said
    corpus = write_corpus(tmp_path)
    out = tmp_path / "r.jsonl"
    regen = ["regenerate", "--target", drafter, "--data", corpus, "--output", out]
    assert _one_error(invoke(regen)) == f"Error: {said}"  # not "nothing to regenerate"
    assert not out.exists()
    result = invoke(train_args(tmp_path, tmp_path / "new", "--target", drafter))
    assert _one_error(result) == f"Error: {said}"


@pytest.fixture
def quick_tiny(monkeypatch):
    """The tiny target's preparation by a stand-in trainer: seconds."""
    monkeypatch.setattr(tiny, "train_tiny_lm", lambda cfg, recipe, seed, log: tiny.TinyLM(cfg))
    monkeypatch.setattr(tiny, "heldout_loss", lambda model, recipe, seed: 1.0)


@pytest.mark.usefixtures("quick_tiny")
def test_a_cached_tiny_target_cut_short_is_prepared_again(tmp_path):
    lines: list[str] = []
    path = tiny.prepare_builtin_target(tmp_path, log=lines.append, cfg=SMALL_LM)
    weights = path / "model.safetensors"
    whole = weights.read_bytes()
    assert json.loads((path / "config.json").read_text())["sha256"] == tiny.sha256_file(weights)
    weights.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(TargetError, match=r"model.safetensors: its weights do not load \("):
        tiny.load_tiny_lm(path)  # never a SafetensorError traceback
    lines.clear()
    assert tiny.prepare_builtin_target(tmp_path, log=lines.append, cfg=SMALL_LM) == path
    said = f"tiny target: the cached {path} has other weights than it recorded (another SHA-256)"
    assert f"{said}: it is prepared again" in lines
    assert tiny.load_tiny_lm(path).config == SMALL_LM


@pytest.mark.usefixtures("quick_tiny")
def test_a_cached_tiny_target_of_an_earlier_version_is_kept_unless_it_does_not_load(tmp_path):
    path = tiny.prepare_builtin_target(tmp_path, log=lambda _: None, cfg=SMALL_LM)
    meta = json.loads((path / "config.json").read_text())
    del meta["sha256"]  # as written before the SHA-256 was recorded
    (path / "config.json").write_text(json.dumps(meta))
    lines: list[str] = []
    assert tiny.prepare_builtin_target(tmp_path, log=lines.append, cfg=SMALL_LM) == path
    assert lines == []  # it loads: kept
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    assert tiny.prepare_builtin_target(tmp_path, log=lines.append, cfg=SMALL_LM) == path
    assert f"tiny target: the cached {path} has weights that do not load: it is prepared again" in (
        lines
    )
    assert tiny.load_tiny_lm(path).config == SMALL_LM
