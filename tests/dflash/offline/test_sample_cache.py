"""Per-sample hidden-state files in speculators' layout: `cache-hidden --format
speculators` writes them, `train --hidden-cache` trains from them (and from files as
speculators' vLLM data generation writes them), and what bad files get."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from dflash import names
from dflash.cli import cli
from dflash.offline.sample_cache import SampleCacheError, cache_format
from dflash.run import pipelined as pipeline
from tests.dflash.app_fixtures import (  # noqa: F401 - fixture
    record_losses,
    script_env,
    small_cfg,
    small_target_everywhere,
    tiny_target,
    torchrun_command,
    write_corpus,
)
from tests.dflash.offline.test_hidden_cache import _traced

OPTS = {"seq_len": 32, "batch_size": 2, "drafter_layers": 1, "steps": 6}


def _flags(opts: dict) -> list[str]:
    out = []
    for key, value in opts.items():
        out += ["--" + key.replace("_", "-")] + ([] if value is True else [str(value)])
    return out


def _write(tmp_path, out, **extra) -> Path:
    args = ["cache-hidden", "--format", "speculators", "--output", str(out),
            "--data", str(write_corpus(tmp_path)), *_flags({**OPTS, **extra})]  # fmt: skip
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out


def _train(tmp_path, cache, out="o", **extra):
    args = ["train", "--hidden-cache", str(cache), "--data", str(write_corpus(tmp_path)),
            "--block-size", "4", "--eval-prompts", "0", "--output-dir", str(tmp_path / out),
            "--overwrite", *_flags({**OPTS, **extra})]  # fmt: skip
    return CliRunner().invoke(cli, args, catch_exceptions=False)


def _one_error(result) -> str:
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    return errors[0]


@pytest.mark.slow
@pytest.mark.usefixtures("tiny_target")
@pytest.mark.parametrize("soft", [False, True])
def test_training_from_speculators_files_gives_the_online_losses(tmp_path, monkeypatch, soft):
    extra = {"use_soft_labels": True} if soft else {}
    cache = _write(tmp_path, tmp_path / "cache", **extra)
    assert cache_format(cache) == "speculators"
    manifest = json.loads((cache / "dflash_samples.json").read_text())
    sample = load_file(str(cache / "hidden_states" / "hs_0.safetensors"))
    k = len(manifest["layer_ids"])
    assert sample["hidden_states"].shape[1:] == (k + 1, 32)  # [t, layers + the last, D]
    assert sample["token_ids"].dtype == torch.int64 and sample["loss_mask"].shape == (
        sample["token_ids"].shape[0],
    )
    assert manifest["aux_hidden_state_layer_ids"] == [i + 1 for i in manifest["layer_ids"]]
    seen = record_losses(monkeypatch)
    opts = {**OPTS, "use_soft_labels": soft, "log_every": 1, "block_size": 4, "steps": 20}
    data = str(write_corpus(tmp_path))
    online, _ = _traced(
        lambda: pipeline.run_pipeline(
            small_cfg(tmp_path, tmp_path / "online", data=data, **opts), log=lambda _: None
        )
    )
    online_losses, seen[:] = list(seen), []
    cfg = small_cfg(tmp_path, tmp_path / "cached", data=data, hidden_cache=str(cache), **opts)
    cached, spans = _traced(lambda: pipeline.run_pipeline(cfg, log=lambda _: None))
    assert [b for b, _ in seen] == list(range(20))  # the bar: 20 steps equal to 1e-5
    for (_, a), (_, b) in zip(seen, online_losses, strict=True):
        assert a == pytest.approx(b, abs=1e-5)
    assert names.TARGET_READ in spans and names.TARGET_FORWARD not in spans


def _speculators_files(tmp_path, cache) -> Path:
    """The files as speculators' vLLM data generation leaves them: no manifest, and (the
    0.9 layout) no loss mask inside; here the loss mask stays, as older files had it."""
    (cache / "dflash_samples.json").unlink()
    return cache


@pytest.mark.usefixtures("tiny_target")
def test_files_without_a_manifest_train_with_the_layers_named(tmp_path):
    cache = _speculators_files(tmp_path, _write(tmp_path, tmp_path / "cache"))
    assert "do not record their layers" in _one_error(_train(tmp_path, cache))
    result = _train(tmp_path, cache, target_layers="3")  # the tiny target's default for 1 layer
    assert result.exit_code == 0, result.output
    assert "speculators' aux ids [4]" in result.output
    assert "the target's decoder layers never run while training" in result.output
    assert "cache read" in result.output  # the reader's MiB/s in the interval table
    assert (
        "files hold 1 auxiliary layers (then the last layer), --target-layers names 2"
        in _one_error(_train(tmp_path, cache, target_layers="1,3"))
    )


@pytest.mark.usefixtures("tiny_target")
def test_samples_only_writes_the_samples_and_rows_of_the_whole_cache(tmp_path):
    """What an engine is given to extract (tools/vllm/extract_hidden_states.py) is what
    cache-hidden would have written, sample for sample, with the same manifest."""
    whole = _write(tmp_path, tmp_path / "whole")
    plan = _write(tmp_path, tmp_path / "plan", samples_only=True)
    assert not (plan / "hidden_states").exists()
    manifest = json.loads((plan / "dflash_samples.json").read_text())
    assert manifest == json.loads((whole / "dflash_samples.json").read_text())
    lines = [json.loads(line) for line in (plan / "samples.jsonl").read_text().splitlines()]
    assert [line["index"] for line in lines] == list(range(len(lines)))
    for line in lines:
        sample = load_file(str(whole / "hidden_states" / f"hs_{line['index']}.safetensors"))
        assert line["token_ids"] == sample["token_ids"].tolist()
        assert line["loss_mask"] == sample["loss_mask"].int().tolist()
    args = ["cache-hidden", "--samples-only", "--output", str(tmp_path / "x")]
    result = CliRunner().invoke(cli, args)
    assert (
        _one_error(result) == "Error: Invalid value for --samples-only: needs --format speculators"
    )


@pytest.mark.usefixtures("tiny_target")
def test_bad_sample_files_are_one_line_or_a_counted_skip(tmp_path):
    cache = _write(tmp_path, tmp_path / "cache")
    files = cache / "hidden_states"
    (tmp_path / "both").mkdir()
    (tmp_path / "both" / "index.json").write_text("{}")
    save_file(
        {"token_ids": torch.zeros(2, dtype=torch.long), "hidden_states": torch.zeros(2, 1, 32)},
        str(tmp_path / "both" / "hs_0.safetensors"),
    )
    assert "holds both a batch cache" in _one_error(_train(tmp_path, tmp_path / "both"))
    (tmp_path / "empty").mkdir()
    assert "neither a hidden-state cache" in _one_error(_train(tmp_path, tmp_path / "empty"))
    flat = tmp_path / "flat"  # older speculators files: [t, K*D], no verifier states
    flat.mkdir()
    save_file({"input_ids": torch.zeros(4, dtype=torch.long), "loss_mask": torch.ones(4),
               "hidden_states": torch.zeros(4, 32)}, str(flat / "hs_0.safetensors"))  # fmt: skip
    assert "--use-soft-labels: the samples" in _one_error(
        _train(tmp_path, flat, use_soft_labels=True, target_layers="3")
    )
    # A truncated file is left out and counted, or stops the run with --strict-cache.
    raw = (files / "hs_3.safetensors").read_bytes()
    (files / "hs_3.safetensors").write_bytes(raw[:-50])
    result = _train(tmp_path, cache)
    assert result.exit_code == 0, result.output
    assert "1 sample files missing or unreadable, left out" in result.output
    assert "hs_3.safetensors is unreadable" in _one_error(
        _train(tmp_path, cache, strict_cache=True)
    )
    (files / "hs_3.safetensors").write_bytes(raw)
    # Samples of another width, and a loss mask shorter than the tokens.
    good = load_file(str(files / "hs_5.safetensors"))
    save_file({**good, "hidden_states": torch.cat([good["hidden_states"]] * 2, 1)},
              str(files / "hs_5.safetensors"))  # fmt: skip
    assert "samples of different shapes" in _one_error(_train(tmp_path, cache))
    save_file({**good, "loss_mask": good["loss_mask"][:-1]}, str(files / "hs_5.safetensors"))
    assert "loss_mask has" in _one_error(_train(tmp_path, cache))
    # Non-finite states: the sample is not learned from, and the summary counts it.
    bad = good["hidden_states"].clone()
    bad[0, 0, 0] = float("nan")
    save_file({**good, "hidden_states": bad}, str(files / "hs_5.safetensors"))
    result = _train(tmp_path, cache, steps=20, out="nan")
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "nan" / "summary.json").read_text())
    assert summary["hidden_cache_skipped"]["nonfinite"] >= 1
    assert summary["final_loss"] == summary["final_loss"]  # not NaN: nothing learned from it


def test_a_directory_of_neither_format_is_named(tmp_path):
    with pytest.raises(SampleCacheError, match="neither a hidden-state cache"):
        cache_format(tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
@pytest.mark.usefixtures("tiny_target")
def test_two_gloo_ranks_train_from_speculators_files(tmp_path):
    """The multi-node recipe of the README on one host: 2 torchrun ranks (gloo) read the
    files `cache-hidden --format speculators` wrote and train one drafter."""
    cache = _write(tmp_path, tmp_path / "cache")
    out = tmp_path / "run"
    args = ["train", "--hidden-cache", str(cache), "--block-size", "4", "--eval-prompts", "0",
            "--output-dir", str(out), *_flags({**OPTS, "steps": 4})]  # fmt: skip
    proc = subprocess.run([*torchrun_command(2), __file__, *args], env=script_env(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["pipeline"]["world_size"] == 2 and summary["steps"] == 4
    assert summary["hidden_cache_skipped"]["nonfinite"] == 0
    assert "2 ranks" in (proc.stdout + proc.stderr).split("interval: total")[-1].splitlines()[0]


if __name__ == "__main__":  # a torchrun worker: the small target, then the command line
    small_target_everywhere()
    cli(sys.argv[1:], prog_name="dflash-train")
