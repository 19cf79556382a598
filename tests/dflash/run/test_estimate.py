import dataclasses
import json
import math
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from dflash.cli import cli
from dflash.config.settings import config_from_options, values_from_mapping
from dflash.run.estimate import (
    GIB,
    EstimateError,
    StepShape,
    estimate_for_config,
    estimate_step,
    geometry_for_spec,
    shape_for_config,
    tokens_per_step,
)
from dflash.run.size_checks import check_sizes_before_work
from dflash.target.geometry import TargetError, TargetGeometry
from dflash.target.synthetic import QWEN3_8B
from tests.dflash.app_fixtures import tiny_target  # noqa: F401 - fixture

PAPER = Path(__file__).parents[3] / "configs" / "paper.yaml"


def paper_options() -> dict:
    return values_from_mapping(yaml.safe_load(PAPER.read_text()), str(PAPER))


def paper_shape(**changes) -> StepShape:
    """The paper recipe's step on a GPU; `changes` are StepShape fields."""
    cfg = config_from_options(paper_options())
    return dataclasses.replace(shape_for_config(cfg, QWEN3_8B, "cuda"), **changes)


def test_qwen3_8b_has_its_published_parameter_count() -> None:
    assert QWEN3_8B.params() / 1e9 == pytest.approx(8.19, rel=0.01)


def test_the_paper_recipe_fits_one_h200_with_the_chunked_loss_not_with_the_dense_one() -> None:
    shape = paper_shape()
    sizes = (shape.batch_size, shape.num_anchors, shape.seq_len, shape.block_size)
    assert sizes == (4, 512, 3072, 16)
    chunked = estimate_step(shape)
    dense = estimate_step(paper_shape(loss_chunk_size=None, soft_labels=True))
    h200 = 141e9
    assert chunked.warning(h200) is None
    assert dense.warning(h200) is not None and "GiB" in dense.warning(h200)
    assert dense.memory_bytes["loss"] > 50 * chunked.memory_bytes["loss"]


def test_chunked_loss_memory_does_not_grow_with_anchors_but_the_dense_one_does() -> None:
    def loss_gib(anchors: int, chunk: int | None) -> float:
        shape = paper_shape(num_anchors=anchors, loss_chunk_size=chunk)
        return estimate_step(shape).memory_bytes["loss"] / GIB

    assert loss_gib(128, 32) == loss_gib(512, 32)
    assert loss_gib(512, None) == pytest.approx(4 * loss_gib(128, None))


def test_flops_follow_two_per_parameter_per_token_for_the_target() -> None:
    shape = paper_shape(grad_accum=2)
    flops = estimate_step(shape).flops
    non_embedding = QWEN3_8B.params() - 2 * QWEN3_8B.vocab_size * QWEN3_8B.hidden_size
    assert flops["target"] / (2 * non_embedding * tokens_per_step(shape)) == pytest.approx(
        1.0, abs=0.15
    )  # attention adds a little
    plain = estimate_step(shape)
    ckpt = estimate_step(paper_shape(grad_accum=2, activation_checkpointing=True))
    assert ckpt.flops["drafter"] == pytest.approx(flops["drafter"] * 4 / 3)
    kept, full = ckpt.memory_bytes["drafter activations"], plain.memory_bytes["drafter activations"]
    assert kept < full / 2


def test_bad_shapes_name_the_value() -> None:
    with pytest.raises(EstimateError, match="--loss-chunk-size 0"):
        paper_shape(loss_chunk_size=0)
    with pytest.raises(EstimateError, match="grad_accum 0"):
        paper_shape(grad_accum=0)


def test_the_paper_config_loads_as_the_papers_recipe() -> None:
    cfg = config_from_options(paper_options())
    assert cfg.target.spec == "Qwen/Qwen3-8B"
    assert (cfg.drafter.block_size, cfg.drafter.num_layers, cfg.loss.num_anchors) == (16, 5, 512)
    assert (cfg.data.seq_len, cfg.optim.lr, cfg.gamma) == (3072, 6e-4, 7.0)
    assert cfg.optim.warmup_steps > 0 and cfg.loss.loss_chunk_size >= 1
    shape = shape_for_config(cfg, QWEN3_8B, "cuda")
    assert (shape.attention, shape.target_bytes, shape.loss_chunk_size) == ("flex", 2, 32)


def test_dry_run_of_the_paper_config_prints_the_estimate_and_loads_nothing(monkeypatch) -> None:
    from dflash.target import load as target_mod

    def no_load(*_args, **_kwargs):
        raise AssertionError("--dry-run must not load the target")

    monkeypatch.setattr(target_mod, "load_target", no_load)
    result = CliRunner().invoke(cli, ["train", "--config", str(PAPER), "--dry-run"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "Qwen/Qwen3-8B" in lines[0] and "4 rows x 3072 tokens" in lines[0]
    gpu = next(line for line in lines if line.startswith("estimate on cuda"))
    expected = estimate_step(paper_shape())
    assert f"{expected.total_bytes / GIB:.1f} GiB" in gpu and "TFLOP" in gpu


def test_target_geometry_without_weights(tmp_path) -> None:
    assert geometry_for_spec("Qwen/Qwen3-8B")[0] == QWEN3_8B
    hf_config = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3}
    hf_config |= {"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 500}
    (tmp_path / "config.json").write_text(json.dumps({"text_config": hf_config}))
    sizes = dict(hidden_size=64, num_layers=3, intermediate_size=96, vocab_size=500)
    heads = dict(num_heads=4, num_kv_heads=2, head_dim=16)
    assert geometry_for_spec(str(tmp_path))[0] == TargetGeometry(**sizes, **heads)
    tiny, _ = geometry_for_spec("builtin:tiny")
    assert tiny.vocab_size > 256 and tiny.num_layers >= 4
    with pytest.raises(EstimateError, match="'/no/such/model'"):
        geometry_for_spec("/no/such/model")


def test_target_layers_are_checked_against_the_targets_config_before_any_work() -> None:
    check_sizes_before_work(config_from_options({}), "cpu", math.inf)  # builtin:tiny: [2]
    with pytest.raises(TargetError, match="--drafter-layers 7: .* only 6 distinct layers"):
        check_sizes_before_work(config_from_options({"drafter_layers": 7}), "cpu", math.inf)
    with pytest.raises(TargetError, match="target layer id 6 is out of range"):
        check_sizes_before_work(config_from_options({"target_layers": (1, 6)}), "cpu", math.inf)
    # From per-sample files the layers may be the files' own: known once they are opened.
    cached = config_from_options({"drafter_layers": 7, "hidden_cache": "cache/"})
    check_sizes_before_work(cached, "cpu", math.inf)


@pytest.mark.usefixtures("tiny_target")
def test_more_drafter_layers_than_target_layers_is_one_line_and_exit_2(tmp_path) -> None:
    run = tmp_path / "run"
    args = ["train", "--drafter-layers", "7", "--steps", "1", "--output-dir", str(run)]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 2, result.output
    (error,) = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert "--drafter-layers 7" in error and "--target-layers" in error
    assert not run.exists() and "Traceback" not in result.output


def test_a_config_beyond_the_device_memory_gets_one_warning_line_with_the_estimate() -> None:
    cfg = config_from_options(paper_options())
    fits = estimate_for_config(cfg, QWEN3_8B, "cuda", device_bytes=math.inf)
    assert len(fits) == 1 and fits[0].startswith("estimate on cuda (bf16 autocast)")
    (line,) = estimate_for_config(cfg, QWEN3_8B, "cuda", device_bytes=16 * GIB)
    assert line.startswith("warning:") and "more than its 16.0 GiB" in line
    assert "estimated peak memory" in line and "--grad-accum" in line


def test_a_streamed_run_is_estimated_without_the_targets_forward() -> None:
    """--target-engine vllm runs the target in the engine: the dry run's step holds the
    drafter's copies of the embedding and head only, as with a hidden cache, and its
    target layers are still checked (the run chooses them)."""
    online = config_from_options(paper_options())
    streamed = config_from_options({**paper_options(), "target_engine": "vllm"})
    cached = config_from_options({**paper_options(), "hidden_cache": "/nowhere"})
    shapes = {name: shape_for_config(cfg, QWEN3_8B, "cuda") for name, cfg in
              (("online", online), ("streamed", streamed), ("cached", cached))}  # fmt: skip
    assert not shapes["online"].from_cache and shapes["streamed"].from_cache
    assert estimate_step(shapes["streamed"]) == estimate_step(shapes["cached"])
    assert (
        estimate_step(shapes["streamed"]).total_bytes < estimate_step(shapes["online"]).total_bytes
    )
    bad = config_from_options({**paper_options(), "target_engine": "vllm", "drafter_layers": 9})
    with pytest.raises(EstimateError, match="drafter"):
        check_sizes_before_work(bad, "cuda", 80 * GIB)
