from pathlib import Path

import pytest
import yaml

from dflash.estimate import (
    GIB,
    EstimateError,
    Geometry,
    StepShape,
    estimate_step,
    shape_from_options,
    tokens_per_step,
)

QWEN3_8B = Geometry(4096, 12_288, 36, 32, 8, 128, 151_936)
PAPER = Path(__file__).parents[2] / "configs" / "paper.yaml"


def paper_shape(**changes) -> StepShape:
    options = yaml.safe_load(PAPER.read_text()) | changes
    return shape_from_options(options, QWEN3_8B)


def test_qwen3_8b_has_its_published_parameter_count() -> None:
    assert QWEN3_8B.params() / 1e9 == pytest.approx(8.19, rel=0.01)


def test_the_paper_recipe_fits_one_h200_with_the_chunked_loss_not_with_the_dense_one() -> None:
    shape = paper_shape()
    assert (shape.batch_size, shape.num_anchors, shape.seq_len, shape.block_size) == (
        4, 512, 3072, 16,
    )  # fmt: skip
    chunked = estimate_step(shape)
    dense = estimate_step(paper_shape(loss_chunk_size=None, use_soft_labels=True))
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
