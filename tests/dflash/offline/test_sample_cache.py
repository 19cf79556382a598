"""Per-sample hidden-state files in speculators' layout: `cache-hidden --format
speculators` writes them, `train --hidden-cache` trains from them (and from files as
speculators' vLLM data generation writes them), and what bad files get."""

import json
import re
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from dflash import names
from dflash.cli import cli
from dflash.offline.sample_cache import (
    cache_format,
    open_sample_cache,
    sample_datasets,
)
from dflash.offline.sample_file import SampleCacheError, SampleFile
from dflash.offline.sample_reader import SampleCacheReader
from dflash.run import pipelined as pipeline
from dflash.target.load import wrap_tiny
from dflash.target.model import TargetModel
from dflash.target.tiny import TinyLM
from tests.dflash.app_fixtures import (  # noqa: F401 - fixture
    SMALL_LM,
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
    data = ["--data", str(write_corpus(tmp_path))]
    args = ["cache-hidden", "--format", "speculators", "--output", str(out), *data]
    args += _flags({**OPTS, **extra})
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out


def _train(tmp_path, cache, out="o", **extra):
    args = ["train", "--hidden-cache", str(cache), "--data", str(write_corpus(tmp_path))]
    args += ["--block-size", "4", "--eval-prompts", "0", "--output-dir", str(tmp_path / out)]
    args += ["--overwrite", *_flags({**OPTS, **extra})]
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
    ids, hidden = torch.zeros(4, dtype=torch.long), torch.zeros(4, 32)
    tensors = {"input_ids": ids, "loss_mask": torch.ones(4), "hidden_states": hidden}
    save_file(tensors, str(flat / "hs_0.safetensors"))
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
    wider = torch.cat([good["hidden_states"]] * 2, 1)
    save_file({**good, "hidden_states": wider}, str(files / "hs_5.safetensors"))
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
    # Files alike but not those the manifest describes: one line before any step.
    for file in files.glob("hs_*.safetensors"):
        sample = load_file(str(file))
        fewer = sample["hidden_states"][:, 1:].contiguous()
        save_file({**sample, "hidden_states": fewer}, str(file))
    assert "names target layers" in _one_error(_train(tmp_path, cache))


def test_a_directory_of_neither_format_is_named(tmp_path):
    with pytest.raises(SampleCacheError, match="neither a hidden-state cache"):
        cache_format(tmp_path)


def _flat_samples(where: Path, lengths: list[int]) -> list[dict[str, torch.Tensor]]:
    """Older speculators files, [t, K*D] with the verifier's last layer apart: K=1, D=32
    (the small target's width), random states."""
    where.mkdir()
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i, t in enumerate(lengths):
        sample = {
            "input_ids": torch.randint(0, 200, (t,), generator=gen),
            "loss_mask": torch.ones(t, dtype=torch.bool),
            "hidden_states": torch.randn(t, 32, generator=gen),
            "verifier_last_hidden_states": torch.randn(t, 32, generator=gen),
        }
        save_file(sample, str(where / f"hs_{i}.safetensors"))
        samples.append(sample)
    return samples


def _small_target() -> TargetModel:
    torch.manual_seed(123)
    return wrap_tiny(TinyLM(SMALL_LM))


def test_the_reader_gives_the_files_states_and_counts_every_byte_it_reads(tmp_path: Path) -> None:
    """With soft labels a flat file's verifier states are read too: the reader's byte
    count (the interval table's cache-read MiB/s) holds them beside the hidden states."""
    samples = _flat_samples(tmp_path / "flat", [5, 7, 3])
    target = _small_target()
    cache = open_sample_cache(tmp_path / "flat", target=target, layer_ids=[3], soft_labels=True)
    train, _, rows = sample_datasets(
        cache, seq_len=16, batch_size=1, seed=0, heldout_fraction=0.0, pad_id=0
    )
    norm = target.final_norm()
    reader = SampleCacheReader(cache, train, rows, norm)
    out = reader.read(train.batch(0))
    (row,) = train.row_indices(0)
    segments = rows.segments[int(row)]
    assert sorted(index for index, _, _ in segments) == [0, 1, 2]  # all in one row of 16
    for index, start, length in segments:
        span = slice(start, start + length)
        torch.testing.assert_close(out.hidden[0, span], samples[index]["hidden_states"])
        with torch.no_grad():
            final = norm(samples[index]["verifier_last_hidden_states"])
        torch.testing.assert_close(out.final_hidden[0, span], final)
    # Both tensors of every sample, float32: 15 positions x 2 x 32 x 4 bytes.
    assert reader.bytes_read == 15 * 2 * 32 * 4


def _rewrite_header(path: Path, change: Callable[[dict], None]) -> None:
    """The file with its JSON header changed by `change` (the data left as it was)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    change(header)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


def _past_the_end(header: dict) -> None:
    header["loss_mask"]["data_offsets"] = [10**6, 10**6 + 5]
    header["loss_mask"]["shape"] = [5]


def _shorter_than_its_shape(header: dict) -> None:
    header["hidden_states"]["shape"] = [5, 64]


def _no_offsets(header: dict) -> None:
    del header["input_ids"]["data_offsets"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_past_the_end, "truncated, or its header is wrong"),
        (_shorter_than_its_shape, "but offsets"),
        (_no_offsets, "is not a tensor's"),
    ],
    ids=["offsets past the end", "offsets short of the shape", "no offsets"],
)
def test_a_header_that_lies_is_one_line_naming_the_file_or_a_counted_skip(
    tmp_path: Path, change: Callable[[dict], None], message: str
) -> None:
    _flat_samples(tmp_path / "flat", [5, 5])
    bad = tmp_path / "flat" / "hs_1.safetensors"
    _rewrite_header(bad, change)
    with pytest.raises(OSError, match=f"hs_1.safetensors: .*{message}"):
        SampleFile(bad, 32)
    target = _small_target()
    with pytest.raises(
        SampleCacheError, match=f"sample {re.escape(str(bad))} is unreadable .*{message}"
    ):
        open_sample_cache(
            tmp_path / "flat", target=target, layer_ids=[3], soft_labels=False, strict=True
        )
    cache = open_sample_cache(tmp_path / "flat", target=target, layer_ids=[3], soft_labels=False)
    assert list(cache.samples) == [0] and cache.skipped.unreadable == 1


def test_a_header_longer_than_its_file_or_not_json_is_named(tmp_path: Path) -> None:
    path = tmp_path / "hs_0.safetensors"
    path.write_bytes(struct.pack("<Q", 100) + b"{}")
    with pytest.raises(OSError, match="hs_0.safetensors: header of 100 bytes in a file of 10"):
        SampleFile(path, 32)
    path.write_bytes(struct.pack("<Q", 2) + b"{x")
    with pytest.raises(OSError, match="hs_0.safetensors: header is not JSON"):
        SampleFile(path, 32)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
@pytest.mark.usefixtures("tiny_target")
def test_two_gloo_ranks_train_from_speculators_files(tmp_path):
    """The multi-node recipe of docs/serving.md on one host: 2 torchrun ranks (gloo) read the
    files `cache-hidden --format speculators` wrote and train one drafter."""
    cache = _write(tmp_path, tmp_path / "cache")
    out = tmp_path / "run"
    args = ["train", "--hidden-cache", str(cache), "--block-size", "4", "--eval-prompts", "0"]
    args += ["--output-dir", str(out), *_flags({**OPTS, "steps": 4})]
    command = [*torchrun_command(2), __file__, *args]
    proc = subprocess.run(command, env=script_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["pipeline"]["world_size"] == 2 and summary["steps"] == 4
    assert summary["hidden_cache_skipped"]["nonfinite"] == 0
    assert "2 ranks" in (proc.stdout + proc.stderr).split("interval: total")[-1].splitlines()[0]


if __name__ == "__main__":  # a torchrun worker: the small target, then the command line
    small_target_everywhere()
    cli(sys.argv[1:], prog_name="dflash-train")
